//! Small helpers filters keep needing.

use base64::Engine as _;
use base64::engine::general_purpose::{URL_SAFE, URL_SAFE_NO_PAD};

/// Decodes base64url (RFC 4648 §5), with or without padding (JWTs use none).
pub fn base64url_decode(input: &str) -> Option<Vec<u8>> {
    if input.ends_with('=') {
        URL_SAFE.decode(input).ok()
    } else {
        URL_SAFE_NO_PAD.decode(input).ok()
    }
}

/// Encodes base64url without padding.
pub fn base64url_encode(input: &[u8]) -> String {
    URL_SAFE_NO_PAD.encode(input)
}

/// Percent-decodes `input`, turning `+` into a space (form encoding). Invalid escapes
/// are kept as they are; bytes that do not form UTF-8 become replacement characters.
pub fn percent_decode(input: &str) -> String {
    let bytes = input.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => match (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                (Some(h), Some(l)) => {
                    out.push(h << 4 | l);
                    i += 2;
                }
                _ => out.push(b'%'),
            },
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// The first value of parameter `name` in a query string (`a=1&b=2`), decoded.
pub fn query_param(query: &str, name: &str) -> Option<String> {
    query.split('&').find_map(|pair| {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        (percent_decode(key) == name).then(|| percent_decode(value))
    })
}

/// The value of cookie `name` in one `Cookie` header line (`a=1; b=2`).
pub fn cookie(line: &str, name: &str) -> Option<String> {
    line.split(';').find_map(|pair| {
        let (key, value) = pair.trim().split_once('=')?;
        (key.trim() == name).then(|| value.trim().trim_matches('"').to_owned())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64url_round_trips_with_and_without_padding() {
        let data = b"\xfb\xff\x00hello";
        let enc = base64url_encode(data);
        assert!(!enc.contains('=') && !enc.contains('+') && !enc.contains('/'));
        assert_eq!(base64url_decode(&enc).as_deref(), Some(&data[..]));
        assert_eq!(base64url_decode("aGk=").as_deref(), Some(&b"hi"[..]));
        assert_eq!(base64url_decode("a*b"), None);
    }

    #[test]
    fn query_params_decode() {
        let q = "a=1&token=x%2By+z&empty&a=2&bad=%zz";
        assert_eq!(query_param(q, "a").as_deref(), Some("1"));
        assert_eq!(query_param(q, "token").as_deref(), Some("x+y z"));
        assert_eq!(query_param(q, "empty").as_deref(), Some(""));
        assert_eq!(query_param(q, "bad").as_deref(), Some("%zz"));
        assert_eq!(query_param(q, "missing"), None);
        assert_eq!(percent_decode("%4"), "%4");
        assert_eq!(percent_decode("100%"), "100%");
    }

    #[test]
    fn cookies_are_found_by_name() {
        let line = "theme=dark; session=\"abc\" ;  id=7";
        assert_eq!(cookie(line, "session").as_deref(), Some("abc"));
        assert_eq!(cookie(line, "id").as_deref(), Some("7"));
        assert_eq!(cookie(line, "ses"), None);
    }
}

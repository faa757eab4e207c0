//! What never leaves the node in a tap or an access log: credentials in headers and
//! in query parameters. The names are matched case-insensitively; a value is replaced
//! by `[redacted]`, so a reader still sees that the request carried one.

/// Written instead of a secret.
pub const REDACTED: &str = "[redacted]";

/// Headers whose values are credentials (or carry them).
const SECRET_HEADERS: &[&str] = &[
    "authorization",
    "proxy-authorization",
    "cookie",
    "set-cookie",
    "x-api-key",
    "x-auth-token",
    "x-amz-security-token",
];

/// Parts of a name that mark a credential (`x-upstream-token`, `client_secret`,
/// `access_token`, `apikey`, `password`, `sig`).
const SECRET_WORDS: &[&str] = &[
    "token",
    "secret",
    "password",
    "passwd",
    "apikey",
    "api_key",
    "api-key",
    "credential",
    "signature",
    "session",
    "auth",
];

/// Whether a header or parameter named `name` holds a secret.
pub fn is_secret(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    SECRET_HEADERS.contains(&lower.as_str())
        || SECRET_WORDS.iter().any(|w| lower.contains(w))
        || matches!(lower.as_str(), "key" | "sig" | "code" | "jwt" | "pass")
}

/// `value` of header `name`, or [`REDACTED`].
pub fn header_value<'a>(name: &str, value: &'a str) -> &'a str {
    if is_secret(name) { REDACTED } else { value }
}

/// `path` with the values of secret query parameters replaced (the path itself and
/// the other parameters kept as they came).
pub fn path(path: &str) -> String {
    let Some((before, query)) = path.split_once('?') else {
        return path.to_owned();
    };
    let mut out = String::with_capacity(path.len());
    out.push_str(before);
    out.push('?');
    for (i, pair) in query.split('&').enumerate() {
        if i > 0 {
            out.push('&');
        }
        match pair.split_once('=') {
            Some((name, _)) if is_secret(&percent_decoded(name)) => {
                out.push_str(name);
                out.push('=');
                out.push_str(REDACTED);
            }
            _ => out.push_str(pair),
        }
    }
    out
}

/// A parameter name with its `%XX` escapes decoded (so `access%5Ftoken` is seen).
fn percent_decoded(name: &str) -> String {
    let bytes = name.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (bytes[i], bytes.get(i + 1), bytes.get(i + 2)) {
            (b'%', Some(&h), Some(&l)) if hex(h).is_some() && hex(l).is_some() => {
                out.push((hex(h).unwrap_or(0) * 16 + hex(l).unwrap_or(0)) as u8);
                i += 3;
            }
            (b'+', _, _) => {
                out.push(b' ');
                i += 1;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_in_headers_are_redacted_and_the_rest_kept() {
        for secret in [
            "Authorization",
            "cookie",
            "X-Api-Key",
            "x-upstream-token",
            "proxy-authorization",
        ] {
            assert_eq!(header_value(secret, "Bearer abc"), REDACTED, "{secret}");
        }
        for plain in ["user-agent", "accept", "x-request-id", "traceparent"] {
            assert_eq!(header_value(plain, "v"), "v", "{plain}");
        }
    }

    #[test]
    fn secret_query_parameters_are_redacted_even_escaped() {
        assert_eq!(path("/hotels?user=7"), "/hotels?user=7");
        assert_eq!(path("/x"), "/x");
        assert_eq!(
            path("/cb?code=abc&state=s&access_token=eyJ&user=1"),
            "/cb?code=[redacted]&state=s&access_token=[redacted]&user=1"
        );
        assert_eq!(
            path("/x?access%5Ftoken=eyJ&API_KEY=k"),
            "/x?access%5Ftoken=[redacted]&API_KEY=[redacted]"
        );
        // A parameter without a value has nothing to hide.
        assert_eq!(path("/x?token&a=1"), "/x?token&a=1");
    }
}

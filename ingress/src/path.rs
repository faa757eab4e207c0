//! Request path normalization (RFC 3986 §6 and Envoy's options): what filters and
//! routing match is what any backend would resolve, so `/ping/../admin`, `/%61dmin`
//! and `//admin` cannot pass a policy on `/admin` that the service would then serve.
//!
//! The output is canonical: no `.`/`..` segments, no `//` (with `merge_slashes`), no
//! escaped unreserved character, escapes in upper case. A backend that normalizes
//! again gets the same path, so the proxy and the service cannot read it two ways.

use std::borrow::Cow;

use dpumesh_config::{EscapedSlashes, PathConfig};

/// Why a path is refused (answered 400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    #[error("invalid percent-encoding at byte {at} of the path")]
    InvalidEscape { at: usize },
    #[error("encoded slash or backslash ({escape}) in the path is refused")]
    EscapedSlash { escape: String },
    #[error("percent-encoding in the path decodes to a control byte (%{byte:02X})")]
    ControlByte { byte: u8 },
}

/// RFC 3986 §2.3.
fn unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

fn hex(b: u8) -> Option<u8> {
    char::from(b).to_digit(16).map(|d| d as u8)
}

/// The path filters and routing see. Borrowed when nothing changes (the common case
/// costs one scan). A path that is not origin-form (`*`) is left as it is.
pub fn normalize<'a>(path: &'a str, config: &PathConfig) -> Result<Cow<'a, str>, PathError> {
    if !path.starts_with('/') {
        return Ok(Cow::Borrowed(path));
    }
    let bytes = path.as_bytes();
    let needs_work = bytes.contains(&b'%')
        || (config.merge_slashes && path.contains("//"))
        || (config.normalize && has_dot_segment(path));
    if !needs_work {
        return Ok(Cow::Borrowed(path));
    }
    let decoded = decode(path, config)?;
    let merged = if config.merge_slashes {
        merge_slashes(&decoded)
    } else {
        decoded
    };
    let out = if config.normalize {
        remove_dot_segments(&merged)
    } else {
        merged
    };
    Ok(if out == path {
        Cow::Borrowed(path)
    } else {
        Cow::Owned(out)
    })
}

/// Checks every escape, decodes those of unreserved characters (when normalizing) and
/// applies the escaped-slash action.
fn decode(path: &str, config: &PathConfig) -> Result<String, PathError> {
    let bytes = path.as_bytes();
    let mut out = String::with_capacity(path.len());
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b != b'%' {
            // Copy the run up to the next escape as it is (it may be UTF-8).
            let end = bytes[i..]
                .iter()
                .position(|&c| c == b'%')
                .map_or(bytes.len(), |p| i + p);
            out.push_str(&path[i..end]);
            i = end;
            continue;
        }
        let (Some(hi), Some(lo)) = (
            bytes.get(i + 1).copied().and_then(hex),
            bytes.get(i + 2).copied().and_then(hex),
        ) else {
            return Err(PathError::InvalidEscape { at: i });
        };
        let value = hi << 4 | lo;
        match value {
            b'/' | b'\\' => match config.escaped_slashes {
                EscapedSlashes::Reject => {
                    return Err(PathError::EscapedSlash {
                        escape: path[i..i + 3].to_owned(),
                    });
                }
                EscapedSlashes::Unescape => out.push('/'),
                EscapedSlashes::Keep => push_escape(&mut out, &path[i..i + 3], value, config),
            },
            // A decoded NUL or line break is never a path a backend should see.
            v if v < 0x20 || v == 0x7f => return Err(PathError::ControlByte { byte: v }),
            v if config.normalize && unreserved(v) => out.push(v as char),
            v => push_escape(&mut out, &path[i..i + 3], v, config),
        }
        i += 3;
    }
    Ok(out)
}

/// Keeps an escape, in upper case when normalizing (RFC 3986 §6.2.2.1).
fn push_escape(out: &mut String, original: &str, value: u8, config: &PathConfig) {
    const DIGITS: &[u8; 16] = b"0123456789ABCDEF";
    if config.normalize {
        out.push('%');
        out.push(char::from(DIGITS[usize::from(value >> 4)]));
        out.push(char::from(DIGITS[usize::from(value & 15)]));
    } else {
        out.push_str(original);
    }
}

fn has_dot_segment(path: &str) -> bool {
    path.split('/').any(|s| s == "." || s == "..")
}

fn merge_slashes(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    for c in path.chars() {
        if !(c == '/' && out.ends_with('/')) {
            out.push(c);
        }
    }
    out
}

/// RFC 3986 §5.2.4 for an absolute path: `.` goes, `..` takes the segment before it
/// (never above the root), a path ending in either ends in `/`.
fn remove_dot_segments(path: &str) -> String {
    let segments: Vec<&str> = path[1..].split('/').collect();
    let last = segments.len() - 1;
    let mut out: Vec<&str> = Vec::with_capacity(segments.len());
    for (i, segment) in segments.into_iter().enumerate() {
        match segment {
            "." => {}
            ".." => {
                out.pop();
            }
            s => out.push(s),
        }
        if i == last && (segment == "." || segment == "..") {
            out.push("");
        }
    }
    format!("/{}", out.join("/"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(path: &str) -> Result<String, PathError> {
        normalize(path, &PathConfig::default()).map(Cow::into_owned)
    }

    #[test]
    fn bypass_vectors_become_the_path_a_backend_would_serve() {
        for (input, want) in [
            ("/ping/../admin", "/admin"),
            ("/ping/./../admin", "/admin"),
            ("/%61dmin", "/admin"),
            ("/%2e%2e/admin", "/admin"),
            ("/ping/%2E%2E/admin", "/admin"),
            ("//admin", "/admin"),
            ("/./admin", "/admin"),
            ("/admin/.", "/admin/"),
            ("/a/b/..", "/a/"),
            ("/../../admin", "/admin"),
            ("/a//../admin", "/admin"),
            ("/%7Euser/%41", "/~user/A"),
            ("/caf%c3%a9", "/caf%C3%A9"),
            ("/100%25", "/100%25"),
            ("/%252e%252e/admin", "/%252e%252e/admin"),
        ] {
            assert_eq!(n(input).as_deref(), Ok(want), "{input}");
            // Canonical: normalizing again changes nothing.
            assert_eq!(n(want).as_deref(), Ok(want), "{want} again");
        }
    }

    #[test]
    fn clean_paths_are_borrowed_and_non_origin_forms_kept() {
        let c = PathConfig::default();
        assert!(matches!(normalize("/hotels/7", &c), Ok(Cow::Borrowed(_))));
        assert!(matches!(normalize("/a.b/..c", &c), Ok(Cow::Borrowed(_))));
        assert_eq!(normalize("*", &c).unwrap(), "*");
    }

    #[test]
    fn bad_escapes_and_escaped_slashes_are_refused_by_default() {
        assert_eq!(n("/a%2"), Err(PathError::InvalidEscape { at: 2 }));
        assert_eq!(n("/a%zz"), Err(PathError::InvalidEscape { at: 2 }));
        assert_eq!(n("/%"), Err(PathError::InvalidEscape { at: 1 }));
        assert_eq!(n("/admin%00"), Err(PathError::ControlByte { byte: 0 }));
        assert_eq!(n("/a%0d%0a"), Err(PathError::ControlByte { byte: 0x0d }));
        for v in ["/admin%2Fx", "/admin%2fx", "/admin%5Cx", "/admin%5cx"] {
            assert!(
                matches!(n(v), Err(PathError::EscapedSlash { .. })),
                "{v}: {:?}",
                n(v)
            );
        }
    }

    #[test]
    fn the_escaped_slash_action_and_each_step_follow_the_config() {
        let with = |escaped_slashes, normalize_on, merge| PathConfig {
            normalize: normalize_on,
            merge_slashes: merge,
            escaped_slashes,
        };
        let unescape = with(EscapedSlashes::Unescape, true, true);
        assert_eq!(
            normalize("/ping%2F..%2Fadmin", &unescape).unwrap(),
            "/admin"
        );
        assert_eq!(normalize("/a%5Cb", &unescape).unwrap(), "/a/b");
        let keep = with(EscapedSlashes::Keep, true, true);
        assert_eq!(normalize("/a%2fb", &keep).unwrap(), "/a%2Fb");
        let no_merge = with(EscapedSlashes::Reject, true, false);
        assert_eq!(normalize("/a//b/../c", &no_merge).unwrap(), "/a//c");
        let raw = with(EscapedSlashes::Reject, false, false);
        assert_eq!(normalize("/a/../%61", &raw).unwrap(), "/a/../%61");
        assert!(
            normalize("/a%2", &raw).is_err(),
            "bad escapes are always refused"
        );
    }
}

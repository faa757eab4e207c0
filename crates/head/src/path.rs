//! Request path normalization (RFC 3986 §6 and Envoy's options): what filters and
//! routing match is what any backend would resolve, so `/ping/../admin`, `/%61dmin`
//! and `//admin` cannot pass a policy on `/admin` that the service would then serve.
//! The ingress applies it to every request from outside, and each node to every call
//! a pod makes: one normalizer, one reading of a path.
//!
//! The output is canonical: no `.`/`..` segments, no `//` (with `merge_slashes`), no
//! escaped unreserved character, escapes in upper case. A backend that normalizes
//! again gets the same path, so the proxy and the service cannot read it two ways.
//!
//! Some paths are read differently by backends than by RFC 3986, and are refused by
//! default (each has an option for backends known not to read them so):
//! - `;` path parameters: Tomcat and Spring drop `;...` from a segment, so
//!   `/ping/..;/admin` is `/ping/../admin` to them (`/admin`), but a segment `..;` to
//!   a proxy (under `/ping`);
//! - a raw `\`: IIS, and Windows paths in general, read it as `/`;
//! - `%25` followed by two hex digits (`%252e`): a backend that decodes twice reads
//!   `%2e`, then `.`.

use std::borrow::Cow;

use serde::Deserialize;

use crate::RequestHead;

/// Metadata carrying the path as it was sent, when normalization changed it.
pub const ORIGINAL_PATH_METADATA: &str = "dpumesh.original-path";

impl RequestHead {
    /// Replaces the path by its normalized form (routing, filters and the service all
    /// see that one); the original goes along as metadata [`ORIGINAL_PATH_METADATA`].
    pub fn normalize_path(&mut self, config: &PathConfig) -> Result<(), PathError> {
        let normalized = match normalize(&self.path, config)? {
            Cow::Borrowed(_) => return Ok(()),
            Cow::Owned(p) => p,
        };
        let original = std::mem::replace(&mut self.path, normalized);
        self.set_metadata(ORIGINAL_PATH_METADATA, &original);
        Ok(())
    }
}

/// What is done with `%2F`, `%5C` (and their lower-case forms) in a path: an encoded
/// slash is one segment to a proxy and two to a backend that decodes it, so a policy
/// on `/admin/x` could be bypassed by `/admin%2Fx`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EscapedSlashes {
    /// 400 (Envoy's `REJECT_REQUEST`).
    #[default]
    Reject,
    /// Left as they are (`KEEP_UNCHANGED`): for backends that never decode them.
    Keep,
    /// Decoded to `/` (and `\` to `/`) before the other steps (`UNESCAPE_AND_FORWARD`).
    Unescape,
}

/// What is done with `;` in a path (path parameters).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Semicolons {
    /// 400: Java servlet containers strip `;...` from segments, so `..;` is `..` to
    /// them.
    #[default]
    Reject,
    /// Passed as they are: for backends that treat `;` as an ordinary character.
    Keep,
}

/// What is done with a raw `\` in a path.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Backslashes {
    /// 400: IIS and Windows file servers read it as `/`.
    #[default]
    Reject,
    /// Passed as it is: for backends that treat `\` as an ordinary character.
    Keep,
    /// Read as `/` before the other steps (as those backends would).
    Slash,
}

/// What is done with `%25` followed by two hex digits (an escape of an escape).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DoubleEscapes {
    /// 400: a backend that decodes twice would read another path than the policy.
    #[default]
    Reject,
    /// Passed as they are (`%25` stays escaped): for backends that decode once.
    Keep,
}

/// How request paths are normalized before routing and filters (the mesh file's
/// `ingress.path` section; Envoy's `normalize_path`, `merge_slashes` and
/// `path_with_escaped_slashes_action`, all on by default here, and three refusals
/// of paths backends read differently).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PathConfig {
    /// RFC 3986 §6: decode percent-encoded unreserved characters, upper-case the
    /// other escapes, remove `.` and `..` segments.
    pub normalize: bool,
    /// `//` becomes `/`.
    pub merge_slashes: bool,
    /// See [`EscapedSlashes`].
    pub escaped_slashes: EscapedSlashes,
    /// See [`Semicolons`].
    pub semicolons: Semicolons,
    /// See [`Backslashes`].
    pub backslashes: Backslashes,
    /// See [`DoubleEscapes`].
    pub double_escapes: DoubleEscapes,
}

impl Default for PathConfig {
    fn default() -> Self {
        Self {
            normalize: true,
            merge_slashes: true,
            escaped_slashes: EscapedSlashes::Reject,
            semicolons: Semicolons::Reject,
            backslashes: Backslashes::Reject,
            double_escapes: DoubleEscapes::Reject,
        }
    }
}

/// Why a path is refused (answered 400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    #[error("the path does not start with '/'")]
    NotOriginForm,
    #[error("invalid percent-encoding at byte {at} of the path")]
    InvalidEscape { at: usize },
    #[error("encoded slash or backslash ({escape}) in the path is refused")]
    EscapedSlash { escape: String },
    #[error("percent-encoding in the path decodes to a control byte (%{byte:02X})")]
    ControlByte { byte: u8 },
    #[error("a raw control byte or space (0x{byte:02X}) at byte {at} of the path")]
    RawControl { at: usize, byte: u8 },
    #[error(
        "';' (a path parameter) at byte {at} of the path is refused: servlet containers read `..;` as `..`"
    )]
    Semicolon { at: usize },
    #[error("a backslash at byte {at} of the path is refused: some servers read it as '/'")]
    Backslash { at: usize },
    #[error(
        "an escaped escape (%25 and two hex digits) at byte {at} of the path is refused: a backend that decodes twice reads another path"
    )]
    DoubleEscape { at: usize },
}

/// RFC 3986 §2.3.
fn unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

fn hex(b: u8) -> Option<u8> {
    char::from(b).to_digit(16).map(|d| d as u8)
}

/// The path filters and routing see. Borrowed when nothing changes (the common case
/// costs one scan). `*` (asterisk-form) is left as it is; anything else must start
/// with `/`.
pub fn normalize<'a>(path: &'a str, config: &PathConfig) -> Result<Cow<'a, str>, PathError> {
    if path == "*" {
        return Ok(Cow::Borrowed(path));
    }
    if !path.starts_with('/') {
        return Err(PathError::NotOriginForm);
    }
    let bytes = path.as_bytes();
    let (mut escapes, mut backslash) = (false, false);
    for (at, &b) in bytes.iter().enumerate() {
        match b {
            // HTTP/1 and HTTP/2 parsers refuse these; a pod's head is checked here.
            0..=0x20 | 0x7f => return Err(PathError::RawControl { at, byte: b }),
            b'%' => escapes = true,
            b';' if config.semicolons == Semicolons::Reject => {
                return Err(PathError::Semicolon { at });
            }
            b'\\' => match config.backslashes {
                Backslashes::Reject => return Err(PathError::Backslash { at }),
                Backslashes::Keep => {}
                Backslashes::Slash => backslash = true,
            },
            _ => {}
        }
    }
    let needs_work = escapes
        || backslash
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

/// Checks every escape, decodes those of unreserved characters (when normalizing),
/// applies the escaped-slash and double-escape actions, and turns raw backslashes
/// into slashes when told to.
fn decode(path: &str, config: &PathConfig) -> Result<String, PathError> {
    let bytes = path.as_bytes();
    let mut out = String::with_capacity(path.len());
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b == b'\\' && config.backslashes == Backslashes::Slash {
            out.push('/');
            i += 1;
            continue;
        }
        if b != b'%' {
            // Copy the run up to the next escape or backslash as it is (it may be
            // UTF-8).
            let end = bytes[i..]
                .iter()
                .position(|&c| c == b'%' || c == b'\\')
                .map_or(bytes.len(), |p| i + p);
            let end = if end == i { i + 1 } else { end };
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
            b'%' if config.double_escapes == DoubleEscapes::Reject && escapes_hex(bytes, i + 3) => {
                return Err(PathError::DoubleEscape { at: i });
            }
            // A decoded NUL or line break is never a path a backend should see.
            v if v < 0x20 || v == 0x7f => return Err(PathError::ControlByte { byte: v }),
            v if config.normalize && unreserved(v) => out.push(v as char),
            v => push_escape(&mut out, &path[i..i + 3], v, config),
        }
        i += 3;
    }
    Ok(out)
}

/// Whether the two characters at `at`, once decoded (each raw or an escape: `%32%65`
/// is `2e` as much as `2e` is), are hex digits: after a `%25`, that is an escape a
/// backend decoding twice would decode again.
fn escapes_hex(bytes: &[u8], at: usize) -> bool {
    let decoded = |j: usize| -> Option<(u8, usize)> {
        match *bytes.get(j)? {
            b'%' => Some((
                hex(*bytes.get(j + 1)?)? << 4 | hex(*bytes.get(j + 2)?)?,
                j + 3,
            )),
            b => Some((b, j + 1)),
        }
    };
    let Some((first, next)) = decoded(at) else {
        return false;
    };
    let Some((second, _)) = decoded(next) else {
        return false;
    };
    first.is_ascii_hexdigit() && second.is_ascii_hexdigit()
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
mod tests;

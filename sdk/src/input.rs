//! The batched call's input (WIT 0.1.1 `handle-request`) and the checks an edit gets
//! before it is batched.
//!
//! The encoding (version 1, little-endian):
//!
//! ```text
//! u8 version | u8 scheme (0 http, 1 https) | u16 source port | u32 field count N
//! u64 wall ns | u64 monotonic ns
//! N × (u32 offset, u32 length) into the text; length 0xFFFF_FFFF = absent
//! text: UTF-8, every field's bytes
//! ```
//!
//! Fields in order: method, authority, path, query, destination, source address,
//! source identity, then one per declared header (every value, joined by `\n`, which
//! no header value contains; absent when the header is), then one per declared
//! metadata key. The text is checked as UTF-8 once and every field on its bounds
//! when the input is read; after that, fields are slices of it (no allocation).
//!
//! The proxy's encoder is `dpumesh_runtime::input`; a test there decodes its output
//! with [`Input::decode`].

use std::fmt;

use crate::request::{HeaderError, Method, Peer, RequestLine, Scheme};

/// What a filter reads on every request, declared once ([`crate::Filter::interest`]):
/// the proxy hands these in with each call instead of the filter asking for each.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Interest {
    /// Headers whose values the filter reads (case-insensitive names).
    pub headers: Vec<String>,
    /// Metadata keys the filter reads.
    pub metadata: Vec<String>,
}

impl Interest {
    /// Declares header `name` too.
    pub fn header(mut self, name: impl Into<String>) -> Self {
        self.headers.push(name.into().to_ascii_lowercase());
        self
    }

    /// Declares metadata `key` too.
    pub fn metadata(mut self, key: impl Into<String>) -> Self {
        self.metadata.push(key.into());
        self
    }
}

/// A batched call's input, read in place: every string is a slice of the input's
/// bytes, so reading it allocates nothing (a filter copies only what it asks for).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Input<'a> {
    /// `http` or `https`.
    pub scheme: Scheme,
    /// The sending peer's port.
    pub source_port: u16,
    /// Wall-clock time when the proxy started this request's chain, ns since the epoch.
    pub wall_ns: u64,
    /// Monotonic time at the same moment, ns.
    pub monotonic_ns: u64,
    table: &'a [u8],
    text: &'a str,
    headers: usize,
}

/// Why an input could not be read (a proxy that speaks another encoding).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InputError(String);

impl fmt::Display for InputError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "unreadable call input: {}", self.0)
    }
}

/// The encoding's version.
pub const VERSION: u8 = 1;
const ABSENT: u32 = u32::MAX;
const FIXED: usize = 24;
const FIXED_FIELDS: usize = 7;

#[inline]
fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

#[inline]
fn u64_at(bytes: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(b)
}

impl<'a> Input<'a> {
    /// Reads an input carrying `headers` declared headers and `metadata` declared keys.
    pub fn decode(bytes: &'a [u8], headers: usize, metadata: usize) -> Result<Self, InputError> {
        let err = |why: String| Err(InputError(why));
        if bytes.len() < FIXED {
            return err(format!(
                "{} bytes, the fixed part alone is {FIXED}",
                bytes.len()
            ));
        }
        if bytes[0] != VERSION {
            return err(format!("version {} (this SDK reads {VERSION})", bytes[0]));
        }
        let scheme = match bytes[1] {
            0 => Scheme::Http,
            1 => Scheme::Https,
            other => return err(format!("scheme {other}")),
        };
        let fields = u32_at(bytes, 4) as usize;
        let want = FIXED_FIELDS + headers + metadata;
        if fields != want {
            return err(format!("{fields} fields, {want} expected"));
        }
        let text_at = FIXED + fields * 8;
        if bytes.len() < text_at {
            return err(format!(
                "the field table is cut short ({} bytes)",
                bytes.len()
            ));
        }
        let table = &bytes[FIXED..text_at];
        let Ok(text) = std::str::from_utf8(&bytes[text_at..]) else {
            return err("the text is not UTF-8".into());
        };
        // The other fields are checked when read (a field outside the text reads as
        // absent): most filters read few of them.
        for i in 0..3 {
            let (offset, len) = (u32_at(table, i * 8) as usize, u32_at(table, i * 8 + 4));
            if len == ABSENT
                || text
                    .get(offset..offset.saturating_add(len as usize))
                    .is_none()
            {
                return err(format!("field {i} (method, authority or path) is missing"));
            }
        }
        Ok(Self {
            scheme,
            source_port: u16::from_le_bytes([bytes[2], bytes[3]]),
            wall_ns: u64_at(bytes, 8),
            monotonic_ns: u64_at(bytes, 16),
            table,
            text,
            headers,
        })
    }

    /// Field `i`; absent when the table says so, or when it lies outside the text or
    /// off a character boundary (a broken input).
    #[inline]
    fn field(&self, i: usize) -> Option<&'a str> {
        if (i + 1) * 8 > self.table.len() {
            return None;
        }
        let (offset, len) = (
            u32_at(self.table, i * 8) as usize,
            u32_at(self.table, i * 8 + 4),
        );
        if len == ABSENT {
            return None;
        }
        self.text.get(offset..offset.saturating_add(len as usize))
    }

    /// The method as sent.
    pub fn method(&self) -> &'a str {
        self.field(0).unwrap_or_default()
    }

    /// The authority.
    pub fn authority(&self) -> &'a str {
        self.field(1).unwrap_or_default()
    }

    /// The path without the query.
    pub fn path(&self) -> &'a str {
        self.field(2).unwrap_or_default()
    }

    /// The raw query.
    pub fn query(&self) -> Option<&'a str> {
        self.field(3)
    }

    /// The destination service.
    pub fn destination(&self) -> Option<&'a str> {
        self.field(4)
    }

    /// The sending peer's address as text.
    pub fn source_address(&self) -> &'a str {
        self.field(5).unwrap_or_default()
    }

    /// The sending workload's identity, when the mesh knows it.
    pub fn source_identity(&self) -> Option<&'a str> {
        self.field(6)
    }

    /// The values of the `i`th declared header, in arrival order (none if absent).
    pub fn header(&self, i: usize) -> impl Iterator<Item = &'a str> + use<'a> {
        let joined = if i < self.headers {
            self.field(FIXED_FIELDS + i)
        } else {
            None
        };
        joined.into_iter().flat_map(|j| j.split('\n'))
    }

    /// The value of the `i`th declared metadata key.
    pub fn metadata(&self, i: usize) -> Option<&'a str> {
        self.field(FIXED_FIELDS + self.headers + i)
    }

    /// The request line, copied.
    pub fn line(&self) -> RequestLine {
        RequestLine {
            method: Method::parse(self.method()),
            scheme: self.scheme,
            authority: self.authority().to_owned(),
            path: self.path().to_owned(),
        }
    }

    /// The sending peer, copied.
    pub fn source(&self) -> Peer {
        Peer {
            address: self.source_address().to_owned(),
            port: self.source_port,
            identity: self.source_identity().map(str::to_owned),
        }
    }
}

/// Headers the proxy owns (framing, hop-by-hop, `host`): `dpumesh_head::READ_ONLY`,
/// which guests do not link (it pulls in the `http` crate); a test keeps the two equal.
const READ_ONLY: [&str; 8] = [
    "connection",
    "content-length",
    "host",
    "keep-alive",
    "proxy-connection",
    "te",
    "transfer-encoding",
    "upgrade",
];

fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// Whether the proxy takes an edit of header `name` (to `value`, for a set or an
/// append): the rules `request-head.set-header` applies, checked in the guest so that
/// a batched edit is refused when it is made.
pub fn check_header_edit(name: &str, value: Option<&str>) -> Result<(), HeaderError> {
    if name.starts_with(':') {
        return Err(HeaderError::ReadOnly);
    }
    if name.is_empty() || name.len() > u16::MAX as usize || !name.bytes().all(is_tchar) {
        return Err(HeaderError::InvalidName);
    }
    if READ_ONLY.iter().any(|r| r.eq_ignore_ascii_case(name)) {
        return Err(HeaderError::ReadOnly);
    }
    if let Some(value) = value
        && !value
            .bytes()
            .all(|b| (b >= 0x20 && b != 0x7f) || b == b'\t')
    {
        return Err(HeaderError::InvalidValue);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broken_inputs_are_refused_with_the_reason() {
        let why = |bytes: &[u8]| Input::decode(bytes, 0, 0).unwrap_err().to_string();
        assert!(why(&[]).contains("fixed part"));
        let mut fixed = [0u8; 24];
        fixed[0] = 9;
        assert!(why(&fixed).contains("version 9"));
        fixed[0] = 1;
        assert!(why(&fixed).contains("0 fields, 7 expected"));
        fixed[4] = 7;
        assert!(why(&fixed).contains("table is cut short"));
        let mut bytes = fixed.to_vec();
        bytes.extend_from_slice(&[0u8; 56]);
        // Seven empty fields at offset 0: well-formed, if odd.
        assert!(Input::decode(&bytes, 0, 0).is_ok());
        bytes[24 + 4] = 9; // the method: 9 bytes of an empty text
        assert!(
            Input::decode(&bytes, 0, 0)
                .unwrap_err()
                .to_string()
                .contains("field 0 (method, authority or path) is missing")
        );
        bytes[24 + 4] = 0;
        bytes.push(0xff);
        assert!(
            Input::decode(&bytes, 0, 0)
                .unwrap_err()
                .to_string()
                .contains("not UTF-8")
        );
    }

    #[test]
    fn any_bytes_are_read_or_refused_without_panic() {
        // A small LCG: deterministic bytes of every shape, the field table included.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for n in 0..20_000usize {
            let len = n % 200;
            let mut bytes: Vec<u8> = (0..len)
                .map(|_| {
                    x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                    (x >> 33) as u8
                })
                .collect();
            if len > 8 {
                bytes[0] = VERSION;
                bytes[4..8].copy_from_slice(&((n % 12) as u32).to_le_bytes());
            }
            if let Ok(input) = Input::decode(&bytes, n % 3, n % 2) {
                let _ = (input.method(), input.query(), input.source_identity());
                let _ = input.header(0).count() + input.header(5).count();
                let _ = (input.metadata(0), input.line(), input.source());
            }
        }
    }

    #[test]
    fn the_read_only_headers_are_the_proxys() {
        assert_eq!(READ_ONLY, dpumesh_head::READ_ONLY);
    }

    #[test]
    fn edits_are_checked_as_the_proxy_checks_them() {
        let cases: [(&str, Option<&str>); 14] = [
            ("x-a", Some("v")),
            ("X-Upper", Some("v")),
            ("", Some("v")),
            ("bad name", Some("v")),
            (":path", Some("/")),
            ("Content-Length", Some("1")),
            ("host", None),
            ("te", None),
            ("x-a", Some("bad\r\nvalue")),
            ("x-a", Some("tab\tok")),
            ("x-a", Some("nul\0")),
            ("x-a", Some("del\x7f")),
            ("x-a", Some("ünïcode")),
            ("x-é", Some("v")),
        ];
        for (name, value) in cases {
            let mut head = dpumesh_head::RequestHead::new("GET", "/");
            let proxy = match value {
                Some(v) => head.set_header(name, v),
                None => head.remove_header(name),
            }
            .map_err(|e| match e {
                dpumesh_head::HeaderError::InvalidName => HeaderError::InvalidName,
                dpumesh_head::HeaderError::InvalidValue => HeaderError::InvalidValue,
                dpumesh_head::HeaderError::ReadOnly => HeaderError::ReadOnly,
            });
            assert_eq!(
                check_header_edit(name, value),
                proxy,
                "{name:?} = {value:?}"
            );
        }
    }
}

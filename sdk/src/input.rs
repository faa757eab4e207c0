//! The batched call's input (WIT 0.1.1 `handle-request`) and the checks an edit gets
//! before it is batched.
//!
//! The encoding (version 1, little-endian; `str` is a `u32` length and UTF-8 bytes,
//! `opt` a byte 0 for none or 1 followed by a `str`):
//!
//! ```text
//! u8 version | u8 scheme (0 http, 1 https) | u64 wall ns | u64 monotonic ns
//! str method | str authority | str path | opt query | opt destination
//! str source address | u16 source port | opt source identity
//! for each declared header:        u32 count, count × str (every value, in order)
//! for each declared metadata key:  opt value
//! ```
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

/// A batched call's input, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Input {
    /// Method, scheme, authority and path.
    pub line: RequestLine,
    /// The raw query.
    pub query: Option<String>,
    /// The destination service.
    pub destination: Option<String>,
    /// Who sent the request.
    pub source: Peer,
    /// Wall-clock time when the proxy started this request's chain, ns since the epoch.
    pub wall_ns: u64,
    /// Monotonic time at the same moment, ns.
    pub monotonic_ns: u64,
    /// Every value of each declared header, in declaration order.
    pub headers: Vec<Vec<String>>,
    /// Each declared metadata key's value, in declaration order.
    pub metadata: Vec<Option<String>>,
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

struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], InputError> {
        if self.bytes.len() < n {
            return Err(InputError(format!("{what} is cut short")));
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Ok(head)
    }

    fn u8(&mut self, what: &str) -> Result<u8, InputError> {
        Ok(self.take(1, what)?[0])
    }

    fn u16(&mut self, what: &str) -> Result<u16, InputError> {
        let b = self.take(2, what)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }

    fn u32(&mut self, what: &str) -> Result<u32, InputError> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self, what: &str) -> Result<u64, InputError> {
        let mut b = [0u8; 8];
        b.copy_from_slice(self.take(8, what)?);
        Ok(u64::from_le_bytes(b))
    }

    fn str(&mut self, what: &str) -> Result<String, InputError> {
        let len = self.u32(what)? as usize;
        let bytes = self.take(len, what)?;
        std::str::from_utf8(bytes)
            .map(str::to_owned)
            .map_err(|_| InputError(format!("{what} is not UTF-8")))
    }

    fn opt(&mut self, what: &str) -> Result<Option<String>, InputError> {
        match self.u8(what)? {
            0 => Ok(None),
            1 => self.str(what).map(Some),
            tag => Err(InputError(format!("{what} has presence byte {tag}"))),
        }
    }
}

impl Input {
    /// Reads an input carrying `headers` declared headers and `metadata` declared keys.
    pub fn decode(bytes: &[u8], headers: usize, metadata: usize) -> Result<Self, InputError> {
        let mut r = Reader { bytes };
        let version = r.u8("version")?;
        if version != VERSION {
            return Err(InputError(format!(
                "version {version} (this SDK reads {VERSION})"
            )));
        }
        let scheme = match r.u8("scheme")? {
            0 => Scheme::Http,
            1 => Scheme::Https,
            other => return Err(InputError(format!("scheme {other}"))),
        };
        let wall_ns = r.u64("wall time")?;
        let monotonic_ns = r.u64("monotonic time")?;
        let method = Method::parse(&r.str("method")?);
        let authority = r.str("authority")?;
        let path = r.str("path")?;
        let query = r.opt("query")?;
        let destination = r.opt("destination")?;
        let source = Peer {
            address: r.str("source address")?,
            port: r.u16("source port")?,
            identity: r.opt("source identity")?,
        };
        let mut values = Vec::with_capacity(headers);
        for _ in 0..headers {
            let n = r.u32("header count")? as usize;
            // Each value takes at least its 4-byte length: a count beyond what is
            // left is a broken input, not an allocation to make.
            if n > r.bytes.len() / 4 {
                return Err(InputError(format!(
                    "{n} header values in {} bytes",
                    r.bytes.len()
                )));
            }
            let mut all = Vec::with_capacity(n);
            for _ in 0..n {
                all.push(r.str("header value")?);
            }
            values.push(all);
        }
        let mut meta = Vec::with_capacity(metadata);
        for _ in 0..metadata {
            meta.push(r.opt("metadata value")?);
        }
        if !r.bytes.is_empty() {
            return Err(InputError(format!("{} bytes left over", r.bytes.len())));
        }
        Ok(Self {
            line: RequestLine {
                method,
                scheme,
                authority,
                path,
            },
            query,
            destination,
            source,
            wall_ns,
            monotonic_ns,
            headers: values,
            metadata: meta,
        })
    }
}

/// Headers the proxy owns (framing, hop-by-hop, `host`): the proxy's list.
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
        assert!(
            Input::decode(&[], 0, 0)
                .unwrap_err()
                .to_string()
                .contains("version")
        );
        assert!(
            Input::decode(&[9], 0, 0)
                .unwrap_err()
                .to_string()
                .contains("version 9")
        );
        assert!(
            Input::decode(&[1, 0, 1, 2], 0, 0)
                .unwrap_err()
                .to_string()
                .contains("wall time is cut short")
        );
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

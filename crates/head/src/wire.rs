//! The heads on the data path: how a parsed request head (the ingress's one parse of
//! the request: method, path, query, host, headers) and a response head travel between
//! the ingress, the DPU proxies and host pods, in header slots and fabric messages.
//!
//! A compact length-prefixed binary form, versioned, read back with every length and
//! every field checked: a head is written by one process and read by another, and a
//! pod is not trusted to write well-formed bytes.
//!
//! ```text
//! request:  'Q' version | method | scheme | authority | path | query? | source |
//!           identity? | destination? | headers | metadata | trailers
//! response: 'R' version | status u16 | headers | trailers
//! string:   u16 length (LE) + UTF-8        optional: u8 0/1 + string
//! headers:  u16 count + (name string, value u16 length + bytes) per field
//! source:   u8 4|6 + address bytes + u16 port
//! trailers: headers (count 0: none); version 2 on. Version 1 (no trailers) is read.
//! ```
//!
//! Trailers travel with the head because bodies are whole when a head crosses: the
//! ingress reads a request's body (and its trailers) before it sends the head, and a
//! pod answers with its body (and trailers) at once.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use http::header::{HeaderMap, HeaderName, HeaderValue};

use crate::{Peer, RequestHead};

/// The layout version written (and the newest read).
pub const WIRE_VERSION: u8 = 2;

/// The oldest layout version read: version 1 heads have no trailers.
const OLDEST_VERSION: u8 = 1;

const REQUEST: u8 = b'Q';
const RESPONSE: u8 = b'R';

/// Why bytes are not a head.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// The bytes end inside a field.
    #[error("head is truncated in {0}")]
    Truncated(&'static str),
    /// Not a request (or response) head.
    #[error("not a {expected} head (first byte {found:#04x})")]
    Kind {
        /// "request" or "response".
        expected: &'static str,
        /// The byte found.
        found: u8,
    },
    /// Written by another layout version.
    #[error(
        "head version {0} is not supported (this build reads versions {OLDEST_VERSION} to {WIRE_VERSION})"
    )]
    Version(u8),
    /// A text field that is not UTF-8.
    #[error("{0} is not UTF-8")]
    Utf8(&'static str),
    /// A header name or value HTTP does not allow.
    #[error("header {0:?} is not a valid HTTP field")]
    Header(String),
    /// A field too long for its length prefix.
    #[error("{0} is longer than 65535 bytes")]
    TooLong(&'static str),
    /// A status outside 100..=999.
    #[error("status {0} is not an HTTP status")]
    Status(u16),
    /// Bytes after the last field.
    #[error("{0} bytes after the end of the head")]
    Trailing(usize),
    /// An unknown tag (address family, option flag).
    #[error("{what} has unknown tag {tag}")]
    Tag {
        /// The field.
        what: &'static str,
        /// The tag found.
        tag: u8,
    },
}

/// A response head: status and header fields.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ResponseHead {
    /// The status code.
    pub status: u16,
    /// The header fields.
    pub headers: HeaderMap,
    /// The trailer fields, sent after the body (gRPC's status); empty: none.
    pub trailers: HeaderMap,
}

struct Writer(Vec<u8>);

impl Writer {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }

    fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }

    fn bytes(&mut self, what: &'static str, b: &[u8]) -> Result<(), WireError> {
        let len = u16::try_from(b.len()).map_err(|_| WireError::TooLong(what))?;
        self.u16(len);
        self.0.extend_from_slice(b);
        Ok(())
    }

    fn opt(&mut self, what: &'static str, s: Option<&str>) -> Result<(), WireError> {
        match s {
            None => {
                self.u8(0);
                Ok(())
            }
            Some(s) => {
                self.u8(1);
                self.bytes(what, s.as_bytes())
            }
        }
    }

    fn headers(&mut self, headers: &HeaderMap) -> Result<(), WireError> {
        let count = u16::try_from(headers.len()).map_err(|_| WireError::TooLong("headers"))?;
        self.u16(count);
        for (name, value) in headers {
            self.bytes("header name", name.as_str().as_bytes())?;
            self.bytes("header value", value.as_bytes())?;
        }
        Ok(())
    }
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, what: &'static str, n: usize) -> Result<&'a [u8], WireError> {
        let end = self.at.checked_add(n).ok_or(WireError::Truncated(what))?;
        let s = self.b.get(self.at..end).ok_or(WireError::Truncated(what))?;
        self.at = end;
        Ok(s)
    }

    fn u8(&mut self, what: &'static str) -> Result<u8, WireError> {
        Ok(self.take(what, 1)?[0])
    }

    fn u16(&mut self, what: &'static str) -> Result<u16, WireError> {
        let b = self.take(what, 2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }

    fn bytes(&mut self, what: &'static str) -> Result<&'a [u8], WireError> {
        let len = self.u16(what)? as usize;
        self.take(what, len)
    }

    fn str(&mut self, what: &'static str) -> Result<&'a str, WireError> {
        std::str::from_utf8(self.bytes(what)?).map_err(|_| WireError::Utf8(what))
    }

    fn opt(&mut self, what: &'static str) -> Result<Option<&'a str>, WireError> {
        match self.u8(what)? {
            0 => Ok(None),
            1 => self.str(what).map(Some),
            tag => Err(WireError::Tag { what, tag }),
        }
    }

    fn headers(&mut self) -> Result<HeaderMap, WireError> {
        let count = self.u16("headers")? as usize;
        // Each field takes at least four bytes: a count larger than what is left is a
        // lie, and must not size an allocation.
        let mut map = HeaderMap::with_capacity(count.min(self.b.len() / 4));
        for _ in 0..count {
            let name = self.bytes("header name")?;
            let value = self.bytes("header value")?;
            let lossy = || String::from_utf8_lossy(name).into_owned();
            let name = HeaderName::from_bytes(name).map_err(|_| WireError::Header(lossy()))?;
            let value =
                HeaderValue::from_bytes(value).map_err(|_| WireError::Header(name.to_string()))?;
            map.append(name, value);
        }
        Ok(map)
    }

    /// Reads the kind and version; the version.
    fn header(&mut self, expected: &'static str, kind: u8) -> Result<u8, WireError> {
        let found = self.u8("kind")?;
        if found != kind {
            return Err(WireError::Kind { expected, found });
        }
        match self.u8("version")? {
            v @ OLDEST_VERSION..=WIRE_VERSION => Ok(v),
            v => Err(WireError::Version(v)),
        }
    }

    /// The trailers of a head of `version` (none before version 2).
    fn trailers(&mut self, version: u8) -> Result<HeaderMap, WireError> {
        if version < 2 {
            return Ok(HeaderMap::new());
        }
        self.headers()
    }

    fn end(&self) -> Result<(), WireError> {
        match self.b.len() - self.at {
            0 => Ok(()),
            n => Err(WireError::Trailing(n)),
        }
    }
}

/// Encodes a request head (everything filters see, metadata included): for the DPU
/// proxies, whose filters read the metadata.
pub fn encode_request(head: &RequestHead) -> Result<Vec<u8>, WireError> {
    encode(head, true)
}

/// Encodes the head a pod receives: everything but the metadata. Metadata is what the
/// chain's filters pass one another (a verified token's payload and claims, trace
/// ids); a service sees headers, as behind any proxy, and the host library has no
/// place for metadata. Carried, it was most of the bytes a pod decoded per request
/// (a dozen entries after the JWT filter), only to drop them.
pub fn encode_request_for_pod(head: &RequestHead) -> Result<Vec<u8>, WireError> {
    encode(head, false)
}

fn encode(head: &RequestHead, with_metadata: bool) -> Result<Vec<u8>, WireError> {
    #[cfg(feature = "codec-counts")]
    counts::REQUEST_ENCODES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut w = Writer(Vec::with_capacity(256));
    w.u8(REQUEST);
    w.u8(WIRE_VERSION);
    w.bytes("method", head.method.as_bytes())?;
    w.bytes("scheme", head.scheme.as_bytes())?;
    w.bytes("authority", head.authority.as_bytes())?;
    w.bytes("path", head.path.as_bytes())?;
    w.opt("query", head.query.as_deref())?;
    match head.source.addr.ip() {
        IpAddr::V4(ip) => {
            w.u8(4);
            w.0.extend_from_slice(&ip.octets());
        }
        IpAddr::V6(ip) => {
            w.u8(6);
            w.0.extend_from_slice(&ip.octets());
        }
    }
    w.u16(head.source.addr.port());
    w.opt("identity", head.source.identity.as_deref())?;
    w.opt("destination", head.destination.as_deref())?;
    w.headers(head.headers())?;
    if with_metadata {
        let metadata = head.metadata_entries();
        let count = u16::try_from(metadata.len()).map_err(|_| WireError::TooLong("metadata"))?;
        w.u16(count);
        for (k, v) in metadata {
            w.bytes("metadata key", k.as_bytes())?;
            w.bytes("metadata value", v.as_bytes())?;
        }
    } else {
        w.u16(0);
    }
    w.headers(&head.trailers)?;
    Ok(w.0)
}

/// Decodes a request head.
pub fn decode_request(bytes: &[u8]) -> Result<RequestHead, WireError> {
    #[cfg(feature = "codec-counts")]
    counts::REQUEST_DECODES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut r = Reader { b: bytes, at: 0 };
    let version = r.header("request", REQUEST)?;
    let method = r.str("method")?;
    // The method is a token (RFC 9110): anything else could split a request line.
    if method.is_empty() || !method.bytes().all(is_tchar) {
        return Err(WireError::Header(format!(":method {method}")));
    }
    let mut head = RequestHead {
        method: method.to_owned(),
        scheme: r.str("scheme")?.to_owned(),
        authority: r.str("authority")?.to_owned(),
        path: r.str("path")?.to_owned(),
        query: r.opt("query")?.map(str::to_owned),
        ..RequestHead::default()
    };
    let ip = match r.u8("source")? {
        4 => {
            let o: [u8; 4] = r.take("source", 4)?.try_into().expect("4 bytes");
            IpAddr::V4(Ipv4Addr::from(o))
        }
        6 => {
            let o: [u8; 16] = r.take("source", 16)?.try_into().expect("16 bytes");
            IpAddr::V6(Ipv6Addr::from(o))
        }
        tag => {
            return Err(WireError::Tag {
                what: "source",
                tag,
            });
        }
    };
    let port = r.u16("source")?;
    head.source = Peer {
        addr: SocketAddr::new(ip, port),
        identity: r.opt("identity")?.map(str::to_owned),
    };
    head.destination = r.opt("destination")?.map(str::to_owned);
    head.set_headers(r.headers()?);
    let count = r.u16("metadata")?;
    for _ in 0..count {
        let k = r.str("metadata key")?;
        let v = r.str("metadata value")?;
        head.set_metadata(k, v);
    }
    head.trailers = r.trailers(version)?;
    r.end()?;
    Ok(head)
}

/// Encodes a response head.
pub fn encode_response(head: &ResponseHead) -> Result<Vec<u8>, WireError> {
    #[cfg(feature = "codec-counts")]
    counts::RESPONSE_ENCODES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    if !(100..=999).contains(&head.status) {
        return Err(WireError::Status(head.status));
    }
    let mut w = Writer(Vec::with_capacity(64));
    w.u8(RESPONSE);
    w.u8(WIRE_VERSION);
    w.u16(head.status);
    w.headers(&head.headers)?;
    w.headers(&head.trailers)?;
    Ok(w.0)
}

/// Decodes a response head.
pub fn decode_response(bytes: &[u8]) -> Result<ResponseHead, WireError> {
    #[cfg(feature = "codec-counts")]
    counts::RESPONSE_DECODES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut r = Reader { b: bytes, at: 0 };
    let version = r.header("response", RESPONSE)?;
    let status = r.u16("status")?;
    if !(100..=999).contains(&status) {
        return Err(WireError::Status(status));
    }
    let headers = r.headers()?;
    let trailers = r.trailers(version)?;
    r.end()?;
    Ok(ResponseHead {
        status,
        headers,
        trailers,
    })
}

fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// How often this process encoded and decoded heads (feature `codec-counts`, for tests
/// that hold each hop to one encode and one decode).
#[cfg(feature = "codec-counts")]
pub mod counts {
    use std::sync::atomic::{AtomicU64, Ordering};

    pub(super) static REQUEST_ENCODES: AtomicU64 = AtomicU64::new(0);
    pub(super) static REQUEST_DECODES: AtomicU64 = AtomicU64::new(0);
    pub(super) static RESPONSE_ENCODES: AtomicU64 = AtomicU64::new(0);
    pub(super) static RESPONSE_DECODES: AtomicU64 = AtomicU64::new(0);

    /// The counts so far.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
    pub struct Counts {
        pub request_encodes: u64,
        pub request_decodes: u64,
        pub response_encodes: u64,
        pub response_decodes: u64,
    }

    impl std::ops::Sub for Counts {
        type Output = Counts;
        fn sub(self, before: Counts) -> Counts {
            Counts {
                request_encodes: self.request_encodes - before.request_encodes,
                request_decodes: self.request_decodes - before.request_decodes,
                response_encodes: self.response_encodes - before.response_encodes,
                response_decodes: self.response_decodes - before.response_decodes,
            }
        }
    }

    pub fn now() -> Counts {
        Counts {
            request_encodes: REQUEST_ENCODES.load(Ordering::Relaxed),
            request_decodes: REQUEST_DECODES.load(Ordering::Relaxed),
            response_encodes: RESPONSE_ENCODES.load(Ordering::Relaxed),
            response_decodes: RESPONSE_DECODES.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn sample() -> RequestHead {
        let mut head = RequestHead::new("POST", "/reserve?hotel=7&night=2");
        head.authority = "frontend.hotel:8080".into();
        head.source = Peer {
            addr: "[2001:db8::1]:4711".parse().unwrap(),
            identity: Some("spiffe://mesh/ingress".into()),
        };
        head.destination = Some("frontend".into());
        head.append_received("authorization", "Bearer abc.def.ghi")
            .unwrap();
        head.append_received("x-multi", "one").unwrap();
        head.append_received("x-multi", "two").unwrap();
        head.set_metadata("jwt.sub", "alice");
        head
    }

    #[test]
    fn a_request_head_comes_back_field_for_field() {
        let head = sample();
        let back = decode_request(&encode_request(&head).unwrap()).unwrap();
        assert_eq!(back.method, "POST");
        assert_eq!(back.path, "/reserve");
        assert_eq!(back.query.as_deref(), Some("hotel=7&night=2"));
        assert_eq!(back.authority, "frontend.hotel:8080");
        assert_eq!(back.source, head.source);
        assert_eq!(back.destination.as_deref(), Some("frontend"));
        assert_eq!(back.headers(), head.headers());
        assert_eq!(back.header_all("x-multi"), ["one", "two"]);
        assert_eq!(back.metadata("jwt.sub"), Some("alice"));
    }

    #[test]
    fn request_trailers_travel_after_the_metadata_to_proxy_and_pod() {
        let mut head = sample();
        head.trailers
            .append("x-checksum", HeaderValue::from_static("crc32=1234"));
        for bytes in [encode_request(&head), encode_request_for_pod(&head)] {
            let back = decode_request(&bytes.unwrap()).unwrap();
            assert_eq!(back.trailers, head.trailers);
            assert_eq!(back.headers(), head.headers());
        }
    }

    #[test]
    fn version_1_heads_are_read_without_trailers() {
        // As a version-1 writer laid them out: no trailer section.
        let mut w = Writer(Vec::new());
        w.u8(RESPONSE);
        w.u8(1);
        w.u16(204);
        w.u16(1);
        w.bytes("n", b"x-a").unwrap();
        w.bytes("v", b"b").unwrap();
        let head = decode_response(&w.0).unwrap();
        assert_eq!(
            (head.status, head.headers["x-a"].as_bytes()),
            (204, &b"b"[..])
        );
        assert!(head.trailers.is_empty());
        let mut v2 = w.0.clone();
        v2[1] = 2;
        assert_eq!(
            decode_response(&v2).unwrap_err(),
            WireError::Truncated("headers"),
            "version 2 has a trailer section"
        );
        let mut request = encode_request(&sample()).unwrap();
        request[1] = 1;
        request.truncate(request.len() - 2);
        assert_eq!(decode_request(&request).unwrap().path, "/reserve");
    }

    #[test]
    fn a_pod_gets_the_head_without_the_filters_metadata() {
        let mut head = sample();
        head.set_metadata("jwt.payload", r#"{"sub":"alice","role":"user"}"#);
        let back = decode_request(&encode_request_for_pod(&head).unwrap()).unwrap();
        assert_eq!(back.metadata_entries().len(), 0);
        assert_eq!(back.metadata("jwt.sub"), None);
        // Everything else as the full head carries it.
        let full = decode_request(&encode_request(&head).unwrap()).unwrap();
        assert_eq!(
            (&back.method, &back.path, &back.query, &back.authority),
            (&full.method, &full.path, &full.query, &full.authority)
        );
        assert_eq!(
            (&back.source, &back.destination),
            (&full.source, &full.destination)
        );
        assert_eq!(back.headers(), full.headers());
        assert_eq!(full.metadata_entries().len(), 2);
    }

    #[test]
    fn a_response_head_comes_back() {
        let mut headers = HeaderMap::new();
        headers.append("content-type", HeaderValue::from_static("text/plain"));
        headers.append("set-cookie", HeaderValue::from_static("a=1"));
        headers.append("set-cookie", HeaderValue::from_static("b=2"));
        let mut trailers = HeaderMap::new();
        trailers.append("grpc-status", HeaderValue::from_static("0"));
        trailers.append("grpc-message", HeaderValue::from_static("fine"));
        let head = ResponseHead {
            status: 201,
            headers,
            trailers,
        };
        assert_eq!(
            decode_response(&encode_response(&head).unwrap()).unwrap(),
            head
        );
        assert_eq!(
            encode_response(&ResponseHead {
                status: 42,
                ..Default::default()
            }),
            Err(WireError::Status(42))
        );
    }

    #[test]
    fn damaged_heads_are_refused_with_the_reason() {
        let bytes = encode_request(&sample()).unwrap();
        for cut in 0..bytes.len() {
            assert!(
                matches!(decode_request(&bytes[..cut]), Err(WireError::Truncated(_))),
                "cut at {cut}"
            );
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert_eq!(decode_request(&longer).unwrap_err(), WireError::Trailing(1));
        let mut version = bytes.clone();
        version[1] = 9;
        assert_eq!(decode_request(&version).unwrap_err(), WireError::Version(9));
        assert!(matches!(
            decode_response(&bytes),
            Err(WireError::Kind { .. })
        ));
        // A method with a space would split a request line when written out again.
        let mut head = sample();
        head.method = "GET /x HTTP/1.1\r\nX".into();
        let bytes = encode_request(&head).unwrap();
        assert!(matches!(decode_request(&bytes), Err(WireError::Header(_))));
    }

    #[test]
    fn a_header_value_with_a_line_break_is_refused() {
        let mut w = Writer(Vec::new());
        w.u8(RESPONSE);
        w.u8(WIRE_VERSION);
        w.u16(200);
        w.u16(1);
        w.bytes("n", b"x-evil").unwrap();
        w.bytes("v", b"a\r\nset-cookie: b").unwrap();
        assert_eq!(
            decode_response(&w.0).unwrap_err(),
            WireError::Header("x-evil".into())
        );
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode_request(&bytes);
            let _ = decode_response(&bytes);
        }

        #[test]
        fn a_huge_header_count_does_not_allocate_for_it(n in 1000u16..u16::MAX) {
            let mut b = vec![RESPONSE, WIRE_VERSION, 200, 0];
            b.extend_from_slice(&n.to_le_bytes());
            prop_assert!(matches!(decode_response(&b), Err(WireError::Truncated(_))));
        }
    }
}

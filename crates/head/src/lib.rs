//! The request head.
//!
//! The ingress parses a request once; what the DPU proxy and its filters then work on
//! is this head: the request line, the header fields, who sent it, where the router is
//! sending it, and per-request metadata that filters pass along the chain. Bodies are
//! never part of it. The same type backs the runtime's `request-head` resource and the
//! SDK's mock proxy, so the editing rules a filter meets in its unit tests are the ones
//! it meets in the proxy.

#![forbid(unsafe_code)]

mod from_http;
pub mod grpc;
mod metadata;
pub mod path;
pub mod trailers;
pub mod whole_body;
pub mod wire;

pub use from_http::FromRequestError;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use http::header::{HeaderMap, HeaderName, HeaderValue};

use metadata::Metadata;

/// Why a header edit was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    /// Not a valid HTTP field name.
    #[error("invalid header name")]
    InvalidName,
    /// The value holds bytes not allowed in a field value (CR, LF, NUL, other controls).
    #[error("invalid header value")]
    InvalidValue,
    /// The proxy owns this header (framing, hop-by-hop, pseudo-headers, `host`).
    #[error("header is owned by the proxy")]
    ReadOnly,
}

/// Headers the proxy owns: they frame the message or describe one hop, and letting a
/// filter edit them would open the door to request smuggling. The authority is part of
/// the request line, so `host` is read-only too.
pub const READ_ONLY: [&str; 8] = [
    "connection",
    "content-length",
    "host",
    "keep-alive",
    "proxy-connection",
    "te",
    "transfer-encoding",
    "upgrade",
];

/// Headers that describe one hop or the message's framing: an ingress drops them from
/// the head it forwards (the body's exact length travels beside it), and a response
/// writer drops them from what a service sent.
pub const HOP_BY_HOP: [&str; 7] = [
    "connection",
    "content-length",
    "keep-alive",
    "proxy-connection",
    "te",
    "transfer-encoding",
    "upgrade",
];

/// Whether `name` (lowercase) is one of [`HOP_BY_HOP`].
pub fn is_hop_by_hop(name: &str) -> bool {
    HOP_BY_HOP.contains(&name)
}

/// The prefix of the mesh's own header names (`x-dpumesh-generation`,
/// `x-dpumesh-circuit`, …): a client's header with it is removed at the ingress
/// ([`RequestHead::remove_reserved`]), so nothing in the mesh reads a client's word
/// as its own.
pub const RESERVED_PREFIX: &str = "x-dpumesh-";

/// The response header a service's answer carries when it failed only because
/// services it called failed (answered 5xx, or could not be reached): the host library
/// sets it on such answers.
pub const DEPENDENCY_FAILED_HEADER: &str = "x-dpumesh-dependency-failed";

/// The metadata the DPU proxy sets for the response phase of a request whose answer
/// carried [`DEPENDENCY_FAILED_HEADER`]: the circuit breaker does not count such an
/// answer against the service (its dependency failed, not it).
pub const DEPENDENCY_FAILED_METADATA: &str = "dpumesh.dependency-failed";

/// The peer that sent a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    /// Address and source port of the peer's connection.
    pub addr: SocketAddr,
    /// Workload identity (e.g. a SPIFFE id) when the mesh knows it.
    pub identity: Option<String>,
}

impl Default for Peer {
    fn default() -> Self {
        Self {
            addr: SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0),
            identity: None,
        }
    }
}

/// The head of one request, as filters see it.
#[derive(Debug, Clone, Default)]
pub struct RequestHead {
    /// Method as sent, e.g. `GET`.
    pub method: String,
    /// `http` or `https`.
    pub scheme: String,
    /// The authority (`:authority` or `Host`).
    pub authority: String,
    /// The path without the query.
    pub path: String,
    /// The query without the leading `?`.
    pub query: Option<String>,
    headers: HeaderMap,
    /// Who sent the request.
    pub source: Peer,
    /// The destination service chosen by the router.
    pub destination: Option<String>,
    metadata: Metadata,
    /// Trailer fields the client sent after the body (rare for requests). They
    /// travel to the service beside the head; filters never see them (see
    /// [`trailers`]).
    pub trailers: HeaderMap,
}

impl RequestHead {
    /// A head with the given method and request target (`/path?query`).
    pub fn new(method: &str, target: &str) -> Self {
        let (path, query) = match target.split_once('?') {
            Some((path, query)) => (path, Some(query.to_owned())),
            None => (target, None),
        };
        Self {
            method: method.to_owned(),
            scheme: "http".to_owned(),
            path: path.to_owned(),
            query,
            ..Self::default()
        }
    }

    /// The header fields.
    pub fn headers(&self) -> &HeaderMap {
        &self.headers
    }

    /// Replaces all header fields; used by the ingress, which has already validated them.
    pub fn set_headers(&mut self, headers: HeaderMap) {
        self.headers = headers;
    }

    /// Takes the header fields out (leaving none), e.g. to forward them upstream.
    pub fn take_headers(&mut self) -> HeaderMap {
        std::mem::take(&mut self.headers)
    }

    /// The first value of `name` (case-insensitive). Values that are not UTF-8 are
    /// returned with replacement characters.
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers.get(name).map(value_string)
    }

    /// All values of `name`, in arrival order.
    pub fn header_all(&self, name: &str) -> Vec<String> {
        self.headers
            .get_all(name)
            .iter()
            .map(value_string)
            .collect()
    }

    /// The distinct header names present, lower-cased.
    pub fn header_names(&self) -> Vec<String> {
        self.headers.keys().map(|k| k.as_str().to_owned()).collect()
    }

    /// Replaces every value of `name` with `value`.
    pub fn set_header(&mut self, name: &str, value: &str) -> Result<(), HeaderError> {
        // A field present once (a filter rewriting `traceparent`) takes the new value
        // in place: no name is parsed into a new `HeaderName`, which for a name outside
        // the standard set allocates. A name found in the map is a valid one, so only
        // the read-only check remains before it.
        if !name.starts_with(':')
            && !READ_ONLY.iter().any(|r| r.eq_ignore_ascii_case(name))
            && self.headers.get_all(name).iter().nth(1).is_none()
            && let Some(slot) = self.headers.get_mut(name)
        {
            *slot = HeaderValue::from_str(value).map_err(|_| HeaderError::InvalidValue)?;
            return Ok(());
        }
        let (name, value) = checked(name, Some(value))?;
        self.headers.insert(name, value.unwrap_or_else(empty));
        Ok(())
    }

    /// Adds `value` as one more value of `name`.
    pub fn append_header(&mut self, name: &str, value: &str) -> Result<(), HeaderError> {
        let (name, value) = checked(name, Some(value))?;
        self.headers.append(name, value.unwrap_or_else(empty));
        Ok(())
    }

    /// Appends a header as received from the client, proxy-owned names included. For
    /// the ingress and test hosts building a head; filters go through
    /// [`RequestHead::append_header`].
    pub fn append_received(&mut self, name: &str, value: &str) -> Result<(), HeaderError> {
        let name = HeaderName::from_bytes(name.as_bytes()).map_err(|_| HeaderError::InvalidName)?;
        let value = HeaderValue::from_str(value).map_err(|_| HeaderError::InvalidValue)?;
        self.headers.append(name, value);
        Ok(())
    }

    /// Removes every value of `name`; absent is fine.
    pub fn remove_header(&mut self, name: &str) -> Result<(), HeaderError> {
        let (name, _) = checked(name, None)?;
        self.headers.remove(name);
        Ok(())
    }

    /// Metadata set earlier in the chain.
    pub fn metadata(&self, key: &str) -> Option<&str> {
        self.metadata.get(key)
    }

    /// Sets metadata for the rest of the chain and the response phase.
    pub fn set_metadata(&mut self, key: &str, value: &str) {
        self.metadata.set(key, value);
    }

    /// Forgets every metadata entry: what a head from a less trusted side said for the
    /// chain (a pod's forged `jwt.payload`) is not kept; only filters set metadata.
    pub fn clear_metadata(&mut self) {
        self.metadata = Metadata::default();
    }

    /// All metadata, in the order keys were first set.
    pub fn metadata_entries(&self) -> impl ExactSizeIterator<Item = (&str, &str)> + '_ {
        self.metadata.iter()
    }
}

fn value_string(value: &HeaderValue) -> String {
    match value.to_str() {
        Ok(s) => s.to_owned(),
        Err(_) => String::from_utf8_lossy(value.as_bytes()).into_owned(),
    }
}

fn empty() -> HeaderValue {
    HeaderValue::from_static("")
}

fn checked(
    name: &str,
    value: Option<&str>,
) -> Result<(HeaderName, Option<HeaderValue>), HeaderError> {
    if name.starts_with(':') {
        return Err(HeaderError::ReadOnly);
    }
    let name = HeaderName::from_bytes(name.as_bytes()).map_err(|_| HeaderError::InvalidName)?;
    if READ_ONLY.contains(&name.as_str()) {
        return Err(HeaderError::ReadOnly);
    }
    let value = value
        .map(|v| HeaderValue::from_str(v).map_err(|_| HeaderError::InvalidValue))
        .transpose()?;
    Ok((name, value))
}

#[cfg(test)]
mod tests {
    use test_case::test_case;

    use super::*;

    fn head() -> RequestHead {
        let mut head = RequestHead::new("GET", "/api/users?id=7&x");
        head.append_header("Accept", "a").unwrap();
        head.append_header("accept", "b").unwrap();
        head.append_header("X-Tenant", "acme").unwrap();
        head
    }

    #[test]
    fn target_splits_into_path_and_query() {
        let head = head();
        assert_eq!(head.path, "/api/users");
        assert_eq!(head.query.as_deref(), Some("id=7&x"));
        assert_eq!(RequestHead::new("GET", "/").query, None);
    }

    #[test]
    fn lookups_are_case_insensitive_and_ordered() {
        let head = head();
        assert_eq!(head.header("ACCEPT").as_deref(), Some("a"));
        assert_eq!(head.header_all("Accept"), vec!["a", "b"]);
        assert_eq!(head.header("missing"), None);
        assert_eq!(head.header_names(), vec!["accept", "x-tenant"]);
    }

    #[test]
    fn set_replaces_append_adds_remove_clears() {
        let mut head = head();
        head.set_header("accept", "c").unwrap();
        assert_eq!(head.header_all("accept"), vec!["c"]);
        head.append_header("accept", "d").unwrap();
        assert_eq!(head.header_all("accept"), vec!["c", "d"]);
        head.remove_header("Accept").unwrap();
        assert!(head.header_all("accept").is_empty());
        head.remove_header("never-there").unwrap();
    }

    #[test]
    fn a_field_present_once_is_replaced_where_it_is() {
        let mut head = head();
        head.set_header("X-TENANT", "globex").unwrap();
        assert_eq!(head.header_all("x-tenant"), vec!["globex"]);
        // Its place among the fields is kept.
        assert_eq!(head.header_names(), vec!["accept", "x-tenant"]);
        // A value refused on the way in leaves the field as it was.
        assert_eq!(
            head.set_header("x-tenant", "a\r\nb"),
            Err(HeaderError::InvalidValue)
        );
        assert_eq!(head.header("x-tenant").as_deref(), Some("globex"));
    }

    #[test_case(":path", HeaderError::ReadOnly)]
    #[test_case("Content-Length", HeaderError::ReadOnly)]
    #[test_case("transfer-encoding", HeaderError::ReadOnly)]
    #[test_case("host", HeaderError::ReadOnly)]
    #[test_case("bad name", HeaderError::InvalidName)]
    #[test_case("", HeaderError::InvalidName)]
    #[test_case("x\r\ny", HeaderError::InvalidName)]
    fn protected_and_invalid_names_are_refused(name: &str, err: HeaderError) {
        let mut head = head();
        assert_eq!(head.set_header(name, "v"), Err(err));
        assert_eq!(head.append_header(name, "v"), Err(err));
        assert_eq!(head.remove_header(name), Err(err));
    }

    #[test_case("a\r\nx-injected: 1")]
    #[test_case("nul\0")]
    #[test_case("\n")]
    fn values_that_could_split_headers_are_refused(value: &str) {
        let mut head = head();
        assert_eq!(
            head.set_header("x-ok", value),
            Err(HeaderError::InvalidValue)
        );
        assert_eq!(head.header("x-ok"), None);
    }

    #[test]
    fn non_utf8_values_are_returned_lossily() {
        let mut map = HeaderMap::new();
        map.insert("x-bin", HeaderValue::from_bytes(b"caf\xe9").unwrap());
        let mut head = RequestHead::new("GET", "/");
        head.set_headers(map);
        assert_eq!(head.header("x-bin").as_deref(), Some("caf\u{fffd}"));
    }

    proptest::proptest! {
        /// Whatever a filter passes, an accepted edit never leaves a value that could
        /// split a header line, and a refused one changes nothing.
        #[test]
        fn edits_never_corrupt_the_head(name in ".{0,12}", value in ".{0,24}") {
            let mut head = head();
            let before = head.headers().clone();
            match head.set_header(&name, &value) {
                Ok(()) => {
                    proptest::prop_assert_eq!(head.header(&name), Some(value.clone()));
                }
                Err(_) => proptest::prop_assert_eq!(head.headers(), &before),
            }
            for (_, v) in head.headers() {
                proptest::prop_assert!(!v.as_bytes().iter().any(|b| matches!(b, b'\r' | b'\n' | 0)));
            }
        }
    }

    #[test]
    fn metadata_overwrites_in_place() {
        let mut head = head();
        head.set_metadata("jwt.sub", "alice");
        head.set_metadata("other", "1");
        head.set_metadata("jwt.sub", "bob");
        assert_eq!(head.metadata("jwt.sub"), Some("bob"));
        assert_eq!(head.metadata("nope"), None);
        assert_eq!(head.metadata_entries().len(), 2);
        head.set_metadata("other", "2");
        head.set_metadata("third", "3");
        assert_eq!(head.metadata("other"), Some("2"));
        assert_eq!(
            head.metadata_entries().map(|(k, _)| k).collect::<Vec<_>>(),
            ["jwt.sub", "other", "third"]
        );
    }
}

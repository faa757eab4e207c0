//! The request a filter sees: the line by value or fetched field by field on first
//! use, everything else pulled lazily.

use std::cell::OnceCell;
use std::fmt;

pub use dpumesh_claims::Claim;

/// A request method.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
#[allow(missing_docs)]
pub enum Method {
    #[default]
    Get,
    Head,
    Post,
    Put,
    Delete,
    Connect,
    Options,
    Trace,
    Patch,
    /// Any other method, as sent.
    Other(String),
}

impl Method {
    /// The method from its name as sent (case-sensitive, as HTTP is).
    pub fn parse(name: &str) -> Self {
        match name {
            "GET" => Self::Get,
            "HEAD" => Self::Head,
            "POST" => Self::Post,
            "PUT" => Self::Put,
            "DELETE" => Self::Delete,
            "CONNECT" => Self::Connect,
            "OPTIONS" => Self::Options,
            "TRACE" => Self::Trace,
            "PATCH" => Self::Patch,
            other => Self::Other(other.to_owned()),
        }
    }

    /// The method's name, e.g. `GET`.
    pub fn as_str(&self) -> &str {
        match self {
            Self::Get => "GET",
            Self::Head => "HEAD",
            Self::Post => "POST",
            Self::Put => "PUT",
            Self::Delete => "DELETE",
            Self::Connect => "CONNECT",
            Self::Options => "OPTIONS",
            Self::Trace => "TRACE",
            Self::Patch => "PATCH",
            Self::Other(name) => name,
        }
    }
}

/// The scheme the request arrived on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Scheme {
    /// Plain HTTP.
    #[default]
    Http,
    /// HTTP over TLS.
    Https,
}

impl Scheme {
    /// `http` or `https`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Http => "http",
            Self::Https => "https",
        }
    }
}

/// The four fields of the request line: handed in with `on-request`, fetched field by
/// field on first use otherwise.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestLine {
    /// The method.
    pub method: Method,
    /// The scheme.
    pub scheme: Scheme,
    /// The authority, e.g. `api.example.com`.
    pub authority: String,
    /// The path without the query.
    pub path: String,
}

/// The peer that sent a request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Peer {
    /// IP address as text.
    pub address: String,
    /// Source port.
    pub port: u16,
    /// Workload identity (e.g. a SPIFFE id) when the mesh knows it.
    pub identity: Option<String>,
}

/// Why a header edit was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderError {
    /// Not a valid HTTP field name.
    InvalidName,
    /// The value holds bytes not allowed in a field value.
    InvalidValue,
    /// The proxy owns this header (framing, hop-by-hop, pseudo-headers, `host`).
    ReadOnly,
}

impl fmt::Display for HeaderError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::InvalidName => "invalid header name",
            Self::InvalidValue => "invalid header value",
            Self::ReadOnly => "header is owned by the proxy",
        })
    }
}

impl std::error::Error for HeaderError {}

/// Access to a request head owned by the host. Implemented by the Wasm glue (each call
/// crosses into the proxy) and by the [`mock`](crate::mock) host; filters use
/// [`Request`] instead.
pub trait HeadAccess {
    /// The request line (method, scheme, authority, path).
    fn line(&self) -> RequestLine;
    /// The method alone. Each field has its own call so that a filter reading only the
    /// path does not pay for copying the authority; by default taken from
    /// [`HeadAccess::line`].
    fn method(&self) -> Method {
        self.line().method
    }
    /// The scheme alone (see [`HeadAccess::method`]).
    fn scheme(&self) -> Scheme {
        self.line().scheme
    }
    /// The authority alone (see [`HeadAccess::method`]).
    fn authority(&self) -> String {
        self.line().authority
    }
    /// The path alone (see [`HeadAccess::method`]).
    fn path(&self) -> String {
        self.line().path
    }
    /// The raw query string.
    fn query(&self) -> Option<String>;
    /// First value of a header.
    fn header(&self, name: &str) -> Option<String>;
    /// All values of a header.
    fn header_all(&self, name: &str) -> Vec<String>;
    /// First values of several headers in one call.
    fn headers(&self, names: &[&str]) -> Vec<Option<String>>;
    /// Distinct header names, lower-cased.
    fn header_names(&self) -> Vec<String>;
    /// The sending peer.
    fn source(&self) -> Peer;
    /// The destination service.
    fn destination(&self) -> Option<String>;
    /// Replaces a header.
    fn set_header(&self, name: &str, value: &str) -> Result<(), HeaderError>;
    /// Adds a header value.
    fn append_header(&self, name: &str, value: &str) -> Result<(), HeaderError>;
    /// Removes a header.
    fn remove_header(&self, name: &str) -> Result<(), HeaderError>;
    /// Reads per-request metadata.
    fn metadata(&self, key: &str) -> Option<String>;
    /// Writes per-request metadata.
    fn set_metadata(&self, key: &str, value: &str);
    /// Wall-clock and monotonic ns when the proxy started this request's chain, when
    /// the call brought them.
    fn times(&self) -> Option<(u64, u64)> {
        None
    }
    /// The verified claims at `names` (see [`Request::claims`]). By default parsed from
    /// the `jwt.payload` metadata this head reads.
    fn claims(&self, names: &[&str]) -> Option<Vec<Option<Claim>>> {
        claims_from_metadata(self, names)
    }
}

/// The claims at `names`, parsed from the payload `head`'s metadata holds: for heads
/// that have no proxy to keep them parsed, and for a call that set the payload itself.
pub(crate) fn claims_from_metadata<H: HeadAccess + ?Sized>(
    head: &H,
    names: &[&str],
) -> Option<Vec<Option<Claim>>> {
    let payload = head.metadata(dpumesh_claims::PAYLOAD_KEY)?;
    Some(dpumesh_claims::Claims::parse(&payload)?.claims(names))
}

/// The request being filtered.
///
/// The method, scheme, authority and path are at hand; every other accessor asks the
/// proxy (a few hundred nanoseconds each), so fetch only what the decision needs, and
/// use [`Request::headers`] to fetch several headers in one call.
pub struct Request<'a> {
    method: OnceCell<Method>,
    scheme: OnceCell<Scheme>,
    authority: OnceCell<String>,
    path: OnceCell<String>,
    head: &'a dyn HeadAccess,
}

impl fmt::Debug for Request<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Request")
            .field("method", &self.method.get())
            .field("scheme", &self.scheme.get())
            .field("authority", &self.authority.get())
            .field("path", &self.path.get())
            .finish_non_exhaustive()
    }
}

impl<'a> Request<'a> {
    /// A request whose line is already known (the `on-request` call).
    pub fn with_line(line: RequestLine, head: &'a dyn HeadAccess) -> Self {
        Self {
            method: OnceCell::from(line.method),
            scheme: OnceCell::from(line.scheme),
            authority: OnceCell::from(line.authority),
            path: OnceCell::from(line.path),
            head,
        }
    }

    /// A request whose line is fetched from the head a field at a time, on first use
    /// (the `on-request-head` and `on-response` calls).
    pub fn lazy(head: &'a dyn HeadAccess) -> Self {
        Self {
            method: OnceCell::new(),
            scheme: OnceCell::new(),
            authority: OnceCell::new(),
            path: OnceCell::new(),
            head,
        }
    }

    /// The method, e.g. `GET`.
    pub fn method(&self) -> &str {
        self.method_kind().as_str()
    }

    /// The method as an enum.
    pub fn method_kind(&self) -> &Method {
        self.method.get_or_init(|| self.head.method())
    }

    /// `http` or `https`.
    pub fn scheme(&self) -> &str {
        self.scheme.get_or_init(|| self.head.scheme()).as_str()
    }

    /// The authority.
    pub fn authority(&self) -> &str {
        self.authority.get_or_init(|| self.head.authority())
    }

    /// The path without the query.
    pub fn path(&self) -> &str {
        self.path.get_or_init(|| self.head.path())
    }

    /// The raw query string, without `?`.
    pub fn query(&self) -> Option<String> {
        self.head.query()
    }

    /// The first value of query parameter `name`, percent-decoded (`+` is a space).
    pub fn query_param(&self, name: &str) -> Option<String> {
        crate::util::query_param(&self.query()?, name)
    }

    /// The first value of header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<String> {
        self.head.header(name)
    }

    /// All values of header `name`, in arrival order.
    pub fn header_all(&self, name: &str) -> Vec<String> {
        self.head.header_all(name)
    }

    /// The first value of each of `names`, fetched in one call.
    pub fn headers(&self, names: &[&str]) -> Vec<Option<String>> {
        self.head.headers(names)
    }

    /// The distinct header names, lower-cased.
    pub fn header_names(&self) -> Vec<String> {
        self.head.header_names()
    }

    /// The value of cookie `name` from the `Cookie` headers.
    pub fn cookie(&self, name: &str) -> Option<String> {
        self.header_all("cookie")
            .iter()
            .find_map(|line| crate::util::cookie(line, name))
    }

    /// Who sent the request.
    pub fn source(&self) -> Peer {
        self.head.source()
    }

    /// The destination service the router chose, if routing has happened.
    pub fn destination(&self) -> Option<String> {
        self.head.destination()
    }

    /// Replaces every value of header `name`.
    pub fn set_header(&self, name: &str, value: &str) -> Result<(), HeaderError> {
        self.head.set_header(name, value)
    }

    /// Adds one more value of header `name`.
    pub fn append_header(&self, name: &str, value: &str) -> Result<(), HeaderError> {
        self.head.append_header(name, value)
    }

    /// Removes header `name`.
    pub fn remove_header(&self, name: &str) -> Result<(), HeaderError> {
        self.head.remove_header(name)
    }

    /// Metadata set earlier in the chain.
    pub fn metadata(&self, key: &str) -> Option<String> {
        self.head.metadata(key)
    }

    /// Sets metadata for later filters and the response phase.
    pub fn set_metadata(&self, key: &str, value: &str) {
        self.head.set_metadata(key, value)
    }

    /// The verified JWT claims at `names` (`a.b` walks into objects), in order, typed;
    /// `None` when the request carries no verified claims (no JWT filter verified a
    /// token before this one). The proxy keeps each payload parsed, so this costs one
    /// crossing and no JSON parsing in the filter: ask for every claim the decision
    /// needs in one call.
    pub fn claims(&self, names: &[&str]) -> Option<Vec<Option<Claim>>> {
        self.head.claims(names)
    }

    /// Wall-clock time for this request's decisions, ns since the Unix epoch: when the
    /// proxy started the request's chain if the call brought it (no crossing), else
    /// [`crate::clock::wall_ns`]. Every filter of a chain sees the same value.
    pub fn wall_ns(&self) -> u64 {
        self.head
            .times()
            .map_or_else(crate::clock::wall_ns, |(wall, _)| wall)
    }

    /// Monotonic time for this request, ns, taken as [`Request::wall_ns`] is.
    pub fn monotonic_ns(&self) -> u64 {
        self.head
            .times()
            .map_or_else(crate::clock::monotonic_ns, |(_, mono)| mono)
    }
}

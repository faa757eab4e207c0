//! What a filter answers, and what it learns about the response.

/// A reply sent in place of forwarding the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalReply {
    /// HTTP status, 100–599.
    pub status: u16,
    /// Reply headers, in order.
    pub headers: Vec<(String, String)>,
    /// Reply body.
    pub body: String,
}

impl LocalReply {
    /// A reply with `status`, no headers and an empty body.
    pub fn new(status: u16) -> Self {
        Self {
            status,
            headers: Vec::new(),
            body: String::new(),
        }
    }

    /// Adds a header.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// Sets the body.
    pub fn body(mut self, body: impl Into<String>) -> Self {
        self.body = body.into();
        self
    }

    /// The first value of header `name` (ASCII case-insensitive).
    pub fn header_value(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// A filter's decision about a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Pass the request on.
    Continue,
    /// Answer with this reply and stop the chain.
    Deny(LocalReply),
}

impl Verdict {
    /// Whether this is [`Verdict::Continue`].
    pub fn is_continue(&self) -> bool {
        matches!(self, Self::Continue)
    }

    /// The reply of a [`Verdict::Deny`].
    pub fn reply(&self) -> Option<&LocalReply> {
        match self {
            Self::Continue => None,
            Self::Deny(reply) => Some(reply),
        }
    }
}

impl From<LocalReply> for Verdict {
    fn from(reply: LocalReply) -> Self {
        Self::Deny(reply)
    }
}

/// How a request ended when it did not get an ordinary upstream answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FailureKind {
    /// An upstream answered (judge 5xx by the status).
    #[default]
    None,
    /// No upstream connection could be made.
    ConnectFailure,
    /// The upstream reset the connection.
    UpstreamReset,
    /// A timeout expired.
    Timeout,
    /// A filter denied the request; no upstream saw it.
    LocalReply,
    /// The proxy itself failed.
    Internal,
}

/// The outcome of a request, for `on_response`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ResponseInfo {
    /// Status sent to the client.
    pub status: u16,
    /// Request start to response head, in nanoseconds.
    pub latency_ns: u64,
    /// The upstream endpoint that answered.
    pub upstream: Option<String>,
    /// How the request ended.
    pub failure: FailureKind,
}

impl ResponseInfo {
    /// Whether the upstream failed: a connect failure, reset or timeout, or a 5xx from
    /// the upstream. Local replies and proxy-internal failures are never upstream
    /// failures.
    pub fn is_upstream_failure(&self) -> bool {
        match self.failure {
            FailureKind::None => self.status >= 500,
            FailureKind::ConnectFailure | FailureKind::UpstreamReset | FailureKind::Timeout => true,
            FailureKind::LocalReply | FailureKind::Internal => false,
        }
    }
}

//! The proxy error: one type for everything that ends a request without a service's
//! answer, in the ingress and in the DPU proxy alike.
//!
//! Each [`ErrorKind`] knows its HTTP status, its [`Source`] (the client's side, the
//! service's side, the proxy itself, or policy) and whether another try may help, so
//! the status a client sees, what the circuit breaker counts and what the retry logic
//! retries are all read from one table ([`ErrorKind::status`], [`ErrorKind::source`],
//! [`ErrorKind::retryable`], [`ErrorKind::upstream_failure`]) instead of being decided
//! again at every place a request can fail.
//!
//! A filter's denial is not an error: it is the filter's own reply, status and all.

#![forbid(unsafe_code)]

use std::fmt;

use dpumesh_head::wire::ResponseHead;
use http::{HeaderMap, HeaderValue};

/// Whose side a failure is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Source {
    /// The client's side: what it sent, or the connection or memory it answers on.
    Downstream,
    /// The service's side: its pods, its node, the link to that node.
    Upstream,
    /// The proxy itself: its own capacity, threads, shutdown.
    Internal,
    /// The configuration refused the request (no route).
    Policy,
}

impl Source {
    /// Lowercase name, for logs and metric labels.
    pub fn name(self) -> &'static str {
        match self {
            Self::Downstream => "downstream",
            Self::Upstream => "upstream",
            Self::Internal => "internal",
            Self::Policy => "policy",
        }
    }
}

/// How an upstream failed, as a circuit breaker counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum UpstreamFailure {
    /// No connection to the service could be made, or its pod could not take the
    /// request.
    Connect,
    /// The service (or the link to its node) went away before a whole, well-formed
    /// response.
    Reset,
    /// No answer in time.
    Timeout,
}

/// What went wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The request (head, body framing) is malformed.
    MalformedRequest,
    /// `Content-Length` and `Transfer-Encoding` together, or several of either: the
    /// request could be read two ways, so the connection is closed after the answer.
    AmbiguousFraming,
    /// The request head is larger than the limit or than the mesh can carry.
    HeadTooLarge,
    /// The request body is larger than the limit.
    BodyTooLarge,
    /// The request body did not arrive in time.
    BodyTimeout,
    /// The client has its share of the proxy's request slots in flight already.
    ClientLimit,
    /// A method the mesh does not serve. The connection is closed after the answer:
    /// what the client sends next may not be a request (a tunnel's bytes).
    UnsupportedMethod,
    /// The client's side of the mesh failed while the request was under way (its link
    /// went, its memory could not be read or written).
    DownstreamLost,
    /// The calling pod has no room for the answer it asked for.
    CallerOutOfBuffers,
    /// No route matches the request.
    NoRoute,
    /// No pod or node serves the service.
    NoEndpoint,
    /// The service's node could not be reached.
    Unreachable,
    /// The service's pod could not take the request (it left, its rings or pools are
    /// full).
    EndpointRefused,
    /// The link to the service's node went down with the request on it.
    LinkLost,
    /// The service did not answer within the request's timeout.
    Timeout,
    /// The service did not answer one try within its per-try timeout.
    TryTimeout,
    /// The service's answer could not be used (malformed head, body larger than the
    /// buffer it was given).
    BadResponse,
    /// The proxy has no room for the request (buffers, slots).
    Overloaded,
    /// The proxy is shutting down.
    ShuttingDown,
    /// A proxy thread that held the request died; it was answered for it.
    ThreadLost,
    /// Anything else that is the proxy's own fault.
    Internal,
}

impl ErrorKind {
    /// The HTTP status the client gets.
    pub fn status(self) -> u16 {
        match self {
            Self::MalformedRequest | Self::AmbiguousFraming => 400,
            Self::NoRoute => 404,
            Self::BodyTimeout => 408,
            Self::ClientLimit => 429,
            Self::BodyTooLarge => 413,
            Self::HeadTooLarge => 431,
            Self::Internal => 500,
            Self::UnsupportedMethod => 501,
            Self::DownstreamLost | Self::Unreachable | Self::LinkLost | Self::BadResponse => 502,
            Self::CallerOutOfBuffers
            | Self::NoEndpoint
            | Self::EndpointRefused
            | Self::Overloaded
            | Self::ShuttingDown
            | Self::ThreadLost => 503,
            Self::Timeout | Self::TryTimeout => 504,
        }
    }

    /// Whose side the failure is on.
    pub fn source(self) -> Source {
        match self {
            Self::MalformedRequest
            | Self::AmbiguousFraming
            | Self::HeadTooLarge
            | Self::BodyTooLarge
            | Self::BodyTimeout
            | Self::ClientLimit
            | Self::UnsupportedMethod
            | Self::DownstreamLost
            | Self::CallerOutOfBuffers => Source::Downstream,
            Self::NoRoute => Source::Policy,
            Self::NoEndpoint
            | Self::Unreachable
            | Self::EndpointRefused
            | Self::LinkLost
            | Self::Timeout
            | Self::TryTimeout
            | Self::BadResponse => Source::Upstream,
            Self::Overloaded | Self::ShuttingDown | Self::ThreadLost | Self::Internal => {
                Source::Internal
            }
        }
    }

    /// Whether another try (on another pod or node) may succeed where this one failed.
    /// Whether a request is retried also depends on its method, its body and its
    /// time left: that is the retry logic's to check.
    pub fn retryable(self) -> bool {
        matches!(
            self,
            Self::Unreachable | Self::EndpointRefused | Self::LinkLost | Self::TryTimeout
        )
    }

    /// How the upstream failed, for a circuit breaker; `None` when no upstream is to
    /// blame (a breaker must not count those).
    pub fn upstream_failure(self) -> Option<UpstreamFailure> {
        match self {
            Self::NoEndpoint | Self::Unreachable | Self::EndpointRefused => {
                Some(UpstreamFailure::Connect)
            }
            Self::LinkLost | Self::BadResponse => Some(UpstreamFailure::Reset),
            Self::Timeout | Self::TryTimeout => Some(UpstreamFailure::Timeout),
            _ => None,
        }
    }

    /// Seconds a client should wait before trying again, for back-pressure answers
    /// (`retry-after`): the pod or the proxy had no room now, not a broken service.
    pub fn retry_after(self) -> Option<u32> {
        matches!(
            self,
            Self::EndpointRefused
                | Self::ClientLimit
                | Self::Overloaded
                | Self::CallerOutOfBuffers
                | Self::ShuttingDown
        )
        .then_some(1)
    }

    /// Whether the client connection must be closed after the answer (the rest of it
    /// cannot be trusted).
    pub fn closes_connection(self) -> bool {
        matches!(self, Self::AmbiguousFraming | Self::UnsupportedMethod)
    }
}

/// A request ended by the proxy: what went wrong, and the detail a client or an
/// operator needs to act on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProxyError {
    kind: ErrorKind,
    message: String,
}

impl ProxyError {
    /// An error of `kind`; `message` says what happened in words an operator can act
    /// on (it is sent to the client as the body).
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    /// What went wrong.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    pub fn message(&self) -> &str {
        &self.message
    }

    /// See [`ErrorKind::status`].
    pub fn status(&self) -> u16 {
        self.kind.status()
    }

    /// See [`ErrorKind::source`].
    pub fn source(&self) -> Source {
        self.kind.source()
    }

    /// See [`ErrorKind::retryable`].
    pub fn retryable(&self) -> bool {
        self.kind.retryable()
    }

    /// See [`ErrorKind::upstream_failure`].
    pub fn upstream_failure(&self) -> Option<UpstreamFailure> {
        self.kind.upstream_failure()
    }

    /// The body of the answer: `dpumesh: <message>` and a newline, as plain text.
    pub fn body(&self) -> Vec<u8> {
        format!("dpumesh: {}\n", self.message).into_bytes()
    }

    /// The response head of the answer (status and `content-type: text/plain`, plus
    /// `connection: close` where the connection cannot be trusted any more).
    pub fn response_head(&self) -> ResponseHead {
        let mut headers = HeaderMap::new();
        headers.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain"),
        );
        if self.kind.closes_connection() {
            headers.insert(http::header::CONNECTION, HeaderValue::from_static("close"));
        }
        if let Some(secs) = self.kind.retry_after() {
            headers.insert(http::header::RETRY_AFTER, HeaderValue::from(secs));
        }
        ResponseHead {
            status: self.status(),
            headers,
            ..Default::default()
        }
    }
}

impl fmt::Display for ProxyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for ProxyError {}

#[cfg(test)]
mod tests {
    use test_case::test_case;

    use super::*;

    #[test_case(ErrorKind::MalformedRequest, 400, Source::Downstream, false, None; "malformed")]
    #[test_case(ErrorKind::NoRoute, 404, Source::Policy, false, None; "no route")]
    #[test_case(ErrorKind::BodyTimeout, 408, Source::Downstream, false, None; "body timeout")]
    #[test_case(ErrorKind::ClientLimit, 429, Source::Downstream, false, None; "client limit")]
    #[test_case(ErrorKind::BodyTooLarge, 413, Source::Downstream, false, None; "body too large")]
    #[test_case(ErrorKind::HeadTooLarge, 431, Source::Downstream, false, None; "head too large")]
    #[test_case(ErrorKind::DownstreamLost, 502, Source::Downstream, false, None; "downstream lost")]
    #[test_case(ErrorKind::CallerOutOfBuffers, 503, Source::Downstream, false, None; "caller full")]
    #[test_case(ErrorKind::NoEndpoint, 503, Source::Upstream, false, Some(UpstreamFailure::Connect); "no endpoint")]
    #[test_case(ErrorKind::Unreachable, 502, Source::Upstream, true, Some(UpstreamFailure::Connect); "unreachable")]
    #[test_case(ErrorKind::EndpointRefused, 503, Source::Upstream, true, Some(UpstreamFailure::Connect); "refused")]
    #[test_case(ErrorKind::LinkLost, 502, Source::Upstream, true, Some(UpstreamFailure::Reset); "link lost")]
    #[test_case(ErrorKind::BadResponse, 502, Source::Upstream, false, Some(UpstreamFailure::Reset); "bad response")]
    #[test_case(ErrorKind::Timeout, 504, Source::Upstream, false, Some(UpstreamFailure::Timeout); "timeout")]
    #[test_case(ErrorKind::TryTimeout, 504, Source::Upstream, true, Some(UpstreamFailure::Timeout); "try timeout")]
    #[test_case(ErrorKind::Overloaded, 503, Source::Internal, false, None; "overloaded")]
    #[test_case(ErrorKind::ShuttingDown, 503, Source::Internal, false, None; "shutting down")]
    #[test_case(ErrorKind::ThreadLost, 503, Source::Internal, false, None; "thread lost")]
    #[test_case(ErrorKind::Internal, 500, Source::Internal, false, None; "internal")]
    #[test_case(ErrorKind::UnsupportedMethod, 501, Source::Downstream, false, None; "unsupported method")]
    fn every_kind_has_one_status_source_and_retry_rule(
        kind: ErrorKind,
        status: u16,
        source: Source,
        retryable: bool,
        upstream: Option<UpstreamFailure>,
    ) {
        let e = ProxyError::new(kind, "x");
        assert_eq!(e.status(), status);
        assert_eq!(e.source(), source);
        assert_eq!(e.retryable(), retryable);
        assert_eq!(e.upstream_failure(), upstream);
    }

    #[test]
    fn only_upstream_failures_are_blamed_on_an_upstream() {
        use ErrorKind::*;
        for kind in [
            MalformedRequest,
            AmbiguousFraming,
            HeadTooLarge,
            BodyTooLarge,
            BodyTimeout,
            DownstreamLost,
            CallerOutOfBuffers,
            NoRoute,
            NoEndpoint,
            Unreachable,
            EndpointRefused,
            LinkLost,
            Timeout,
            TryTimeout,
            BadResponse,
            Overloaded,
            ShuttingDown,
            ThreadLost,
            Internal,
        ] {
            assert_eq!(
                kind.upstream_failure().is_some(),
                kind.source() == Source::Upstream,
                "{kind:?}"
            );
            assert!(
                !kind.retryable() || kind.source() == Source::Upstream,
                "{kind:?}: only an upstream failure is worth another try"
            );
        }
    }

    #[test]
    fn the_answer_is_plain_text_and_closes_only_untrusted_connections() {
        let e = ProxyError::new(ErrorKind::ShuttingDown, "the ingress is shutting down");
        assert_eq!(e.status(), 503);
        assert_eq!(e.body(), b"dpumesh: the ingress is shutting down\n");
        let head = e.response_head();
        assert_eq!(head.status, 503);
        assert_eq!(head.headers["content-type"], "text/plain");
        assert!(head.headers.get("connection").is_none());
        let head = ProxyError::new(ErrorKind::AmbiguousFraming, "x").response_head();
        assert_eq!(head.headers["connection"], "close");
        let head = ProxyError::new(ErrorKind::EndpointRefused, "ring full").response_head();
        assert_eq!(head.status, 503);
        assert_eq!(
            head.headers["retry-after"], "1",
            "back-pressure says when to retry"
        );
        let head = ProxyError::new(ErrorKind::NoRoute, "x").response_head();
        assert!(!head.headers.contains_key("retry-after"));
    }
}

//! How an answer counts for the circuit breaker of the response phase, and whom it
//! blames: a pod of the service, or the node it called through. Only upstream
//! failures count; the proxy's own refusals, and a service's 5xx that says it failed
//! for a dependency, do not eject anyone.

use dpumesh_error::{ErrorKind, ProxyError, Source, UpstreamFailure};
use dpumesh_head::wire::ResponseHead;
use dpumesh_head::{DEPENDENCY_FAILED_HEADER, DEPENDENCY_FAILED_METADATA};
use dpumesh_runtime::{FailureKind, RequestHead};

/// How a request the proxy ended counts for the response phase (the circuit breaker
/// counts only upstream failures): read from the error's kind, in this one place.
pub(in crate::dataplane) fn failure_kind(e: &ProxyError) -> FailureKind {
    if e.kind() == ErrorKind::NoEndpoint {
        // No pod of the service is registered here (starting, or registering again
        // after their node restarted): no upstream saw the request and there is none
        // to eject. A breaker that counted these would keep the service out for its
        // ejection time after its pods are back (Envoy's "no healthy upstream" is not
        // an outlier signal either).
        return FailureKind::LocalReply;
    }
    match e.upstream_failure() {
        Some(UpstreamFailure::Connect) => FailureKind::ConnectFailure,
        Some(UpstreamFailure::Reset) => FailureKind::UpstreamReset,
        Some(UpstreamFailure::Timeout) => FailureKind::Timeout,
        None => match e.source() {
            // Nothing upstream saw the request: like a filter's denial, not the
            // service's failure.
            Source::Downstream | Source::Policy => FailureKind::LocalReply,
            Source::Internal | Source::Upstream => FailureKind::Internal,
        },
    }
}

/// A pod as the upstream the response phase names (what the breaker and the metrics
/// blame).
pub(in crate::dataplane) fn pod_upstream(service: &str, pod: u32) -> String {
    format!("{service}/pod-{pod}")
}

/// A peer node as the upstream: a request that failed because the node or the link to
/// it died is that node's failure, not the pod's that called through it.
pub(in crate::dataplane) fn node_upstream(node: &str) -> String {
    format!("node/{node}")
}

/// A 5xx answer that says its service failed only because a service it called did
/// (the host library's [`DEPENDENCY_FAILED_HEADER`]) is told to the response phase as
/// [`DEPENDENCY_FAILED_METADATA`], so the breaker in front of the service does not
/// eject it for its dependency's fault.
pub(in crate::dataplane) fn mark_dependency_failure(
    request: Option<&mut RequestHead>,
    response_head: Option<&ResponseHead>,
) {
    let said = response_head.is_some_and(|h| h.headers.contains_key(DEPENDENCY_FAILED_HEADER));
    if let (true, Some(head)) = (said, request) {
        head.set_metadata(DEPENDENCY_FAILED_METADATA, "1");
    }
}

#[cfg(test)]
mod tests {
    use http::HeaderMap;
    use test_case::test_case;

    use super::*;

    #[test_case(ErrorKind::EndpointRefused, FailureKind::ConnectFailure; "a pod that cannot take the request is the service's")]
    #[test_case(ErrorKind::Unreachable, FailureKind::ConnectFailure; "an unreachable node")]
    #[test_case(ErrorKind::NoEndpoint, FailureKind::LocalReply; "no endpoint: nothing to eject")]
    #[test_case(ErrorKind::LinkLost, FailureKind::UpstreamReset; "a lost link to the service's node")]
    #[test_case(ErrorKind::BadResponse, FailureKind::UpstreamReset; "an unusable answer")]
    #[test_case(ErrorKind::TryTimeout, FailureKind::Timeout; "a try timeout")]
    #[test_case(ErrorKind::Timeout, FailureKind::Timeout; "a timeout")]
    #[test_case(ErrorKind::DownstreamLost, FailureKind::LocalReply; "the client's side went away")]
    #[test_case(ErrorKind::HeadTooLarge, FailureKind::LocalReply; "a head too large")]
    #[test_case(ErrorKind::NoRoute, FailureKind::LocalReply; "no route")]
    #[test_case(ErrorKind::Overloaded, FailureKind::Internal; "the proxy is out of buffers")]
    #[test_case(ErrorKind::ThreadLost, FailureKind::Internal; "a proxy thread died")]
    fn the_breaker_sees_each_error_by_its_source(kind: ErrorKind, failure: FailureKind) {
        assert_eq!(failure_kind(&ProxyError::new(kind, "x")), failure);
    }

    #[test]
    fn the_upstream_blamed_is_the_pod_or_the_node() {
        assert_eq!(pod_upstream("rates", 7), "rates/pod-7");
        assert_eq!(node_upstream("n2"), "node/n2");
    }

    #[test_case(true, true; "a 5xx that says a dependency failed")]
    #[test_case(false, false; "a 5xx of the service's own")]
    fn a_dependency_failure_is_told_to_the_breaker(said: bool, marked: bool) {
        let mut headers = HeaderMap::new();
        if said {
            headers.insert(DEPENDENCY_FAILED_HEADER, "1".parse().unwrap());
        }
        let answer = ResponseHead {
            status: 503,
            headers,
            ..Default::default()
        };
        let mut head = RequestHead::new("GET", "/");
        mark_dependency_failure(Some(&mut head), Some(&answer));
        assert_eq!(head.metadata(DEPENDENCY_FAILED_METADATA).is_some(), marked);
    }
}

//! Whether a failed try is tried again: the failure must be one a fresh try can cure,
//! and the exchange must allow it (tries left, an idempotent method, its body still at
//! hand, time left, and its try at a pod here: a try at a peer may still write into
//! the reply buffer it was lent).

use std::time::Instant;

/// How a try failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::dataplane) enum Failure {
    /// The proxy's own error: retryable or not (`ErrorKind::retryable`: unreachable,
    /// refused, link lost, per-try timeout).
    Error { retryable: bool },
    /// The pod answered with this status.
    Status(u16),
    /// The pod answered a gRPC call with a gRPC status its route retries on
    /// (`retries.grpc_on`).
    GrpcRetryable,
}

impl Failure {
    /// Whether a fresh try may cure it: a retryable error, or a 502, 503 or 504 (the
    /// pod's upstream or the pod itself was unavailable); any other answer is the
    /// service's, and goes back as it is.
    pub(in crate::dataplane) fn curable(self) -> bool {
        match self {
            Self::Error { retryable } => retryable,
            Self::Status(status) => matches!(status, 502..=504),
            Self::GrpcRetryable => true,
        }
    }
}

/// What the exchange allows, read from it when a try fails.
#[derive(Debug, Clone, Copy)]
pub(in crate::dataplane) struct Allowance {
    /// Tries made so far (the first is 1).
    pub attempt: u32,
    /// The route's `retries`.
    pub retries: u32,
    /// An idempotent method, or a gRPC call on a route that names gRPC statuses to
    /// retry (its owner declared its calls safe to try again).
    pub idempotent: bool,
    /// Its body can be sent again (at the ingress, or none).
    pub body_at_hand: bool,
    /// The failed try went to a pod on this node.
    pub at_pod: bool,
    pub deadline: Instant,
}

/// Whether the try that failed with `failure` at `now` is tried again.
pub(in crate::dataplane) fn again(failure: Failure, allows: &Allowance, now: Instant) -> bool {
    failure.curable() && allowed(allows, now)
}

/// Whether the exchange allows another try at `now`, whatever the failure.
pub(in crate::dataplane) fn allowed(a: &Allowance, now: Instant) -> bool {
    a.attempt <= a.retries && a.idempotent && a.body_at_hand && a.at_pod && now < a.deadline
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use test_case::test_case;

    use super::*;

    fn allowance(now: Instant) -> Allowance {
        Allowance {
            attempt: 1,
            retries: 1,
            idempotent: true,
            body_at_hand: true,
            at_pod: true,
            deadline: now + Duration::from_secs(1),
        }
    }

    #[test_case(Failure::Error { retryable: true }, true; "a retryable error")]
    #[test_case(Failure::Error { retryable: false }, false; "an error a new try cannot cure")]
    #[test_case(Failure::Status(502), true; "502")]
    #[test_case(Failure::Status(503), true; "503")]
    #[test_case(Failure::Status(504), true; "504")]
    #[test_case(Failure::Status(500), false; "500 is the service's answer")]
    #[test_case(Failure::Status(404), false; "404 is the service's answer")]
    fn which_failures_a_new_try_may_cure(failure: Failure, again_: bool) {
        let now = Instant::now();
        assert_eq!(again(failure, &allowance(now), now), again_);
    }

    #[derive(Debug, Clone, Copy)]
    enum Change {
        None,
        TriesUsed,
        NotIdempotent,
        BodyGone,
        AtPeer,
        PastDeadline,
    }

    #[test_case(Change::None, true; "everything allows it")]
    #[test_case(Change::TriesUsed, false; "no tries left")]
    #[test_case(Change::NotIdempotent, false; "POST is not retried")]
    #[test_case(Change::BodyGone, false; "a pod's body was handed on by the first try")]
    #[test_case(Change::AtPeer, false; "a try at a peer may still write its reply")]
    #[test_case(Change::PastDeadline, false; "no time left")]
    fn what_the_exchange_allows(change: Change, allowed_: bool) {
        let now = Instant::now();
        let mut a = allowance(now);
        match change {
            Change::None => {}
            Change::TriesUsed => a.attempt = 2,
            Change::NotIdempotent => a.idempotent = false,
            Change::BodyGone => a.body_at_hand = false,
            Change::AtPeer => a.at_pod = false,
            Change::PastDeadline => a.deadline = now,
        }
        assert_eq!(allowed(&a, now), allowed_);
        assert_eq!(again(Failure::Status(503), &a, now), allowed_);
    }
}

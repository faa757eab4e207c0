//! Deadlines: an exchange's (the route's timeout, or the mesh's, within what the
//! sender will wait) and a try's (the route's per-try timeout, never past the
//! exchange's), and the part of what is left that a peer proxy is given.

use std::time::{Duration, Instant};

/// When an exchange opened at `now` must be answered: `route` (the route's timeout)
/// or `default` (the mesh's), shortened to `limit` (what the sender said it waits).
pub(in crate::dataplane) fn deadline(
    now: Instant,
    route: Option<Duration>,
    default: Duration,
    limit: Option<Duration>,
) -> Instant {
    let timeout = route.unwrap_or(default);
    now + limit.map_or(timeout, |l| l.min(timeout))
}

/// When a try started at `now` must have an answer: `per_try` later, but never past
/// the exchange's `deadline` (`None`: the route sets no per-try timeout).
pub(in crate::dataplane) fn try_deadline(
    now: Instant,
    per_try: Option<Duration>,
    deadline: Instant,
) -> Option<Instant> {
    per_try.map(|p| (now + p).min(deadline))
}

/// What a peer proxy is told it has, in milliseconds: nine tenths of what is left, so
/// its 504 usually arrives before our own deadline (and what was lent to it comes back
/// with it); at least 1 ms.
pub(in crate::dataplane) fn peer_budget_ms(deadline: Instant, now: Instant) -> u32 {
    let left = deadline.saturating_duration_since(now);
    (left.as_millis() * 9 / 10).clamp(1, u128::from(u32::MAX)) as u32
}

#[cfg(test)]
mod tests {
    use test_case::test_case;

    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test_case(Some(300), 5000, None, 300; "the route's timeout")]
    #[test_case(None, 5000, None, 5000; "the mesh's when the route sets none")]
    #[test_case(Some(300), 5000, Some(100), 100; "what the sender waits, when shorter")]
    #[test_case(Some(300), 5000, Some(900), 300; "the route's, when the sender waits longer")]
    #[test_case(None, 5000, Some(0), 0; "a sender with no time left")]
    fn an_exchange_deadline(route: Option<u32>, default: u32, limit: Option<u32>, ms: u32) {
        let t0 = Instant::now();
        let got = deadline(
            t0,
            route.map(|r| r * MS),
            default * MS,
            limit.map(|l| l * MS),
        );
        assert_eq!(got, t0 + ms * MS);
    }

    #[test_case(None, 1000, None; "no per-try timeout")]
    #[test_case(Some(100), 1000, Some(100); "a per-try timeout")]
    #[test_case(Some(100), 50, Some(50); "never past the exchange's deadline")]
    fn a_try_deadline(per_try: Option<u32>, left: u32, at: Option<u32>) {
        let t0 = Instant::now();
        let got = try_deadline(t0, per_try.map(|p| p * MS), t0 + left * MS);
        assert_eq!(got, at.map(|a| t0 + a * MS));
    }

    #[test_case(1000, 900; "nine tenths")]
    #[test_case(1, 1; "at least a millisecond")]
    #[test_case(0, 1; "past the deadline: still a millisecond, the peer answers 504")]
    fn a_peers_budget(left: u32, ms: u32) {
        let t0 = Instant::now();
        assert_eq!(peer_budget_ms(t0 + left * MS, t0), ms);
    }
}

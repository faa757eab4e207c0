//! When to try a peer again after connecting to it failed: soon at first (a peer that
//! was killed and is started again is back in a fraction of a second), then less and
//! less often up to a cap, so a peer that stays down costs one connect attempt per
//! cap and never a busy loop. Meanwhile requests for it are refused at once.
//!
//! Pure: the caller passes the time.

use std::collections::{HashMap, HashSet};
use std::hash::Hash;
use std::time::{Duration, Instant};

/// The first wait after a failed connect.
pub const FIRST: Duration = Duration::from_millis(100);
/// The longest wait (a connect refused by a local or nearby peer costs microseconds:
/// two a second is no load, and a peer that came back waits at most this long).
pub const CAP: Duration = Duration::from_millis(500);

#[derive(Debug, Clone, Copy)]
struct Unreachable {
    until: Instant,
    /// The wait after the next failure.
    next: Duration,
}

/// The peers (by key) whose connect failed, and when each may be tried again.
#[derive(Debug)]
pub struct Reconnect<K> {
    first: Duration,
    cap: Duration,
    failed: HashMap<K, Unreachable>,
    /// Peers whose link went down and that were not connected again yet.
    lost: HashSet<K>,
}

impl<K: Hash + Eq + Clone> Default for Reconnect<K> {
    fn default() -> Self {
        Self::new(FIRST, CAP)
    }
}

impl<K: Hash + Eq + Clone> Reconnect<K> {
    /// Waits of `first`, doubling up to `cap`.
    pub fn new(first: Duration, cap: Duration) -> Self {
        Self {
            first,
            cap,
            failed: HashMap::new(),
            lost: HashSet::new(),
        }
    }

    /// Whether `peer` may be tried at `now`.
    pub fn may_try(&self, peer: &K, now: Instant) -> bool {
        self.failed.get(peer).is_none_or(|u| now >= u.until)
    }

    /// Connecting to `peer` failed at `now`; returns how long it is left alone.
    pub fn failed(&mut self, peer: &K, now: Instant) -> Duration {
        let wait = self.failed.get(peer).map_or(self.first, |u| u.next);
        self.failed.insert(
            peer.clone(),
            Unreachable {
                until: now + wait,
                next: (wait * 2).min(self.cap),
            },
        );
        wait
    }

    /// The link to `peer` went down.
    pub fn lost(&mut self, peer: &K) {
        self.lost.insert(peer.clone());
    }

    /// Connected to `peer`: returns whether this was a reconnect (it had failed or
    /// its link had gone down), for the counters.
    pub fn connected(&mut self, peer: &K) -> bool {
        let failed = self.failed.remove(peer).is_some();
        let lost = self.lost.remove(peer);
        failed || lost
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn waits_double_up_to_the_cap_and_a_connect_resets_them() {
        let mut r = Reconnect::new(ms(100), ms(350));
        let t = Instant::now();
        assert!(r.may_try(&"n2", t));
        assert_eq!(r.failed(&"n2", t), ms(100));
        assert!(!r.may_try(&"n2", t + ms(99)));
        assert!(r.may_try(&"n2", t + ms(100)));
        assert!(r.may_try(&"n1", t), "peers are apart");
        assert_eq!(r.failed(&"n2", t + ms(100)), ms(200));
        assert_eq!(r.failed(&"n2", t + ms(300)), ms(350));
        assert_eq!(r.failed(&"n2", t + ms(650)), ms(350));
        assert!(r.connected(&"n2"), "a reconnect");
        assert_eq!(
            r.failed(&"n2", t + ms(1000)),
            ms(100),
            "back to the first wait"
        );
    }

    #[test]
    fn a_lost_link_made_again_is_a_reconnect_and_a_first_connect_is_not() {
        let mut r = Reconnect::<&str>::default();
        assert!(!r.connected(&"n1"));
        r.lost(&"n1");
        assert!(r.connected(&"n1"));
        assert!(!r.connected(&"n1"));
    }
}

//! Injected time.
//!
//! Everything in DPUmesh that depends on time (token buckets, breakers, JWT expiry,
//! shared-state TTLs, the clock a filter imports) reads it through [`Clock`], so tests
//! fix or advance time instead of sleeping.

#![forbid(unsafe_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// A source of wall-clock and monotonic time, in nanoseconds.
pub trait Clock: Send + Sync + std::fmt::Debug {
    /// Nanoseconds since the Unix epoch.
    fn wall_ns(&self) -> u64;
    /// Nanoseconds from an arbitrary, fixed start; never goes backwards.
    fn monotonic_ns(&self) -> u64;

    /// Milliseconds on the monotonic clock (what TTLs and buckets count in).
    fn monotonic_ms(&self) -> u64 {
        self.monotonic_ns() / 1_000_000
    }
}

/// A shared, dynamically chosen clock.
pub type SharedClock = Arc<dyn Clock>;

/// The real clock.
#[derive(Debug)]
pub struct SystemClock {
    start: Instant,
}

impl SystemClock {
    /// A system clock whose monotonic time starts near zero now.
    pub fn new() -> Self {
        Self {
            start: Instant::now(),
        }
    }

    /// The system clock as a [`SharedClock`].
    pub fn shared() -> SharedClock {
        Arc::new(Self::new())
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for SystemClock {
    fn wall_ns(&self) -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
            .unwrap_or(0)
    }

    fn monotonic_ns(&self) -> u64 {
        // Offset by one second so that "0" never means "now" at start-up; code that uses
        // 0 as "never" stays correct.
        u64::try_from(self.start.elapsed().as_nanos())
            .unwrap_or(u64::MAX)
            .saturating_add(1_000_000_000)
    }
}

/// A clock that moves only when told to: the test host's clock.
///
/// Wall and monotonic time advance together.
#[derive(Debug)]
pub struct ManualClock {
    wall_ns: AtomicU64,
    monotonic_ns: AtomicU64,
}

impl ManualClock {
    /// A clock fixed at `wall_unix_secs` seconds since the epoch.
    pub fn at_unix_secs(wall_unix_secs: u64) -> Arc<Self> {
        Arc::new(Self {
            wall_ns: AtomicU64::new(wall_unix_secs.saturating_mul(1_000_000_000)),
            monotonic_ns: AtomicU64::new(1_000_000_000),
        })
    }

    /// Moves both clocks forward by `nanos`.
    pub fn advance_ns(&self, nanos: u64) {
        self.wall_ns.fetch_add(nanos, Ordering::SeqCst);
        self.monotonic_ns.fetch_add(nanos, Ordering::SeqCst);
    }

    /// Moves both clocks forward by `millis`.
    pub fn advance_ms(&self, millis: u64) {
        self.advance_ns(millis.saturating_mul(1_000_000));
    }

    /// Moves both clocks forward by `secs`.
    pub fn advance_secs(&self, secs: u64) {
        self.advance_ns(secs.saturating_mul(1_000_000_000));
    }

    /// Sets the wall clock to `secs` since the epoch; the monotonic clock is unchanged
    /// (wall clocks may jump, monotonic ones may not).
    pub fn set_wall_unix_secs(&self, secs: u64) {
        self.wall_ns
            .store(secs.saturating_mul(1_000_000_000), Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn wall_ns(&self) -> u64 {
        self.wall_ns.load(Ordering::SeqCst)
    }

    fn monotonic_ns(&self) -> u64 {
        self.monotonic_ns.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_only_when_told() {
        let clock = ManualClock::at_unix_secs(1_700_000_000);
        assert_eq!(clock.wall_ns(), 1_700_000_000_000_000_000);
        let mono = clock.monotonic_ns();
        assert_eq!(clock.monotonic_ns(), mono);
        clock.advance_ms(1500);
        assert_eq!(clock.wall_ns(), 1_700_000_001_500_000_000);
        assert_eq!(clock.monotonic_ns(), mono + 1_500_000_000);
        clock.set_wall_unix_secs(10);
        assert_eq!(clock.wall_ns(), 10_000_000_000);
        assert_eq!(clock.monotonic_ns(), mono + 1_500_000_000);
    }

    #[test]
    fn system_clock_is_monotonic_and_near_now() {
        let clock = SystemClock::new();
        let a = clock.monotonic_ns();
        let b = clock.monotonic_ns();
        assert!(b >= a);
        let wall_secs = clock.wall_ns() / 1_000_000_000;
        // Later than 2024-01-01: the clock reads real time, not zero.
        assert!(wall_secs > 1_704_067_200, "wall clock reads {wall_secs}");
    }
}

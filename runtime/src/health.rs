//! Filter health: a filter that keeps faulting is put in a "degraded" state for a
//! backoff period, during which its failure policy is applied without calling it.
//!
//! Without this, a filter that traps on every request makes every worker build a
//! fresh instance per request (microseconds for Rust, a millisecond for Python) and
//! log a fault each time. Envoy has no equivalent: a crashed Wasm VM stays failed until
//! the next config push (envoy#39395).
//!
//! Shared by every worker running the filter version; the hot path reads one atomic.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use dpumesh_clock::SharedClock;
use parking_lot::Mutex;

/// When a filter is degraded and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HealthPolicy {
    /// Faults within [`window_ms`](Self::window_ms) that degrade the filter.
    pub faults: usize,
    /// The window over which faults are counted.
    pub window_ms: u64,
    /// First backoff; each further degradation without a success in between doubles it.
    pub backoff_ms: u64,
    pub max_backoff_ms: u64,
}

impl Default for HealthPolicy {
    fn default() -> Self {
        Self {
            faults: 5,
            window_ms: 10_000,
            backoff_ms: 1_000,
            max_backoff_ms: 60_000,
        }
    }
}

/// What `/filters` shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HealthState {
    /// Called normally.
    Healthy,
    /// Not called until the backoff ends (milliseconds left).
    Degraded {
        /// Milliseconds until the next attempt.
        retry_in_ms: u64,
    },
}

#[derive(Debug, Default)]
struct Record {
    faults: VecDeque<u64>,
    /// Degradations since the last success (drives the doubling).
    strikes: u32,
}

/// The health of one filter version.
#[derive(Debug)]
pub struct FilterHealth {
    policy: HealthPolicy,
    clock: SharedClock,
    /// Monotonic ms until which the filter is degraded; 0 when healthy.
    degraded_until: AtomicU64,
    /// Whether any fault is on record, so successes skip the lock when there is none.
    troubled: AtomicBool,
    record: Mutex<Record>,
    total_degradations: AtomicU64,
}

impl FilterHealth {
    /// Health tracking on `clock` with `policy`.
    pub fn new(clock: SharedClock, policy: HealthPolicy) -> Self {
        Self {
            policy,
            clock,
            degraded_until: AtomicU64::new(0),
            troubled: AtomicBool::new(false),
            record: Mutex::new(Record::default()),
            total_degradations: AtomicU64::new(0),
        }
    }

    /// Whether calls should be skipped now. One atomic load when healthy.
    pub fn is_degraded(&self) -> bool {
        matches!(self.state(), HealthState::Degraded { .. })
    }

    /// The state now. Called per filter per request: a healthy filter costs one atomic
    /// load and no clock read.
    pub fn state(&self) -> HealthState {
        let until = self.degraded_until.load(Ordering::Acquire);
        if until == 0 {
            return HealthState::Healthy;
        }
        let now = self.clock.monotonic_ms();
        if now < until {
            HealthState::Degraded {
                retry_in_ms: until - now,
            }
        } else {
            HealthState::Healthy
        }
    }

    /// How many times the filter was degraded since it was loaded.
    pub fn degradations(&self) -> u64 {
        self.total_degradations.load(Ordering::Relaxed)
    }

    /// Records a fault; returns the backoff when this fault degrades the filter.
    pub fn record_fault(&self) -> Option<u64> {
        let now = self.clock.monotonic_ms();
        self.troubled.store(true, Ordering::Release);
        let mut record = self.record.lock();
        record.faults.push_back(now);
        let window_start = now.saturating_sub(self.policy.window_ms);
        while record.faults.front().is_some_and(|&t| t < window_start) {
            record.faults.pop_front();
        }
        if record.faults.len() < self.policy.faults.max(1) {
            return None;
        }
        record.faults.clear();
        let backoff = self
            .policy
            .backoff_ms
            .saturating_mul(1u64 << record.strikes.min(20))
            .min(self.policy.max_backoff_ms);
        record.strikes = record.strikes.saturating_add(1);
        self.degraded_until
            .store(now.saturating_add(backoff).max(1), Ordering::Release);
        self.total_degradations.fetch_add(1, Ordering::Relaxed);
        Some(backoff)
    }

    /// Records a successful call: after a degradation, the backoff starts over.
    pub fn record_success(&self) {
        if !self.troubled.load(Ordering::Acquire) || self.is_degraded() {
            return;
        }
        let mut record = self.record.lock();
        record.faults.clear();
        record.strikes = 0;
        self.degraded_until.store(0, Ordering::Release);
        self.troubled.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use dpumesh_clock::ManualClock;

    use super::*;

    fn health() -> (Arc<ManualClock>, FilterHealth) {
        let clock = ManualClock::at_unix_secs(1_700_000_000);
        let health = FilterHealth::new(clock.clone(), HealthPolicy::default());
        (clock, health)
    }

    #[test]
    fn five_faults_in_the_window_degrade_for_the_backoff() {
        let (clock, health) = health();
        for _ in 0..4 {
            assert_eq!(health.record_fault(), None);
            clock.advance_ms(100);
        }
        assert!(!health.is_degraded());
        assert_eq!(health.record_fault(), Some(1_000));
        assert!(health.is_degraded());
        assert_eq!(health.state(), HealthState::Degraded { retry_in_ms: 1_000 });
        clock.advance_ms(1_000);
        assert!(!health.is_degraded(), "backoff over: the next call tries");
        assert_eq!(health.degradations(), 1);
    }

    #[test]
    fn faults_outside_the_window_do_not_count() {
        let (clock, health) = health();
        for _ in 0..10 {
            assert_eq!(health.record_fault(), None);
            clock.advance_ms(3_000);
        }
        assert!(!health.is_degraded());
    }

    #[test]
    fn backoff_doubles_until_a_success_and_is_capped() {
        let (clock, health) = health();
        let mut backoffs = Vec::new();
        for _ in 0..9 {
            let backoff = (0..5).find_map(|_| health.record_fault()).unwrap();
            backoffs.push(backoff);
            clock.advance_ms(backoff);
        }
        assert_eq!(
            backoffs,
            [
                1_000, 2_000, 4_000, 8_000, 16_000, 32_000, 60_000, 60_000, 60_000
            ]
        );
        health.record_success();
        let backoff = (0..5).find_map(|_| health.record_fault()).unwrap();
        assert_eq!(backoff, 1_000, "a success resets the doubling");
    }

    #[test]
    fn a_success_while_degraded_does_not_lift_the_backoff() {
        let (_clock, health) = health();
        (0..5).for_each(|_| {
            health.record_fault();
        });
        health.record_success();
        assert!(health.is_degraded());
    }
}

//! When a process `dpumesh up` started dies: it is started again after a delay that
//! doubles with each death that came soon after a start, up to a cap; one that keeps
//! dying soon after every start is given up on (reported, left down) while the rest of
//! the mesh serves. A process that ran long enough before it died starts the count
//! afresh, as a Kubernetes `CrashLoopBackOff` resets after a stable run.
//!
//! Pure: the caller passes the time, so the policy is tested without sleeping.

use std::time::{Duration, Instant};

/// How restarts back off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RestartPolicy {
    /// The delay before the first restart.
    pub first: Duration,
    /// The longest delay.
    pub cap: Duration,
    /// A process that ran this long before it died is considered to have been healthy.
    pub stable: Duration,
    /// Deaths in a row, each soon after its start, after which the process stays down.
    pub max_quick_deaths: u32,
}

impl Default for RestartPolicy {
    fn default() -> Self {
        Self {
            // A killed process is back within a fraction of a second; a crash loop
            // waits 0.1 + 0.2 + 0.4 + 0.8 + 1.6 s over five tries, then stops.
            first: Duration::from_millis(100),
            cap: Duration::from_secs(5),
            stable: Duration::from_secs(10),
            max_quick_deaths: 5,
        }
    }
}

/// What to do about a death.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Start it again at this time.
    RestartAt(Instant),
    /// Leave it down: it died this many times in a row soon after starting.
    GiveUp { quick_deaths: u32 },
}

/// One process's restart history.
#[derive(Debug, Clone)]
pub struct Restarts {
    policy: RestartPolicy,
    started: Instant,
    quick_deaths: u32,
    restarts: u32,
}

impl Restarts {
    /// A process started at `now`.
    pub fn new(policy: RestartPolicy, now: Instant) -> Self {
        Self {
            policy,
            started: now,
            quick_deaths: 0,
            restarts: 0,
        }
    }

    /// It was started again at `now`.
    pub fn restarted(&mut self, now: Instant) {
        self.started = now;
        self.restarts += 1;
    }

    /// Times it was started again.
    pub fn count(&self) -> u32 {
        self.restarts
    }

    /// It died at `now`: when to start it again, or whether to stop trying.
    pub fn died(&mut self, now: Instant) -> Verdict {
        if now.saturating_duration_since(self.started) >= self.policy.stable {
            self.quick_deaths = 0;
        }
        self.quick_deaths += 1;
        if self.quick_deaths > self.policy.max_quick_deaths {
            return Verdict::GiveUp {
                quick_deaths: self.quick_deaths - 1,
            };
        }
        let doublings = (self.quick_deaths - 1).min(16);
        let delay = self
            .policy
            .first
            .saturating_mul(1 << doublings)
            .min(self.policy.cap);
        Verdict::RestartAt(now + delay)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn a_killed_process_comes_back_after_the_first_delay() {
        let t0 = Instant::now();
        let mut r = Restarts::new(RestartPolicy::default(), t0);
        let died = t0 + Duration::from_secs(60);
        assert_eq!(r.died(died), Verdict::RestartAt(died + ms(100)));
    }

    #[test]
    fn quick_deaths_double_the_delay_up_to_the_cap_then_give_up() {
        let policy = RestartPolicy {
            first: ms(100),
            cap: ms(500),
            stable: Duration::from_secs(10),
            max_quick_deaths: 5,
        };
        let mut now = Instant::now();
        let mut r = Restarts::new(policy, now);
        let mut delays = Vec::new();
        for _ in 0..5 {
            now += ms(50);
            match r.died(now) {
                Verdict::RestartAt(at) => {
                    delays.push(at - now);
                    now = at;
                    r.restarted(now);
                }
                Verdict::GiveUp { .. } => panic!("gave up too early"),
            }
        }
        assert_eq!(delays, [ms(100), ms(200), ms(400), ms(500), ms(500)]);
        assert_eq!(r.count(), 5);
        now += ms(50);
        assert_eq!(r.died(now), Verdict::GiveUp { quick_deaths: 5 });
    }

    #[test]
    fn a_stable_run_resets_the_count() {
        let policy = RestartPolicy::default();
        let mut now = Instant::now();
        let mut r = Restarts::new(policy, now);
        for _ in 0..4 {
            now += ms(10);
            let Verdict::RestartAt(at) = r.died(now) else {
                panic!("gave up")
            };
            now = at;
            r.restarted(now);
        }
        // It then served for a minute: the next death is a first one again.
        now += Duration::from_secs(60);
        assert_eq!(r.died(now), Verdict::RestartAt(now + ms(100)));
    }
}

//! CPU-time deadlines for filter calls.
//!
//! The epoch ticker advances on wall-clock time, so a call preempted for a few
//! milliseconds on a busy machine would run past a wall-clock deadline through no fault
//! of its own. Here the epoch only says *when to look*: the check compares the worker
//! thread's CPU time with the budget and lets a call that has not used it go on.
//!
//! Reading a thread's CPU time is a system call, so a call is never charged one
//! up front: the first check comes after an eighth of the budget in wall time (every
//! well-behaved call is long done by then) and takes a baseline; from there the call
//! is stopped once it has used the whole budget in CPU time *after* the baseline,
//! looked at again when the rest of the budget could be used up, and every tick for
//! the last one. A call is never stopped before it used its budget, and an endless
//! loop that runs unhindered is stopped after its budget, a quarter of it more (the
//! second look, below) and one to two ticks (the eighth before the baseline, the
//! budget after it, the last tick), within the 2× the issue allows; an epoch ticker
//! delayed by a loaded machine adds its delay (up to ~3× seen under two CPU-burning
//! threads).
//!
//! A call found past its budget is stopped only once it has computed a quarter of
//! the budget more. On a virtual machine whose kernel does not account steal time,
//! time the hypervisor took the vCPU away counts as CPU time of the thread it was
//! running: measured here, a plain 1 ms loop showed 5–12 ms of thread CPU time once
//! in a few hundred runs, with or without other load (its wall time, to the
//! microsecond). Such a call, once its vCPU is back, finishes its real work well
//! within the quarter; a call that is really busy computes it and is stopped.
//!
//! A wall-clock backstop stands behind the CPU budget: a call that has been running
//! for [`BACKSTOP_MULTIPLE`] times its budget in wall time (at least
//! [`BACKSTOP_FLOOR`]) is stopped whatever CPU it used, and said to have stalled. A
//! filter has no sleeping import (its clock subscriptions are ready at once), so what
//! this stops is a call that keeps its thread without computing: a thread serving
//! many requests is never held by one of them. The wall time is counted in the epoch
//! ticks the call waited (no clock is read for it), which a delayed ticker only
//! lengthens: the backstop can come late, never early.

use std::time::Duration;

/// Most ticks between two looks at a running call: half of what parks the ticker.
/// The ticker parks after [`crate::epoch::PARK_AFTER`] ticks without a *new* call, so
/// one long call (a deadline past that, an endless loop) must say it is still running,
/// or the epoch stops advancing under it and its deadline never comes (an endless loop
/// under a 200 ms deadline ran for two minutes, advanced only by the parked ticker's
/// once-a-second sweep).
pub(crate) const MAX_TICKS_BETWEEN_CHECKS: u64 = crate::epoch::PARK_AFTER as u64 / 2;

/// A call stalls after this many times its CPU budget in wall time.
pub const BACKSTOP_MULTIPLE: u32 = 10;
/// ... and never before this much wall time: a loaded machine may keep a thread off
/// the CPU for tens of milliseconds, which is the machine's doing, not the filter's.
pub const BACKSTOP_FLOOR: Duration = Duration::from_millis(250);

/// What the epoch callback tells wasmtime.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Check {
    /// Look again after this many ticks.
    Continue(u64),
    /// The call used its budget: interrupt it.
    Exhausted,
    /// The call has held its thread past the wall-clock backstop: interrupt it.
    Stalled,
}

/// One store's budget for the call it is running.
#[derive(Debug, Clone)]
pub(crate) struct CpuBudget {
    budget: Duration,
    tick: Duration,
    /// The thread's CPU time at the first check of this call.
    baseline: Option<Duration>,
    /// Epoch ticks the call has waited so far (its wall time, as the ticker counts).
    waited: u64,
    /// Ticks after which it has stalled.
    backstop: u64,
    /// The last check found it stalled (for telling that fault from the budget's).
    stalled: bool,
    /// The thread's CPU time when the budget was first found used up: the call is
    /// stopped once it computed a quarter of the budget more.
    used_up_at: Option<Duration>,
}

/// Whole ticks covering `d`, at least one.
fn ticks_for(d: Duration, tick: Duration) -> u64 {
    let tick = tick.as_nanos().max(1);
    (d.as_nanos().div_ceil(tick) as u64).max(1)
}

impl CpuBudget {
    pub(crate) fn new(tick: Duration) -> Self {
        Self {
            budget: Duration::ZERO,
            tick,
            baseline: None,
            waited: 0,
            backstop: 0,
            stalled: false,
            used_up_at: None,
        }
    }

    /// A call with `budget` is starting: the epoch ticks until its first check (an
    /// eighth of the budget; the tick under way counts, so it may come sooner), at most
    /// `max` ticks.
    pub(crate) fn arm(&mut self, budget: Duration, max: u64) -> u64 {
        self.budget = budget;
        self.baseline = None;
        self.stalled = false;
        self.used_up_at = None;
        self.backstop = ticks_for((budget * BACKSTOP_MULTIPLE).max(BACKSTOP_FLOOR), self.tick);
        self.waited = ticks_for(budget / 8, self.tick).min(max);
        self.waited
    }

    /// The epoch reached the call's deadline; `cpu` is the thread's CPU time now. A
    /// call goes on for at most `max` more ticks before it is looked at again.
    pub(crate) fn check(&mut self, cpu: Duration, max: u64) -> Check {
        if self.waited >= self.backstop {
            self.stalled = true;
            return Check::Stalled;
        }
        let ticks = match self.baseline {
            None => {
                self.baseline = Some(cpu);
                // CPU time grows no faster than wall time: the budget cannot run out
                // sooner than a whole budget from now.
                ticks_for(self.budget, self.tick)
            }
            Some(baseline) => {
                let used = cpu.saturating_sub(baseline);
                if used >= self.budget {
                    let grace = self.budget / 4;
                    let at = *self.used_up_at.get_or_insert(cpu);
                    let more = cpu.saturating_sub(at);
                    if more >= grace {
                        // Still computing well after: really busy.
                        return Check::Exhausted;
                    }
                    // Looked at again when the rest of the grace could be used up.
                    ((grace - more).as_nanos() / self.tick.as_nanos().max(1)).max(1) as u64
                } else {
                    // Whole ticks that cannot use up the rest (the tick under way may
                    // be nearly over), at least the next tick.
                    let left = self.budget - used;
                    (left.as_nanos() / self.tick.as_nanos().max(1)).max(1) as u64
                }
            }
        };
        // Looked at again by the backstop at the latest.
        let ticks = ticks.min(max).min(self.backstop - self.waited).max(1);
        self.waited += ticks;
        Check::Continue(ticks)
    }

    /// Whether the call was stopped by the wall-clock backstop (not its CPU budget).
    pub(crate) fn stalled(&self) -> bool {
        self.stalled
    }

    /// The wall-clock backstop of the call under way.
    pub(crate) fn backstop(&self) -> Duration {
        (self.budget * BACKSTOP_MULTIPLE).max(BACKSTOP_FLOOR)
    }
}

/// The calling thread's CPU time (a system call: only checks make it).
pub(crate) fn thread_cpu_time() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);
    const MAX: u64 = 50;

    #[test]
    fn a_preempted_call_goes_on_and_a_busy_one_is_stopped_once_its_budget_is_used() {
        let mut b = CpuBudget::new(MS);
        assert_eq!(
            b.arm(5 * MS, MAX),
            1,
            "first look after an eighth of 5 ms: the next tick"
        );
        assert_eq!(b.arm(40 * MS, MAX), 5);
        assert_eq!(b.arm(5 * MS, MAX), 1);
        // Preempted: no CPU spent at the first look or after.
        assert_eq!(b.check(Duration::from_millis(100), MAX), Check::Continue(5));
        assert_eq!(b.check(Duration::from_millis(100), MAX), Check::Continue(5));
        // Now running: 2.5 ms used since the baseline, 2.5 ms left: two whole ticks.
        assert_eq!(
            b.check(Duration::from_micros(102_500), MAX),
            Check::Continue(2)
        );
        // The last tick: looked at every tick.
        assert_eq!(
            b.check(Duration::from_micros(104_600), MAX),
            Check::Continue(1)
        );
        // Used up: stopped once it computed a quarter of the budget more (1.25 ms:
        // looked at after the whole tick that cannot use it up, then each tick).
        assert_eq!(b.check(Duration::from_millis(105), MAX), Check::Continue(1));
        assert_eq!(
            b.check(Duration::from_micros(106_000), MAX),
            Check::Continue(1)
        );
        assert_eq!(
            b.check(Duration::from_micros(106_250), MAX),
            Check::Exhausted
        );
    }

    #[test]
    fn a_call_whose_cpu_time_jumped_while_its_vcpu_was_away_must_compute_more_to_stop() {
        // A hypervisor that takes the vCPU for 8 ms makes a 1 ms call look as if it
        // had used 8 ms of CPU. Found used up, it goes on; a call that finished is
        // never looked at again, and one that keeps its thread without computing is
        // not stopped for it.
        let mut b = CpuBudget::new(MS);
        b.arm(5 * MS, MAX);
        assert_eq!(b.check(Duration::from_millis(10), MAX), Check::Continue(5));
        assert_eq!(b.check(Duration::from_millis(18), MAX), Check::Continue(1));
        for _ in 0..10 {
            assert_eq!(
                b.check(Duration::from_micros(18_300), MAX),
                Check::Continue(1)
            );
        }
        // Computing the grace (1.25 ms) after it: stopped.
        assert_eq!(
            b.check(Duration::from_micros(19_250), MAX),
            Check::Exhausted
        );
        // The next call starts afresh.
        b.arm(5 * MS, MAX);
        b.check(Duration::from_millis(20), MAX);
        assert_eq!(b.check(Duration::from_millis(26), MAX), Check::Continue(1));
    }

    #[test]
    fn each_call_starts_from_a_fresh_baseline() {
        let mut b = CpuBudget::new(MS);
        b.arm(4 * MS, MAX);
        b.check(Duration::from_millis(10), MAX);
        assert_eq!(b.check(Duration::from_millis(13), MAX), Check::Continue(1));
        assert_eq!(b.arm(4 * MS, MAX), 1);
        assert_eq!(b.check(Duration::from_millis(13), MAX), Check::Continue(4));
        assert_eq!(b.check(Duration::from_millis(15), MAX), Check::Continue(2));
    }

    #[test]
    fn a_call_that_holds_its_thread_without_computing_stalls_at_the_backstop() {
        // 5 ms of CPU: the backstop is the floor, 250 ms of wall time (250 ticks).
        let mut b = CpuBudget::new(MS);
        assert_eq!(b.arm(5 * MS, MAX), 1);
        let mut waited = 1;
        // The thread's CPU time never moves: every look lets it go on...
        loop {
            match b.check(Duration::from_millis(7), MAX) {
                Check::Continue(ticks) => {
                    assert!(ticks <= MAX);
                    waited += ticks;
                }
                Check::Stalled => break,
                Check::Exhausted => panic!("no CPU was used"),
            }
        }
        // ...until it has waited exactly the backstop, looked at no later than that.
        assert_eq!(waited, 250);
        assert!(b.stalled());
        assert_eq!(b.backstop(), Duration::from_millis(250));
        // A new call starts afresh; 100 ms of budget stalls at 1 s.
        assert_eq!(b.arm(100 * MS, MAX), 13);
        assert!(!b.stalled());
        assert_eq!(b.backstop(), Duration::from_secs(1));
        // A busy call still ends at its budget (and a quarter), long before.
        assert_eq!(b.check(Duration::ZERO, MAX), Check::Continue(50));
        assert_eq!(
            b.check(Duration::from_millis(100), MAX),
            Check::Continue(25)
        );
        assert_eq!(b.check(Duration::from_millis(125), MAX), Check::Exhausted);
        assert!(!b.stalled());
    }

    #[test]
    fn the_thread_cpu_clock_counts_work_not_sleep() {
        let start = thread_cpu_time();
        std::thread::sleep(Duration::from_millis(30));
        let slept = thread_cpu_time() - start;
        assert!(slept < Duration::from_millis(15), "sleeping used {slept:?}");
        // Busy for 20 ms of wall time: most of it is CPU time of this thread.
        let (start, wall) = (thread_cpu_time(), std::time::Instant::now());
        let mut n = 0u64;
        while wall.elapsed() < Duration::from_millis(20) {
            n = std::hint::black_box(n + 1);
        }
        let busy = thread_cpu_time() - start;
        assert!(
            busy >= Duration::from_millis(2),
            "working used only {busy:?}"
        );
        let passed = wall.elapsed() + Duration::from_millis(1);
        assert!(busy <= passed, "more CPU than time passed: {busy:?}");
    }
}

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
//! loop that runs unhindered is stopped after its budget plus one to two ticks (the
//! eighth before the baseline, the budget after it, the last tick), within the 2× the
//! issue allows (7–8 ms for 5 ms measured); an epoch ticker delayed by a loaded
//! machine adds its delay (up to ~3× seen under two CPU-burning threads).

use std::time::Duration;

/// What the epoch callback tells wasmtime.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Check {
    /// Look again after this many ticks.
    Continue(u64),
    /// The call used its budget: interrupt it.
    Exhausted,
}

/// One store's budget for the call it is running.
#[derive(Debug, Clone)]
pub(crate) struct CpuBudget {
    budget: Duration,
    tick: Duration,
    /// The thread's CPU time at the first check of this call.
    baseline: Option<Duration>,
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
        }
    }

    /// A call with `budget` is starting: the epoch ticks until its first check (an
    /// eighth of the budget; the tick under way counts, so it may come sooner).
    pub(crate) fn arm(&mut self, budget: Duration) -> u64 {
        self.budget = budget;
        self.baseline = None;
        ticks_for(budget / 8, self.tick)
    }

    /// The epoch reached the call's deadline; `cpu` is the thread's CPU time now.
    pub(crate) fn check(&mut self, cpu: Duration) -> Check {
        let Some(baseline) = self.baseline else {
            self.baseline = Some(cpu);
            // CPU time grows no faster than wall time: the budget cannot run out
            // sooner than a whole budget from now.
            return Check::Continue(ticks_for(self.budget, self.tick));
        };
        let used = cpu.saturating_sub(baseline);
        if used >= self.budget {
            Check::Exhausted
        } else {
            // Whole ticks that cannot use up the rest (the tick under way may be
            // nearly over), at least the next tick.
            let left = self.budget - used;
            Check::Continue((left.as_nanos() / self.tick.as_nanos().max(1)).max(1) as u64)
        }
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

    #[test]
    fn a_preempted_call_goes_on_and_a_busy_one_is_stopped_once_its_budget_is_used() {
        let mut b = CpuBudget::new(MS);
        assert_eq!(
            b.arm(5 * MS),
            1,
            "first look after an eighth of 5 ms: the next tick"
        );
        assert_eq!(b.arm(40 * MS), 5);
        assert_eq!(b.arm(5 * MS), 1);
        // Preempted: no CPU spent at the first look or after.
        assert_eq!(b.check(Duration::from_millis(100)), Check::Continue(5));
        assert_eq!(b.check(Duration::from_millis(100)), Check::Continue(5));
        // Now running: 2.5 ms used since the baseline, 2.5 ms left: two whole ticks.
        assert_eq!(b.check(Duration::from_micros(102_500)), Check::Continue(2));
        // The last tick: looked at every tick.
        assert_eq!(b.check(Duration::from_micros(104_600)), Check::Continue(1));
        assert_eq!(b.check(Duration::from_millis(105)), Check::Exhausted);
    }

    #[test]
    fn each_call_starts_from_a_fresh_baseline() {
        let mut b = CpuBudget::new(MS);
        b.arm(4 * MS);
        b.check(Duration::from_millis(10));
        assert_eq!(b.check(Duration::from_millis(13)), Check::Continue(1));
        assert_eq!(b.arm(4 * MS), 1);
        assert_eq!(b.check(Duration::from_millis(13)), Check::Continue(4));
        assert_eq!(b.check(Duration::from_millis(15)), Check::Continue(2));
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

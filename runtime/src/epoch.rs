//! The epoch ticker: advances the engine's epoch every tick while filters run, so
//! CPU deadlines hold, and sweeps expired shared-state entries about once a second.
//!
//! An idle proxy must not pay a thousand wake-ups a second for deadlines nobody is
//! running against: after [`PARK_AFTER`] ticks without a guest call the ticker parks
//! (waking once a second for the sweep), and the next call wakes it. A call started
//! while it parks sets its deadline from an epoch that resumes advancing as soon as the
//! ticker runs again, microseconds later; a deadline is counted in whole ticks with one
//! to spare, so the lost part of a tick does not matter.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

use dpumesh_shared_state::SharedState;
use wasmtime::Engine;

/// Ticks without a guest call before the ticker parks.
pub(crate) const PARK_AFTER: u32 = 100;

/// How often a parked ticker still sweeps shared state.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// The ticker's shared side: callers say when guest code is about to run.
#[derive(Debug, Default)]
pub(crate) struct Epoch {
    /// Guest calls begun (only compared for change).
    calls: AtomicU64,
    /// The ticker is parked (or about to): a call must wake it.
    parked: AtomicBool,
    stop: AtomicBool,
    thread: OnceLock<Thread>,
    /// Times the ticker parked (tests read it).
    parks: AtomicU64,
}

impl Epoch {
    /// Guest code is about to run on some store of this engine: the epoch must advance.
    pub fn call_begins(&self) {
        // SeqCst pairs with the ticker's: either it sees this call before it parks,
        // or this sees it parked and wakes it.
        self.calls.fetch_add(1, Ordering::SeqCst);
        if self.parked.load(Ordering::SeqCst)
            && self.parked.swap(false, Ordering::SeqCst)
            && let Some(t) = self.thread.get()
        {
            t.unpark();
        }
    }

    /// Whether the ticker is parked now.
    #[cfg(test)]
    pub fn is_parked(&self) -> bool {
        self.parked.load(Ordering::SeqCst)
    }

    /// How many times the ticker parked so far.
    #[cfg(test)]
    pub fn parks(&self) -> u64 {
        self.parks.load(Ordering::SeqCst)
    }

    /// Stops the ticker (it finishes its current tick).
    pub fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.get() {
            t.unpark();
        }
    }
}

/// Starts the ticker thread for `engine`.
pub(crate) fn spawn(
    engine: Engine,
    state: Arc<SharedState>,
    tick: Duration,
) -> std::io::Result<(Arc<Epoch>, JoinHandle<()>)> {
    let epoch = Arc::new(Epoch::default());
    let shared = epoch.clone();
    let handle = std::thread::Builder::new()
        .name("dpumesh-epoch".to_owned())
        .spawn(move || run(&shared, &engine, &state, tick))?;
    let _ = epoch.thread.set(handle.thread().clone());
    Ok((epoch, handle))
}

fn run(epoch: &Epoch, engine: &Engine, state: &SharedState, tick: Duration) {
    let mut last_sweep = Instant::now();
    let mut seen = epoch.calls.load(Ordering::SeqCst);
    let mut quiet = 0u32;
    while !epoch.stop.load(Ordering::SeqCst) {
        if quiet >= PARK_AFTER {
            epoch.parked.store(true, Ordering::SeqCst);
            // A call that began before the flag was up is seen here; one after it
            // sees the flag and unparks this thread.
            if epoch.calls.load(Ordering::SeqCst) == seen {
                epoch.parks.fetch_add(1, Ordering::SeqCst);
                std::thread::park_timeout(SWEEP_EVERY);
            }
            epoch.parked.store(false, Ordering::SeqCst);
        } else {
            std::thread::sleep(tick);
        }
        engine.increment_epoch();
        let calls = epoch.calls.load(Ordering::SeqCst);
        if calls == seen {
            // Stays parked through a sweep-only wake-up.
            quiet = quiet.saturating_add(1);
        } else {
            seen = calls;
            quiet = 0;
        }
        if last_sweep.elapsed() >= SWEEP_EVERY {
            state.sweep_expired();
            last_sweep = Instant::now();
        }
    }
}

#[cfg(test)]
mod tests {
    use dpumesh_clock::SystemClock;
    use dpumesh_shared_state::StateLimits;

    use super::*;

    fn wait_for(what: &str, ok: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !ok() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn an_idle_ticker_parks_and_the_next_call_wakes_it() {
        let mut config = wasmtime::Config::new();
        config.epoch_interruption(true);
        let engine = Engine::new(&config).unwrap();
        let clock = SystemClock::shared();
        let state = SharedState::new(clock, StateLimits::default());
        let (epoch, handle) = spawn(engine, state, Duration::from_millis(1)).unwrap();
        // The flag goes up just before the count (it means "parked or about to"): wait
        // for the count, which a slow machine (qemu) can show a moment later.
        wait_for("the first park", || epoch.parks() == 1);
        epoch.call_begins();
        assert!(!epoch.is_parked(), "a call wakes it at once");
        // Busy: calls keep it ticking; idle again: it parks again.
        for _ in 0..20 {
            epoch.call_begins();
            std::thread::sleep(Duration::from_millis(2));
        }
        wait_for("the second park", || epoch.parks() == 2);
        epoch.stop();
        dpumesh_test_support::joined(handle);
    }
}

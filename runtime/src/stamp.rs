//! Time stamps for the chain's per-filter timings.
//!
//! The chain stamps the time at every filter it enters (one read per filter per
//! request, the per-filter histograms' durations are the differences), so the read
//! itself is on the request path. These come from the CPU's counter (TSC on x86-64,
//! the virtual counter on Arm64), scaled by a calibration made once per process,
//! instead of `clock_gettime`: 9 ns against 23 ns a read on the development machine
//! (docs/benchmarks.md). Only durations between two stamps of one thread are taken
//! from them; nothing compares them with another clock, and the policy logic that
//! depends on time keeps reading the injected `dpumesh_clock::Clock`.

/// A point in time on the counter.
pub(crate) type Stamp = quanta::Instant;

/// Now.
pub(crate) fn now() -> Stamp {
    quanta::Instant::now()
}

/// Calibrates the counter (about 0.6 ms, once per process) so that the first request
/// does not pay for it.
pub(crate) fn calibrate() {
    let _ = now();
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn stamps_measure_what_the_system_clock_measures() {
        let (a, started) = (now(), Instant::now());
        std::thread::sleep(Duration::from_millis(20));
        let (stamped, measured) = (now() - a, started.elapsed());
        assert!(stamped >= Duration::from_millis(19), "{stamped:?}");
        let off = stamped.abs_diff(measured);
        assert!(
            off < Duration::from_millis(2),
            "{stamped:?} vs {measured:?}"
        );
    }
}

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
        // Each stamp is bracketed by two system-clock reads, so a thread descheduled
        // between reads widens the bracket instead of failing the test.
        let (s0, a, s1) = (Instant::now(), now(), Instant::now());
        std::thread::sleep(Duration::from_millis(20));
        let (s2, b, s3) = (Instant::now(), now(), Instant::now());
        let stamped = b - a;
        assert!(stamped >= Duration::from_millis(19), "{stamped:?}");
        // Within the brackets, give or take the calibration's error (ppm here; 1 %).
        let (shortest, longest) = (s2 - s1, s3 - s0);
        assert!(
            stamped >= shortest.mul_f64(0.99) && stamped <= longest.mul_f64(1.01),
            "{stamped:?} outside {shortest:?}..{longest:?}"
        );
    }
}

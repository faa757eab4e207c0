//! The process's Prometheus recorder, kept drained.
//!
//! A recorder made with `PrometheusBuilder::build_recorder` keeps every histogram
//! sample it is given, raw, until something drains it: a `/metrics` scrape or
//! `PrometheusHandle::run_upkeep` (the builder's `install` spawns that on a tokio
//! runtime; ours are installed by hand, so nothing did). A node nobody scraped grew
//! by about 4 MB a second at 50k requests a second (its per-filter and per-request
//! timings, measured with `bench/mesh.sh`'s load: docs/mesh.md), and every sample cost
//! an allocation. [`install`] drains it every [`UPKEEP_EVERY`] from a thread of its
//! own, as the builder's `install` would on a tokio runtime.

#![forbid(unsafe_code)]

use std::time::Duration;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// How often the histograms are drained: a second's samples at most are held (about
/// 4 MB at 50k requests a second; the builder's own default, 5 s, held 38 MB in that
/// bench), for one wake-up a second of an idle process.
pub const UPKEEP_EVERY: Duration = Duration::from_secs(1);

/// Installs `builder`'s recorder as the process's global recorder and keeps it
/// drained every `every`; returns the handle that renders `/metrics`.
///
/// When another recorder is already installed (an embedding program, or a test that
/// runs several parts in one process) that one keeps recording, the handle renders
/// nothing this process records, and no thread is started.
pub fn install(builder: PrometheusBuilder, every: Duration) -> PrometheusHandle {
    let recorder = builder.build_recorder();
    let handle = recorder.handle();
    if metrics::set_global_recorder(recorder).is_ok() {
        keep_drained(handle.clone(), every);
    }
    handle
}

/// Runs `handle`'s upkeep every `every` from a thread named `dpumesh-metrics`, for
/// the life of the process (the recorder is global and lives as long).
fn keep_drained(handle: PrometheusHandle, every: Duration) {
    let started = std::thread::Builder::new()
        .name("dpumesh-metrics".to_owned())
        .spawn(move || {
            loop {
                std::thread::sleep(every);
                handle.run_upkeep();
            }
        });
    if let Err(e) = started {
        // Scrapes still drain it; only a process nobody scrapes grows.
        tracing::warn!(error = %e, "cannot start the metrics upkeep thread; histograms are drained only when /metrics is scraped");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn count_of(rendered: &str, name: &str) -> Option<u64> {
        rendered
            .lines()
            .find(|l| l.starts_with(&format!("{name}_count")))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    }

    #[test]
    fn samples_recorded_across_drains_are_all_counted_and_the_upkeep_thread_runs() {
        let handle = install(PrometheusBuilder::new(), Duration::from_millis(5));
        let histogram = metrics::histogram!("dpumesh_test_seconds");
        for round in 0..4 {
            for _ in 0..1000 {
                histogram.record(0.001);
            }
            // Let the upkeep drain what this round recorded.
            std::thread::sleep(Duration::from_millis(30));
            assert_eq!(
                count_of(&handle.render(), "dpumesh_test_seconds"),
                Some(1000 * (round + 1)),
                "round {round}"
            );
        }
        let threads = std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
            .filter(|name| name.trim() == "dpumesh-metrics")
            .count();
        assert_eq!(threads, 1);
    }
}

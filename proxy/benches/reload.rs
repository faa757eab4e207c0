//! Hot reload and footprint of the proxy, measured in one run:
//!
//! - reload latency: `Policy::reload` publishing a new generation → every worker
//!   switched to it (instances built), idle and under load; compile + configure time
//!   (before the publish) reported apart;
//! - resident memory of the process with 4 filters × 16 workers, against the same
//!   process before the proxy started.
//!
//! `cargo bench -p dpumesh-proxy --bench reload`

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_main};
use dpumesh_proxy::{Options, Policy, Proxy};
use dpumesh_test_artifacts as artifacts;

fn config(dir: &Path, workers: usize, version: usize) -> String {
    format!(
        r#"workers: {workers}
cache_dir: {cache}
filters:
  trace: {{component: {trace}}}
  guard:
    component: {guard}
    config: {{rules: [{{name: v{version}, methods: [DELETE], action: deny}}], default: allow}}
  ratelimit:
    component: {ratelimit}
    config: {{default_bucket: {{max_tokens: 1000000000, fill_interval_ms: 1000}}}}
  breaker:
    component: {breaker}
    config: {{consecutive_failures: 5}}
chains:
  api: [trace, guard, ratelimit, breaker]
services:
  api: {{chain: api}}
routes:
  - {{service: api}}
"#,
        cache = dir.join("cache").display(),
        trace = artifacts::FILTER_TRACE,
        guard = artifacts::SAMPLE_GUARD,
        ratelimit = artifacts::FILTER_RATELIMIT,
        breaker = artifacts::FILTER_CIRCUIT_BREAKER,
    )
}

fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Reloads and waits until every worker runs the new generation; returns (build,
/// publish → all switched).
fn reload_and_settle(
    policy: &Policy,
    dir: &Path,
    workers: usize,
    version: usize,
) -> (Duration, Duration) {
    std::fs::write(dir.join("proxy.yaml"), config(dir, workers, version)).unwrap();
    let started = Instant::now();
    let done = policy.reload().expect("reload");
    while !policy.settled() {
        std::hint::spin_loop();
    }
    (done.build, started.elapsed() - done.build)
}

fn reload(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("proxy.yaml");

    // Footprint first, before anything else grows the heap.
    let before = rss_kib();
    std::fs::write(&file, config(dir.path(), 16, 0)).unwrap();
    let started = Instant::now();
    let proxy = Proxy::start(&file, Options { watch: None }).unwrap();
    let start_time = started.elapsed();
    let after = rss_kib();
    println!(
        "first start, empty compile cache (compile 4 components, configure, 64 instances): {start_time:?}"
    );
    println!(
        "resident memory, 4 filters x 16 workers: process {:.1} MiB (before the proxy started: {:.1} MiB; the proxy's share {:.1} MiB)",
        after as f64 / 1024.0,
        before as f64 / 1024.0,
        (after - before) as f64 / 1024.0
    );
    let policy = proxy.policy().clone();
    drop(proxy);

    let mut version = 1;
    let mut builds = Vec::new();
    // Times publish -> all switched over `iters` reloads; build times go to `builds`.
    let mut reloads = |iters: u64| {
        let mut total = Duration::ZERO;
        for _ in 0..iters {
            version += 1;
            let (build, switch) = reload_and_settle(&policy, dir.path(), 16, version);
            builds.push(build);
            total += switch;
        }
        total
    };
    let mut group = c.benchmark_group("reload");
    group
        .sample_size(20)
        .measurement_time(Duration::from_secs(10));
    group.bench_function("publish_to_all_16_workers_switched_idle", |b| {
        b.iter_custom(&mut reloads)
    });

    // Under load: two threads keep submitting requests to the pool meanwhile.
    let stop = Arc::new(AtomicBool::new(false));
    let load: Vec<_> = (0..2)
        .map(|_| {
            let (policy, stop) = (policy.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut served = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let mut head = dpumesh_runtime::RequestHead::new("GET", "/items");
                    head.authority = "api.test".to_owned();
                    if policy.pool().on_request(0, head).is_ok() {
                        served += 1;
                    }
                }
                served
            })
        })
        .collect();
    group.bench_function("publish_to_all_16_workers_switched_under_load", |b| {
        b.iter_custom(&mut reloads)
    });
    group.finish();
    stop.store(true, Ordering::Relaxed);
    let served: u64 = load.into_iter().map(|t| t.join().unwrap()).sum();
    builds.sort();
    println!(
        "reload build (read, compile from cache, configure 4 filters) before each publish: median {:?} over {} reloads; {served} requests served meanwhile",
        builds[builds.len() / 2],
        builds.len()
    );
    drop(policy);
}

#[allow(missing_docs, reason = "criterion-generated")]
mod group {
    use super::reload;
    criterion::criterion_group!(benches, reload);
}
criterion_main!(group::benches);

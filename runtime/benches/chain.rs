//! On-request through chains of 1 and 4 small filters, as Wasm components and as the
//! same Rust compiled natively (the baseline, measured in the same run), and instance
//! creation from the pooling allocator.
//!
//! `cargo bench -p dpumesh-runtime --bench chain`

use std::sync::Arc;
use std::time::Duration;

use criterion::{Criterion, criterion_main};
use dpumesh_filter_sdk::mock::{MockProxy, MockRequest};
use dpumesh_runtime::{
    ChainRunner, FilterChain, FilterSettings, RequestHead, Runtime, RuntimeConfig,
};
use dpumesh_sample_guard::Guard;
use dpumesh_test_artifacts as artifacts;

/// Four rules: the request below matches the third, so every rule is evaluated as in a
/// typical allow-list.
const GUARD: &str = r#"{"rules": [
  {"name": "health", "path_prefix": "/healthz", "action": "allow"},
  {"name": "admin-other", "path_prefix": "/admin", "methods": ["DELETE"], "action": "deny"},
  {"name": "api", "path_prefix": "/api", "header": {"name": "x-tenant"}, "action": "allow"},
  {"name": "rest", "action": "deny"}
]}"#;

fn request() -> RequestHead {
    let mut head = RequestHead::new("GET", "/api/v1/items?page=2");
    head.authority = "api.example.com".to_owned();
    for (n, v) in [
        ("user-agent", "wrk"),
        ("accept", "*/*"),
        ("x-tenant", "acme"),
        ("authorization", "Bearer abc.def.ghi"),
        ("x-request-id", "7b0e4c6a-1d3c-4c43-9d7e-6c1f5d1b2a90"),
    ] {
        head.append_received(n, v).unwrap();
    }
    head
}

fn runtime() -> Runtime {
    Runtime::new(RuntimeConfig {
        max_instances: 64,
        ..RuntimeConfig::default()
    })
    .unwrap()
}

fn chains(c: &mut Criterion) {
    let rt = runtime();
    let bytes = artifacts::read(artifacts::SAMPLE_GUARD);
    let guard = |i: usize| {
        rt.load_filter(
            FilterSettings::new(format!("guard{i}"), GUARD).deadline(Duration::from_secs(1)),
            &bytes,
        )
        .unwrap()
    };
    let template = request();
    let mut group = c.benchmark_group("on_request");
    group
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1));

    for n in [1usize, 4] {
        let host = MockProxy::new().install();
        let mut natives: Vec<Guard> = (0..n).map(|_| host.configure(GUARD).unwrap()).collect();
        group.bench_function(format!("native_guard_x{n}"), |b| {
            b.iter(|| {
                let req = MockRequest::from_head(template.clone());
                for filter in &mut natives {
                    assert!(host.on_request(filter, &req).is_continue());
                }
                req
            })
        });

        let chain = Arc::new(FilterChain::new("bench", (0..n).map(guard).collect()));
        let mut runner = ChainRunner::new(chain);
        group.bench_function(format!("wasm_guard_x{n}"), |b| {
            b.iter(|| {
                let outcome = runner.on_request(template.clone());
                assert!(outcome.decision.reply().is_none());
                outcome
            })
        });
    }

    // The floor: a filter that does nothing, so only the crossing is measured.
    let noop = rt
        .load_filter(
            FilterSettings::new("noop", "{}").deadline(Duration::from_secs(1)),
            &artifacts::read(artifacts::TEST_FILTER),
        )
        .unwrap();
    let mut runner = ChainRunner::new(Arc::new(FilterChain::new("noop", vec![noop])));
    group.bench_function("wasm_noop_x1", |b| {
        b.iter(|| runner.on_request(template.clone()))
    });
    let mut empty = template.clone();
    empty.method.clear();
    empty.authority.clear();
    empty.path.clear();
    empty.scheme.clear();
    group.bench_function("wasm_noop_x1_empty_line", |b| {
        b.iter(|| runner.on_request(empty.clone()))
    });
    group.bench_function("clone_head_only", |b| b.iter(|| template.clone()));
    group.finish();
}

fn instances(c: &mut Criterion) {
    let rt = runtime();
    let guard = rt
        .load_filter(
            FilterSettings::new("guard", GUARD).deadline(Duration::from_secs(1)),
            &artifacts::read(artifacts::SAMPLE_GUARD),
        )
        .unwrap();
    let mut group = c.benchmark_group("instance");
    group
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1));
    // Instantiate from the pool and run configure (what a worker does).
    group.bench_function("guard_instantiate_and_configure", |b| {
        b.iter(|| guard.instantiate().unwrap())
    });
    // The same with a filter whose configure does (almost) nothing: the pool's share.
    let noop = rt
        .load_filter(
            FilterSettings::new("noop", "{}").deadline(Duration::from_secs(1)),
            &artifacts::read(artifacts::TEST_FILTER),
        )
        .unwrap();
    group.bench_function("noop_instantiate_and_configure", |b| {
        b.iter(|| noop.instantiate().unwrap())
    });
    group.finish();
}

/// What one kind of host call costs: a filter making ten of them against the noop
/// filter, in the same run ((t - noop) / 10 per call).
fn host_calls(c: &mut Criterion) {
    let rt = runtime();
    let bytes = artifacts::read(artifacts::TEST_FILTER);
    let ten = |action: &str| format!(r#"{{"request": [{}]}}"#, [action; 10].join(","));
    let cases = [
        ("noop", "{}".to_owned()),
        (
            "header_read_absent_x10",
            ten(r#"{"deny_if_header": ["x-absent", 400]}"#),
        ),
        ("set_header_x10", ten(r#"{"set_header": ["x-a", "1"]}"#)),
        (
            "set_metadata_x10_batched",
            ten(r#"{"set_metadata": ["k", "v"]}"#),
        ),
    ];
    let template = request();
    let mut group = c.benchmark_group("host_call");
    group
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1));
    for (name, config) in cases {
        let filter = rt
            .load_filter(
                FilterSettings::new(name, config).deadline(Duration::from_secs(1)),
                &bytes,
            )
            .unwrap();
        let mut runner = ChainRunner::new(Arc::new(FilterChain::new(name, vec![filter])));
        group.bench_function(name, |b| b.iter(|| runner.on_request(template.clone())));
    }
    group.finish();
}

#[allow(missing_docs, reason = "criterion-generated")]
mod group {
    use super::{chains, host_calls, instances};
    criterion::criterion_group!(benches, chains, instances, host_calls);
}
criterion_main!(group::benches);

//! One header-editing filter per request, as a proxy-wasm plugin (a core module built
//! with the proxy-wasm crate, as for Envoy) and as a WIT component doing the same
//! edit, in the same run: the whole per-request life of each (the request phase, and
//! the response phase that ends a plugin's HTTP context: on_log, on_done,
//! on_delete). (A plugin's request phase alone would leave its contexts open.)
//!
//! `cargo bench -p dpumesh-runtime --bench proxy_wasm`

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_main};
use dpumesh_runtime::{
    ChainRunner, FailureKind, FilterChain, FilterSettings, RequestHead, ResponseInfo, Runtime,
    RuntimeConfig,
};
use dpumesh_test_artifacts as artifacts;

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

fn runner(rt: &Runtime, name: &str, artifact: &str, config: &str) -> ChainRunner {
    let filter = rt
        .load_filter(
            FilterSettings::new(name, config).deadline(Duration::from_secs(1)),
            &artifacts::read(artifact),
        )
        .unwrap();
    ChainRunner::new(Arc::new(FilterChain::new(name, vec![filter])))
}

const INFO: ResponseInfo = ResponseInfo {
    status: 200,
    latency_ns: 1000,
    upstream: None,
    failure: FailureKind::None,
};

/// Request and response phase of one request.
fn lifecycle(runner: &mut ChainRunner, head: RequestHead) -> RequestHead {
    let outcome = runner.on_request(head);
    debug_assert_eq!(outcome.head.header("x-pw").as_deref(), Some("added"));
    runner.on_response(outcome.head, &INFO, outcome.ran).0
}

fn header_edit(c: &mut Criterion) {
    let rt = Runtime::new(RuntimeConfig {
        max_instances: 16,
        ..RuntimeConfig::default()
    })
    .unwrap();
    let mut plugin = runner(
        &rt,
        "plugin",
        artifacts::PROXY_WASM_TEST,
        r#"{"add_header": ["x-pw", "added"], "quiet": true}"#,
    );
    let mut component = runner(
        &rt,
        "component",
        artifacts::TEST_FILTER,
        r#"{"request": [{"set_header": ["x-pw", "added"]}]}"#,
    );
    let template = request();
    for r in [&mut plugin, &mut component] {
        let head = lifecycle(r, template.clone());
        assert_eq!(head.header("x-pw").as_deref(), Some("added"));
    }

    let mut group = c.benchmark_group("header_edit");
    group
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1));
    group.bench_function("proxy_wasm_request_and_response", |b| {
        b.iter(|| lifecycle(&mut plugin, template.clone()))
    });
    group.bench_function("component_request_and_response", |b| {
        b.iter(|| lifecycle(&mut component, template.clone()))
    });
    group.bench_function("clone_head_only", |b| b.iter(|| template.clone()));
    group.finish();

    // Percentiles, the two alternating so that drift of this shared machine hits both.
    let n = 20_000;
    let (mut pw, mut wit) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for _ in 0..n {
        let head = template.clone();
        let t = Instant::now();
        let out = lifecycle(&mut plugin, head);
        pw.push(t.elapsed());
        drop(out);
        let head = template.clone();
        let t = Instant::now();
        let out = lifecycle(&mut component, head);
        wit.push(t.elapsed());
        drop(out);
    }
    pw.sort();
    wit.sort();
    let pct = |s: &[Duration], p: f64| s[((s.len() as f64 * p) as usize).min(s.len() - 1)];
    for (name, s) in [("proxy-wasm", &pw), ("component", &wit)] {
        println!(
            "header_edit {name} per request (request + response phase, one core, head clone excluded): p50 {:?}  p99 {:?}",
            pct(s, 0.5),
            pct(s, 0.99)
        );
    }
    println!(
        "header_edit proxy-wasm/component: p50 {:.2}x  p99 {:.2}x",
        pct(&pw, 0.5).as_secs_f64() / pct(&wit, 0.5).as_secs_f64(),
        pct(&pw, 0.99).as_secs_f64() / pct(&wit, 0.99).as_secs_f64()
    );
}

#[allow(missing_docs, reason = "criterion-generated")]
mod group {
    use super::header_edit;
    criterion::criterion_group!(benches, header_edit);
}
criterion_main!(group::benches);

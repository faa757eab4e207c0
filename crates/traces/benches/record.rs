//! What a sampled span costs the hop that records it, against what it costs to carry
//! its context without a span, in one run:
//!
//! - `context`: a hop's context work on every request while tracing is on (parse the
//!   caller's `traceparent`, a child context, the next hop's header value);
//! - `proxy span`: the DPU proxy's span (eight attributes, five filter events) encoded
//!   and appended to the process's batch;
//! - `server span`: the ingress's or a service's span (four attributes).
//!
//! The exporter's thread posts to a port nobody listens on (its posts fail fast and
//! are counted as dropped); the batch never fills, as it does not under a collector.
//!
//! `cargo bench -p dpumesh-traces --bench record`

use std::hint::black_box;
use std::time::{Duration, SystemTime};

use criterion::{Criterion, criterion_group, criterion_main};
use dpumesh_traces::{Exporter, Settings, SpanHead, SpanKind, TraceContext, Value};

const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
const FILTERS: [&str; 5] = ["trace", "jwt", "rbac", "ratelimit", "breaker"];

fn exporter() -> Exporter {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let authority = closed.local_addr().unwrap().to_string();
    drop(closed);
    Exporter::start(Settings {
        authority,
        path: "/v1/traces".into(),
        ratio: 1.0,
        service: "bench".into(),
    })
    .unwrap()
}

fn record(c: &mut Criterion) {
    let exporter = exporter();
    let parent = TraceContext::parse(PARENT).unwrap();
    c.bench_function("context", |b| {
        b.iter(|| {
            let parent = TraceContext::parse(black_box(PARENT)).unwrap();
            let ctx = dpumesh_traces::context::start(Some(&parent), 1.0);
            black_box(ctx.traceparent_bytes())
        })
    });
    c.bench_function("proxy span", |b| {
        b.iter(|| {
            let ctx = parent.child();
            let end = SystemTime::now();
            let start = end - Duration::from_micros(40);
            let head = SpanHead {
                trace_id: ctx.trace_id,
                span_id: ctx.span_id,
                parent: Some(parent.span_id),
                kind: SpanKind::Server,
                start,
                end,
            };
            exporter.record(&head, |w| {
                w.name(format_args!("dpumesh.proxy {} {}", "frontend", "*/ping"))
                    .http_server("GET", "/ping", 200)
                    .attr("http.route", Value::Str("*/ping"))
                    .attr("dpumesh.source", Value::Str("ingress"))
                    .attr("dpumesh.service", Value::Str("frontend"))
                    .attr("dpumesh.failure", Value::Str("none"))
                    .attr("dpumesh.attempts", Value::Int(1));
                let mut at = Duration::ZERO;
                for f in FILTERS {
                    at += Duration::from_micros(1);
                    w.event(
                        format_args!("filter {f}"),
                        at,
                        &[("dpumesh.filter.duration_us", Value::Float(1.25))],
                    );
                }
            });
        })
    });
    c.bench_function("server span", |b| {
        b.iter(|| {
            let ctx = parent.child();
            let start = SystemTime::now();
            exporter.record(&SpanHead::server(&ctx, Some(&parent), start), |w| {
                w.name(format_args!("GET {}", "/ping"))
                    .http_server("GET", "/ping", 200)
                    .attr_fmt(
                        "client.address",
                        format_args!("{}", std::net::Ipv4Addr::LOCALHOST),
                    );
            });
        })
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = record
}
criterion_main!(benches);

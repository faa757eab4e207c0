//! Event loop overhead per egress step and per internal step, and a 3-step graph
//! (call → two calls in parallel → internal merge) end to end over the in-memory
//! transport, each beside a baseline in the same run:
//!
//! - egress: the transport alone (send a request, poll its completion) — what is left
//!   is the loop's bookkeeping (context, registry, graph);
//! - internal: a closure through a plain channel-fed thread and back;
//! - 3-step graph: the same logic as plain async Rust on tokio (`join!` for the
//!   parallel calls, `spawn_blocking` for the merge).
//!
//! `cargo bench -p dpumesh-host --bench event_loop`

use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_main};
use dpumesh_host::memory::{InMemoryTransport, Reply};
use dpumesh_host::{
    Event, EventLoop, ExecutionContext, HttpRequest, HttpResponse, LoopConfig, Tag, Transport,
};

const BATCH: u64 = 1000;

/// Time for `iters` requests from the time of the whole batches that covered them.
fn scale(batches: Duration, iters: u64) -> Duration {
    batches.mul_f64(iters as f64 / (iters.div_ceil(BATCH) * BATCH) as f64)
}

fn transport() -> InMemoryTransport {
    InMemoryTransport::new()
        .without_log()
        .service("a", |_| Reply::After(Duration::ZERO, HttpResponse::ok("a")))
        .service("b", |_| Reply::After(Duration::ZERO, HttpResponse::ok("b")))
        .service("c", |_| Reply::After(Duration::ZERO, HttpResponse::ok("c")))
}

/// Per-request time of `handler` through the loop, `BATCH` requests in flight at once.
fn through_loop(c: &mut Criterion, group: &str, name: &str, handler: fn(&mut ExecutionContext)) {
    let mut el = EventLoop::new(transport(), handler, LoopConfig::default()).unwrap();
    c.benchmark_group(group).bench_function(name, |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters.div_ceil(BATCH) {
                for _ in 0..BATCH {
                    el.transport().inject(HttpRequest::get("/"));
                }
                let started = Instant::now();
                el.run_until_idle().unwrap();
                total += started.elapsed();
                el.transport().take_responses();
            }
            scale(total, iters)
        })
    });
}

fn egress(c: &mut Criterion) {
    through_loop(c, "egress step", "event loop", |ctx| {
        ctx.get("http://a/");
    });
    // Baseline: the transport's own work for one call.
    let mut t = transport();
    let mut out = Vec::new();
    c.benchmark_group("egress step")
        .bench_function("transport alone", |b| {
            b.iter(|| {
                t.send_request(
                    Tag {
                        req_id: 1,
                        step_id: 1,
                    },
                    HttpRequest::get("http://a/"),
                )
                .unwrap();
                out.clear();
                t.poll(None, true, &mut out).unwrap();
                assert!(matches!(out[0], Event::Completion { .. }));
            })
        });
}

fn internal(c: &mut Criterion) {
    through_loop(c, "internal step", "event loop", |ctx| {
        ctx.run_internal(|_| Ok::<_, String>("done"));
    });
    // Baseline: a boxed closure to a worker thread and its result back.
    type Job = Box<dyn FnOnce() -> &'static str + Send>;
    let (jobs, rx) = crossbeam_channel::unbounded::<Job>();
    let (done, results) = crossbeam_channel::unbounded();
    let worker = std::thread::spawn(move || {
        for job in rx {
            let _ = done.send(job());
        }
    });
    c.benchmark_group("internal step")
        .bench_function("channel to a thread and back", |b| {
            b.iter_custom(|iters| {
                let started = Instant::now();
                for _ in 0..iters.div_ceil(BATCH) {
                    for _ in 0..BATCH {
                        jobs.send(Box::new(|| "done")).unwrap();
                    }
                    for _ in 0..BATCH {
                        results.recv().unwrap();
                    }
                }
                scale(started.elapsed(), iters)
            })
        });
    drop(jobs);
    let _ = worker.join();
}

fn three_step(ctx: &mut ExecutionContext) {
    ctx.get("http://a/").id("a");
    ctx.parallel(|ctx| {
        ctx.get("http://b/").id("b");
        ctx.get("http://c/").id("c");
    });
    ctx.run_internal(|i| {
        Ok::<_, String>(format!(
            "{}{}{}",
            i["a"].text(),
            i["b"].text(),
            i["c"].text()
        ))
    })
    .inputs(["a", "b", "c"]);
}

async fn call(name: &'static str) -> HttpResponse {
    // The in-memory services answer at once; an async call that is ready at once.
    tokio::task::yield_now().await;
    HttpResponse::ok(name)
}

async fn three_step_async() -> String {
    let a = call("a").await;
    let (b, c) = tokio::join!(call("b"), call("c"));
    tokio::task::spawn_blocking(move || format!("{}{}{}", a.text(), b.text(), c.text()))
        .await
        .unwrap()
}

fn graph(c: &mut Criterion) {
    through_loop(
        c,
        "3-step graph",
        "event loop (in-memory transport)",
        three_step,
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .max_blocking_threads(2)
        .build()
        .unwrap();
    c.benchmark_group("3-step graph")
        .bench_function("plain async Rust (tokio)", |b| {
            b.iter_custom(|iters| {
                let started = Instant::now();
                rt.block_on(async {
                    for _ in 0..iters.div_ceil(BATCH) {
                        let handles: Vec<_> = (0..BATCH)
                            .map(|_| tokio::spawn(three_step_async()))
                            .collect();
                        for h in handles {
                            assert_eq!(h.await.unwrap(), "abc");
                        }
                    }
                });
                scale(started.elapsed(), iters)
            })
        });
}

#[allow(missing_docs, reason = "criterion-generated")]
mod harness {
    use super::*;
    criterion::criterion_group! {
        name = benches;
        config = Criterion::default().sample_size(20).measurement_time(Duration::from_secs(3));
        targets = egress, internal, graph
    }
}
criterion_main!(harness::benches);

//! Seed 000's examples as tests, on the in-memory transport's virtual clock: results
//! are asserted, and so is concurrency (parallel calls overlap: the clock says the
//! block took as long as its slowest member, not the sum).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use dpumesh_host::memory::{InMemoryTransport, Reply};
use dpumesh_host::{
    EgressStep, EventLoop, ExecutionContext, HttpRequest, HttpResponse, InternalStep, order, pipe,
};
use http::Method;

mod common;
use common::ms;

/// Runs one request through a loop over `transport` and returns (virtual time, answer).
fn serve(
    transport: InMemoryTransport,
    handler: impl Fn(&mut ExecutionContext) + Send + Sync + 'static,
) -> (Duration, HttpResponse, EventLoop<InMemoryTransport>) {
    let (at, response, event_loop) = common::serve("/api/v1", transport, handler);
    assert_eq!(
        event_loop.in_flight(),
        (0, 0),
        "the registry is empty again"
    );
    (at, response, event_loop)
}

#[test]
fn basic_parallel_calls_overlap() {
    let transport = InMemoryTransport::new()
        .service("svc-a", |_| Reply::ok_after(10, "from a"))
        .service("svc-b", |_| Reply::ok_after(20, "from b"));
    let (at, response, mut el) = serve(transport, |ctx| {
        ctx.run_internal(|_| Ok::<_, String>("processed"))
            .id("process");
        ctx.parallel(|ctx| {
            ctx.get("http://svc-a/api/v1");
            ctx.get("http://svc-b/api/v1");
        });
    });
    // The block's last member answers; both calls left together after `process`.
    assert_eq!(response.status, 200);
    assert_eq!(response.text(), "from b");
    let sent = el.transport().sent().to_vec();
    assert_eq!(sent.len(), 2);
    assert_eq!(
        sent[0].at, sent[1].at,
        "both calls were sent at the same moment"
    );
    let took = at - sent[0].at;
    assert_eq!(
        took,
        ms(20),
        "parallel: as long as the slowest call (20 ms), not the sum (30 ms)"
    );
}

#[test]
fn data_chaining_passes_results_as_inputs() {
    let transport = InMemoryTransport::new().service("user-service", |r| {
        assert_eq!(r.path_and_query(), "/me");
        Reply::ok_after(10, "alice")
    });
    let (at, response, _) = serve(transport, |ctx| {
        let user = ctx.get("http://user-service/me").id("get_user").step_ref();
        ctx.run_internal(|inputs| Ok::<_, String>(format!("Hello, {}", inputs["get_user"].text())))
            .inputs([&user]);
    });
    assert_eq!(response.text(), "Hello, alice");
    assert!(at >= ms(10), "{at:?}");
}

#[test]
fn a_request_builder_decides_the_call_from_earlier_results() {
    let transport = InMemoryTransport::new()
        .service("config-service", |_| Reply::ok_after(5, "inventory\n"))
        .service("inventory", |r| {
            assert_eq!(r.method, Method::POST);
            assert_eq!(&r.body[..], b"data");
            Reply::ok_after(7, "stored")
        });
    let (at, response, mut el) = serve(transport, |ctx| {
        let config = ctx
            .get("http://config-service/target")
            .id("config_step")
            .step_ref();
        // The URL given here is ignored: the builder's requests are sent.
        ctx.get("dummy")
            .inputs([&config])
            .request_builder(|inputs| {
                let target = inputs["config_step"].text().trim().to_owned();
                vec![HttpRequest::post(format!("http://{target}/api"), "data")]
            });
    });
    assert_eq!(response.text(), "stored");
    assert_eq!(at, ms(12), "one after the other: 5 + 7 ms");
    let hosts: Vec<_> = el
        .transport()
        .sent()
        .iter()
        .map(|s| s.request.host().unwrap())
        .collect();
    assert_eq!(hosts, ["config-service", "inventory"]);
}

#[test]
fn an_empty_request_builder_skips_its_step() {
    let transport = InMemoryTransport::new()
        .service("flags", |_| Reply::ok_after(3, "off"))
        .service("beta", |_| panic!("a skipped step must not call"));
    let (_, response, mut el) = serve(transport, |ctx| {
        let flags = ctx.get("http://flags/beta").id("flags").step_ref();
        let beta = ctx
            .get("http://beta/")
            .id("beta")
            .inputs([&flags])
            .request_builder(|inputs| {
                if inputs["flags"].text() == "on" {
                    vec![HttpRequest::get("http://beta/")]
                } else {
                    vec![]
                }
            })
            .step_ref();
        ctx.respond(|inputs| {
            let beta = &inputs["beta"];
            Ok::<_, String>(format!("beta skipped={} ok={}", beta.skipped, beta.ok))
        })
        .inputs([&beta]);
    });
    assert_eq!(response.text(), "beta skipped=true ok=true");
    assert_eq!(
        el.transport().sent().len(),
        1,
        "only the flag lookup went out"
    );
}

#[test]
fn fan_out_is_sequential_in_a_sequence_and_concurrent_in_a_parallel_block() {
    let service = || {
        InMemoryTransport::new().service("shard", |r| {
            let n: u64 = r.path_and_query().trim_start_matches("/s").parse().unwrap();
            Reply::ok_after(10 * n, format!("shard {n}"))
        })
    };
    let builder = |_: &dpumesh_host::Inputs| {
        (1..=3)
            .map(|n| HttpRequest::get(format!("http://shard/s{n}")))
            .collect()
    };

    let (at, response, _) = serve(service(), move |ctx| {
        ctx.get("x").id("all").request_builder(builder);
        ctx.respond(|inputs| {
            let parts: Vec<_> = inputs["all"].parts.iter().map(|p| p.text()).collect();
            Ok::<_, String>(parts.join(","))
        })
        .inputs(["all"]);
    });
    assert!(
        at >= ms(60),
        "sequential fan-out: 10 + 20 + 30 ms, got {at:?}"
    );
    assert_eq!(response.text(), "shard 1,shard 2,shard 3");

    let (at, response, _) = serve(service(), move |ctx| {
        ctx.parallel(|ctx| {
            ctx.get("x").id("all").request_builder(builder);
        });
        ctx.respond(|inputs| {
            let parts: Vec<_> = inputs["all"].parts.iter().map(|p| p.text()).collect();
            Ok::<_, String>(parts.join(","))
        })
        .inputs(["all"]);
    });
    assert!(
        at >= ms(30) && at < ms(60),
        "concurrent fan-out: the slowest (30 ms), not the sum (60 ms), got {at:?}"
    );
    assert_eq!(
        response.text(),
        "shard 1,shard 2,shard 3",
        "parts in request order"
    );
}

#[test]
fn fan_out_fan_in_with_the_low_level_api() {
    let merges = Arc::new(AtomicUsize::new(0));
    let m = merges.clone();
    let transport = InMemoryTransport::new()
        .service("users", |_| Reply::ok_after(15, "alice"))
        .service("orders", |_| Reply::ok_after(25, "3 orders"));
    let (at, response, el) = serve(transport, move |ctx| {
        let m = m.clone();
        ctx.add(order([
            pipe([
                EgressStep::new("fetch_user", vec![HttpRequest::get("http://users/me")]).into(),
                EgressStep::new("fetch_order", vec![HttpRequest::get("http://orders/mine")]).into(),
            ]),
            InternalStep::new(
                "merge",
                vec!["fetch_user".into(), "fetch_order".into()],
                move |inputs| {
                    m.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, String>(format!(
                        "{} has {}",
                        inputs["fetch_user"].text(),
                        inputs["fetch_order"].text()
                    ))
                },
            )
            .into(),
        ]));
    });
    assert_eq!(response.text(), "alice has 3 orders");
    assert_eq!(merges.load(Ordering::SeqCst), 1);
    // The internal merge adds its real run time (small, but not on a loaded machine):
    // the claim is that the pipe took its slowest member, well under the 40 ms sum.
    assert!(
        at >= ms(25) && at < ms(40),
        "the pipe took its slowest member (25 ms), not the sum (40 ms): {at:?}"
    );
    assert_eq!(el.stats().egress, 2);
    assert_eq!(el.stats().internal, 1);
}

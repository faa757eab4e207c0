//! Failure semantics, timeouts, the step registry, and scale.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use dpumesh_host::memory::{InMemoryTransport, Reply};
use dpumesh_host::{EventLoop, ExecutionContext, HttpRequest, HttpResponse, LoopConfig, Transport};

mod common;
use common::ms;

fn run(
    transport: InMemoryTransport,
    handler: impl Fn(&mut ExecutionContext) + Send + Sync + 'static,
) -> (Duration, HttpResponse, EventLoop<InMemoryTransport>) {
    common::serve("/", transport, handler)
}

/// Whether the answer says the service failed only because a service it called did.
fn blames_a_dependency(response: &HttpResponse) -> bool {
    response
        .headers
        .contains_key(dpumesh_head::DEPENDENCY_FAILED_HEADER)
}

fn failing() -> InMemoryTransport {
    InMemoryTransport::new()
        .service("bad", |_| {
            Reply::After(ms(5), HttpResponse::new(503, "down"))
        })
        .service("good", |_| Reply::ok_after(10, "fine"))
        .service("slow", |_| Reply::ok_after(40, "late but fine"))
}

#[test]
fn a_sequence_stops_at_its_first_failure() {
    let (at, response, mut el) = run(failing(), |ctx| {
        ctx.get("http://bad/").id("first");
        ctx.get("http://good/").id("second");
    });
    assert_eq!(response.status, 502);
    assert_eq!(response.text(), "step \"first\": upstream answered 503\n");
    assert!(blames_a_dependency(&response));
    assert_eq!(at, ms(5));
    let hosts: Vec<_> = el
        .transport()
        .sent()
        .iter()
        .map(|s| s.request.host().unwrap())
        .collect();
    assert_eq!(hosts, ["bad"], "the rest of the sequence never started");
}

#[test]
fn a_parallel_block_lets_the_others_finish_then_fails() {
    let (at, response, mut el) = run(failing(), |ctx| {
        ctx.parallel(|ctx| {
            ctx.get("http://bad/").id("b");
            ctx.get("http://slow/").id("s");
            ctx.get("http://good/").id("g");
        });
        ctx.get("http://good/after").id("after");
    });
    assert_eq!(response.status, 502);
    assert!(
        response.text().contains("parallel steps failed: b"),
        "{}",
        response.text()
    );
    assert!(blames_a_dependency(&response));
    assert_eq!(
        at,
        ms(40),
        "the failure is reported once the slow member finished"
    );
    let paths: Vec<_> = el
        .transport()
        .sent()
        .iter()
        .map(|s| s.request.url.clone())
        .collect();
    assert!(
        !paths.contains(&"http://good/after".to_owned()),
        "the sequence stopped after the block"
    );
    assert_eq!(paths.len(), 3);
}

#[test]
fn internal_failures_and_panics_become_step_errors() {
    let (_, response, _) = run(InMemoryTransport::new(), |ctx| {
        ctx.run_internal(|_| Err::<(), _>("no stock")).id("reserve");
    });
    assert_eq!(
        (response.status, response.text().as_str()),
        (500, "step \"reserve\": failed: no stock\n")
    );
    assert!(!blames_a_dependency(&response), "its own failure");

    let (_, response, el) = run(InMemoryTransport::new(), |ctx| {
        ctx.run_internal(|_| -> Result<(), String> { panic!("index out of range") })
            .id("crash");
    });
    assert_eq!(response.status, 500);
    assert_eq!(
        response.text(),
        "step \"crash\": panicked: index out of range\n"
    );
    assert_eq!(el.in_flight(), (0, 0));
}

#[test]
fn a_handler_that_panics_or_builds_a_bad_graph_is_answered_500() {
    let (_, response, _) = run(InMemoryTransport::new(), |_| panic!("handler bug"));
    assert_eq!(response.status, 500);
    assert!(
        response.text().contains("panicked: handler: handler bug"),
        "{}",
        response.text()
    );

    let (_, response, _) = run(InMemoryTransport::new(), |ctx| {
        ctx.run_internal(|_| Ok::<_, String>(())).inputs(["nope"]);
    });
    assert_eq!(response.status, 500);
    assert!(
        response
            .text()
            .contains("input \"nope\", which is not a step of this request"),
        "{}",
        response.text()
    );
}

#[test]
fn a_request_builder_that_cannot_build_fails_its_step_with_the_reason() {
    use dpumesh_host::{EgressStep, Step};
    let transport = InMemoryTransport::new().service("a", |_| Reply::ok_after(1, "a"));
    let (_, response, el) = run(transport, |ctx| {
        ctx.get("http://a/").id("first");
        ctx.add(Step::from(EgressStep::try_built(
            "second",
            vec!["first".into()],
            |_| Err("TypeError: not a list".to_owned()),
        )));
        ctx.get("http://a/").id("never");
    });
    assert_eq!(response.status, 500);
    assert_eq!(
        response.text(),
        "step \"second\": failed: request builder: TypeError: not a list\n"
    );
    assert_eq!(
        el.stats().egress,
        1,
        "the sequence stopped at the failed step"
    );
    assert_eq!(el.in_flight(), (0, 0));
}

#[test]
fn a_step_timeout_fails_the_request_and_the_late_completion_is_dropped() {
    let transport = InMemoryTransport::new().service("slow", |_| Reply::ok_after(100, "too late"));
    let (at, response, mut el) = run(transport, |ctx| {
        ctx.get("http://slow/").id("slow").timeout(ms(30));
    });
    assert_eq!(response.status, 504);
    assert_eq!(response.text(), "step \"slow\": timed out after 30ms\n");
    assert_eq!(at, ms(30));
    // The answer arrives at 100 ms: nobody is waiting for it.
    el.run_until_idle().unwrap();
    assert_eq!(el.transport().now(), ms(100));
    assert_eq!(el.stats().late_dropped, 1);
    assert_eq!(el.in_flight(), (0, 0));
}

#[test]
fn a_call_that_never_answers_times_out() {
    let transport = InMemoryTransport::new().service("void", |_| Reply::Never);
    let (at, response, el) = run(transport, |ctx| {
        ctx.get("http://void/").id("void").timeout(ms(50));
    });
    assert_eq!((response.status, at), (504, ms(50)));
    assert_eq!(el.in_flight(), (0, 0));
}

#[test]
fn an_internal_step_timeout_fires_on_real_time_and_its_late_result_is_dropped() {
    // The step holds until the test lets it go, so it cannot finish before its timeout
    // however slow the machine is; the loop's clock counts the real time it waits.
    let (release, held) = std::sync::mpsc::channel::<()>();
    let held = Arc::new(parking_lot::Mutex::new(held));
    let handler = move |ctx: &mut ExecutionContext| {
        let held = held.clone();
        ctx.run_internal(move |_| {
            let _ = held.lock().recv();
            Ok::<_, String>("done")
        })
        .id("crunch")
        .timeout(ms(50));
    };
    let mut el = EventLoop::new(InMemoryTransport::new(), handler, LoopConfig::default()).unwrap();
    let id = el.transport().inject(HttpRequest::get("/"));
    let (at, response) = loop {
        el.turn(Some(ms(20))).unwrap();
        if let Some((at, response)) = el.transport().response(id) {
            break (at, response.clone());
        }
    };
    assert_eq!(response.status, 504);
    assert!(
        response
            .text()
            .contains("step \"crunch\": timed out after 50ms"),
        "{}",
        response.text()
    );
    assert!(
        at >= ms(50),
        "answered at {at:?} on the loop's clock, before the timeout"
    );
    // The step finishes later; its result has nowhere to go.
    release.send(()).unwrap();
    while el.stats().late_dropped == 0 {
        el.turn(Some(ms(20))).unwrap();
    }
    assert_eq!(el.stats().late_dropped, 1);
}

#[test]
fn a_late_completion_is_never_delivered_to_the_request_that_reuses_its_slot() {
    let calls = Arc::new(AtomicU32::new(0));
    let c = calls.clone();
    let transport = InMemoryTransport::new().service("echo", move |_| {
        let n = c.fetch_add(1, Ordering::SeqCst) + 1;
        Reply::ok_after(100, format!("answer {n}"))
    });
    let mut el = EventLoop::new(
        transport,
        |ctx: &mut ExecutionContext| {
            let t = if ctx.request().url == "/first" {
                ms(10)
            } else {
                ms(500)
            };
            ctx.get("http://echo/").id("echo").timeout(t);
        },
        LoopConfig::default(),
    )
    .unwrap();
    let first = el.transport().inject(HttpRequest::get("/first"));
    // The second request comes at 20 ms, after the first timed out and freed its slot.
    let second = el
        .transport()
        .inject_after(ms(20), HttpRequest::get("/second"));
    el.run_until_idle().unwrap();
    let t = el.transport();
    let (at1, r1) = t.response(first).unwrap();
    assert_eq!((at1, r1.status), (ms(10), 504));
    let (at2, r2) = t.response(second).unwrap();
    // The first call's answer came at 100 ms into the slot's next life: dropped.
    assert_eq!(
        r2.text(),
        "answer 2",
        "the second request got its own answer"
    );
    assert_eq!(at2, ms(120));
    assert_eq!(el.stats().late_dropped, 1);
    assert_eq!(el.slots_allocated(), 1, "the slot was reused");
}

#[test]
fn ten_thousand_concurrent_requests_on_one_loop_and_the_registry_empties() {
    let transport = InMemoryTransport::new()
        .without_log()
        .service("users", |_| Reply::ok_after(5, "u"))
        .service("orders", |_| Reply::ok_after(8, "o"));
    let mut el = EventLoop::new(
        transport,
        |ctx: &mut ExecutionContext| {
            ctx.parallel(|ctx| {
                ctx.get("http://users/").id("u");
                ctx.get("http://orders/").id("o");
            });
            ctx.respond(|i| Ok::<_, String>(format!("{}{}", i["u"].text(), i["o"].text())))
                .inputs(["u", "o"]);
        },
        LoopConfig::default(),
    )
    .unwrap();
    for wave in 0..2 {
        for _ in 0..10_000 {
            el.transport().inject(HttpRequest::get("/"));
        }
        // All 10 000 are in flight at once before any answer comes back.
        el.turn(None).unwrap();
        assert_eq!(el.in_flight(), (10_000, 20_000), "wave {wave}");
        el.run_until_idle().unwrap();
        let answers = el.transport().take_responses();
        assert_eq!(answers.len(), 10_000);
        assert!(
            answers
                .iter()
                .all(|(_, _, r)| r.status == 200 && r.text() == "uo")
        );
        assert_eq!(
            el.in_flight(),
            (0, 0),
            "the registry is empty after wave {wave}"
        );
    }
    assert_eq!(
        el.slots_allocated(),
        10_000,
        "the second wave reused the first wave's slots"
    );
    assert_eq!(el.stats().responses, 20_000);
}

#[test]
fn too_many_requests_in_flight_are_refused_with_503() {
    let transport = InMemoryTransport::new().service("s", |_| Reply::ok_after(10, "x"));
    let mut el = EventLoop::new(
        transport,
        |ctx: &mut ExecutionContext| {
            ctx.get("http://s/");
        },
        LoopConfig {
            max_in_flight: 2,
            ..LoopConfig::default()
        },
    )
    .unwrap();
    let ids: Vec<_> = (0..3)
        .map(|_| el.transport().inject(HttpRequest::get("/")))
        .collect();
    el.run_until_idle().unwrap();
    let statuses: Vec<_> = ids
        .iter()
        .map(|id| el.transport().response(*id).unwrap().1.status)
        .collect();
    assert_eq!(statuses, [200, 200, 503]);
    assert_eq!(el.stats().refused, 1);
}

#[test]
fn a_transport_that_cannot_route_fails_the_step() {
    let (_, response, _) = run(InMemoryTransport::new(), |ctx| {
        ctx.get("http://nowhere/").id("lost");
    });
    assert_eq!(response.status, 502);
    assert_eq!(
        response.text(),
        "step \"lost\": transport: no route to service \"nowhere\"\n"
    );
    assert!(blames_a_dependency(&response));
}

#[test]
fn a_nested_parallel_failure_names_the_steps_that_failed() {
    let (_, response, _) = run(failing(), |ctx| {
        ctx.parallel(|ctx| {
            ctx.get("http://good/").id("g");
            ctx.parallel(|ctx| {
                ctx.get("http://bad/").id("inner-bad");
                ctx.get("http://slow/").id("inner-slow");
            });
        });
    });
    assert_eq!(response.status, 502);
    assert!(
        response
            .text()
            .contains("parallel steps failed: inner-bad\n"),
        "{}",
        response.text()
    );
}

#[test]
fn a_transport_that_refuses_to_send_fails_the_step_at_once() {
    let mut el = EventLoop::new(
        InMemoryTransport::new().service("s", |_| Reply::ok_after(5, "x")),
        |ctx: &mut ExecutionContext| {
            ctx.get("http://s/").id("call");
        },
        LoopConfig::default(),
    )
    .unwrap();
    el.transport().close();
    let id = el.transport().inject(HttpRequest::get("/"));
    el.run_until_idle().unwrap();
    let (at, r) = el.transport().response(id).unwrap();
    assert_eq!((r.status, at), (502, Duration::ZERO));
    assert_eq!(r.text(), "step \"call\": transport: transport closed\n");
    assert_eq!(el.in_flight(), (0, 0));
}

#[test]
fn timers_of_finished_requests_do_not_outlive_them() {
    // A generous timeout on a fast call: once the request is answered its timer is
    // gone, so going idle does not wait for it.
    let transport = InMemoryTransport::new().service("fast", |_| Reply::ok_after(1, "ok"));
    let (at, response, mut el) = run(transport, |ctx| {
        ctx.get("http://fast/").timeout(Duration::from_secs(30));
    });
    assert_eq!((response.status, at), (200, ms(1)));
    assert_eq!(
        el.transport().now(),
        ms(1),
        "no dead timer moved the clock to 30 s"
    );
}

#[test]
fn respond_runs_on_the_loop_thread_and_internal_work_on_the_pool() {
    let loop_thread = std::thread::current().id();
    let seen = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let record = seen.clone();
    let (_, response, el) = run(InMemoryTransport::new(), move |ctx| {
        let (a, b) = (record.clone(), record.clone());
        ctx.run_internal(move |_| {
            a.lock().push(("internal", std::thread::current().id()));
            Ok::<_, String>("crunched")
        })
        .id("crunch");
        ctx.respond(move |inputs| {
            b.lock().push(("respond", std::thread::current().id()));
            let crunched = inputs.get("crunch").map(|r| r.text()).unwrap_or_default();
            Ok::<_, String>(HttpResponse::ok(format!("{crunched}!")))
        })
        .inputs(["crunch"]);
    });
    assert_eq!(
        (response.status, response.text().as_str()),
        (200, "crunched!")
    );
    let seen = seen.lock().clone();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[1], ("respond", loop_thread), "no hand-off to answer");
    assert_ne!(seen[0].1, loop_thread, "user work stays off the loop");
    assert_eq!(el.stats().internal, 2);
}

#[test]
fn a_worker_scope_wraps_each_pool_thread_and_shutdown_waits_for_the_workers() {
    use dpumesh_host::WorkerScope;
    let (entered, left) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
    let (e, l) = (entered.clone(), left.clone());
    let scope: WorkerScope = Arc::new(move |run| {
        e.fetch_add(1, Ordering::SeqCst);
        run();
        l.fetch_add(1, Ordering::SeqCst);
    });
    let config = LoopConfig {
        threads: 3,
        ..LoopConfig::default()
    };
    let handler = |ctx: &mut ExecutionContext| {
        ctx.run_internal(|_| Ok::<_, String>("ran in scope"));
    };
    let mut el =
        EventLoop::with_worker_scope(InMemoryTransport::new(), handler, config, Some(scope))
            .unwrap();
    let id = el.transport().inject(HttpRequest::get("/"));
    el.run_until_idle().unwrap();
    assert_eq!(
        el.transport().response(id).unwrap().1.text(),
        "ran in scope"
    );
    assert_eq!(
        left.load(Ordering::SeqCst),
        0,
        "workers live until shutdown"
    );
    assert!(el.shutdown(Duration::from_secs(10)), "every worker ended");
    assert_eq!(entered.load(Ordering::SeqCst), 3);
    assert_eq!(left.load(Ordering::SeqCst), 3, "each left its scope");
}

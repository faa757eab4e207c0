//! Requests a proxy-wasm plugin pauses for its HTTP calls: parked in the runner
//! (which goes on serving others), resumed by the calls' answers, given up when their
//! exchange ends, and faults under the failure policy.

use std::sync::Arc;
use std::time::Duration;

use dpumesh_runtime::{
    Callout, CalloutReply, ChainOutcome, ChainRunner, Decision, DenyCause, FailureKind,
    FilterChain, Generation, LoadedFilter, ResponseInfo, Runtime, WorkerPool,
};
use dpumesh_test_artifacts as artifacts;
use serde_json::json;

use crate::support::{get, load, runtime, settings};

fn auth_plugin(rt: &Runtime, calls: u32) -> Arc<LoadedFilter> {
    let config = json!({
        "auth": {"prefix": "/api", "upstream": "auth", "path": "/check", "timeout_ms": 700, "calls": calls},
        "panic_prefix": "/panic",
        "pause_prefix": "/pause",
    });
    rt.load_filter(
        dpumesh_runtime::FilterSettings::new("pw-auth", config.to_string())
            .namespace("pw-calls")
            .deadline(Duration::from_millis(500)),
        &artifacts::read(artifacts::PROXY_WASM_TEST),
    )
    .expect("the plugin loads")
}

fn runner(filters: Vec<Arc<LoadedFilter>>) -> ChainRunner {
    ChainRunner::new(Arc::new(FilterChain::new("calls", filters)))
}

fn paused(outcome: &ChainOutcome) -> (u32, Vec<Callout>) {
    match &outcome.decision {
        Decision::Pause { park, callouts } => (*park, callouts.clone()),
        other => panic!("expected a paused request, got {other:?}"),
    }
}

fn answer(status: u16, body: &str, headers: &[(&str, &str)]) -> CalloutReply {
    CalloutReply::Response {
        status,
        headers: headers
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.as_bytes().to_vec()))
            .collect(),
        body: body.as_bytes().to_vec(),
    }
}

fn status(outcome: &ChainOutcome) -> u16 {
    match &outcome.decision {
        Decision::Continue => 200,
        Decision::Deny { reply, .. } => reply.status,
        Decision::Pause { .. } => 0,
    }
}

fn info(status: u16) -> ResponseInfo {
    ResponseInfo {
        status,
        latency_ns: 1,
        upstream: None,
        failure: FailureKind::None,
    }
}

#[test]
fn a_paused_request_resumes_with_its_calls_answer_while_others_go_through() {
    let rt = runtime();
    let after = load(
        &rt,
        settings(
            "component-after",
            json!({"request": [{"deny_if_header": ["x-user", 418]}]}),
        ),
    );
    let mut runner = runner(vec![auth_plugin(&rt, 1), after]);

    let outcome = runner.on_request(get("/api/orders"));
    let (park, calls) = paused(&outcome);
    assert_eq!(calls.len(), 1);
    let call = &calls[0];
    assert_eq!(call.upstream, "auth");
    assert_eq!(call.header(":path"), Some("/check/api/orders"));
    assert_eq!(call.header(":method"), Some("GET"));
    assert_eq!(call.header("x-asked-by"), Some("proxy-wasm-test"));
    assert_eq!(call.timeout, Duration::from_millis(700));
    assert_eq!(runner.parked(), 1);

    // The runner is not held: other requests pass the same instances meanwhile.
    for _ in 0..3 {
        let other = runner.on_request(get("/public"));
        assert_eq!(other.decision, Decision::Continue);
        let (_, faults) = runner.on_response(other.head, &info(200), other.ran);
        assert!(faults.is_empty(), "{faults:?}");
    }

    // The answer resumes it: the plugin's edits made in the callback reach the
    // component after it, which denies on the user the auth service named.
    let resumed = runner
        .resume(park, call.token, &answer(200, "ok\n", &[("x-user", "ann")]))
        .expect("still parked");
    assert_eq!(status(&resumed), 418, "{:?}", resumed.decision);
    assert_eq!(resumed.head.header("x-auth").as_deref(), Some("ok"));
    assert_eq!(resumed.head.header("x-user").as_deref(), Some("ann"));
    assert_eq!(resumed.ran, 2);
    assert_eq!(runner.parked(), 0);
    let (_, faults) = runner.on_response(resumed.head, &info(418), resumed.ran);
    assert!(faults.is_empty(), "{faults:?}");
    // Answered once: a late duplicate finds nothing parked.
    assert!(
        runner
            .resume(park, call.token, &answer(200, "", &[]))
            .is_none()
    );
}

#[test]
fn a_refusal_a_failed_call_and_a_given_up_request() {
    let rt = runtime();
    let mut runner = runner(vec![auth_plugin(&rt, 1)]);

    let (park, calls) = paused(&runner.on_request(get("/api/a")));
    let denied = runner
        .resume(park, calls[0].token, &answer(401, "", &[]))
        .unwrap();
    let Decision::Deny { reply, cause, .. } = &denied.decision else {
        panic!("{:?}", denied.decision)
    };
    assert_eq!(
        (reply.status, reply.body.as_str()),
        (403, "auth said 401\n")
    );
    assert_eq!(*cause, DenyCause::Policy);

    let (park, calls) = paused(&runner.on_request(get("/api/b")));
    let failed = CalloutReply::Failed {
        reason: "connection refused".into(),
    };
    let unavailable = runner.resume(park, calls[0].token, &failed).unwrap();
    assert_eq!(status(&unavailable), 503);
    assert_eq!(
        unavailable
            .decision
            .reply()
            .unwrap()
            .header("x-auth-failed"),
        Some("no answer")
    );

    // Its exchange timed out: given up, and the response phase ends its context.
    let (park, calls) = paused(&runner.on_request(get("/api/c")));
    let (head, ran) = runner.abandon(park).expect("parked");
    assert_eq!(ran, 1);
    let (_, faults) = runner.on_response(head, &info(504), ran);
    assert!(faults.is_empty(), "{faults:?}");
    assert!(
        runner
            .resume(park, calls[0].token, &answer(200, "", &[]))
            .is_none()
    );

    // A pause with no call under way could only wait for its timeout: a fault, denied
    // (a plugin waiting for a body the proxy never shows it is told why).
    let outcome = runner.on_request(get("/pause"));
    let Decision::Deny {
        cause: DenyCause::Fault(fault),
        ..
    } = &outcome.decision
    else {
        panic!("{:?}", outcome.decision)
    };
    assert!(
        fault.to_string().contains("no HTTP call under way"),
        "{fault}"
    );
    assert_eq!(runner.parked(), 0);
}

#[test]
fn several_calls_at_once_resume_after_the_last_answer() {
    let rt = runtime();
    let mut runner = runner(vec![auth_plugin(&rt, 3)]);
    let (park, calls) = paused(&runner.on_request(get("/api/x")));
    assert_eq!(calls.len(), 3);
    let tokens: Vec<u32> = calls.iter().map(|c| c.token).collect();
    assert_eq!(
        tokens
            .iter()
            .collect::<std::collections::BTreeSet<_>>()
            .len(),
        3,
        "tokens are distinct: {tokens:?}"
    );
    for (i, token) in tokens.iter().enumerate() {
        let outcome = runner
            .resume(park, *token, &answer(200, "ok", &[]))
            .unwrap();
        if i < 2 {
            let (again, new_calls) = paused(&outcome);
            assert_eq!(again, park, "the same parked request");
            assert!(new_calls.is_empty());
        } else {
            assert_eq!(outcome.decision, Decision::Continue);
        }
    }
}

#[test]
fn a_call_to_an_unknown_upstream_is_refused_when_made() {
    let rt = runtime();
    rt.services().callouts.set(["billing".to_owned()].into());
    let mut runner = runner(vec![auth_plugin(&rt, 1)]);
    let outcome = runner.on_request(get("/api/x"));
    let reply = outcome.decision.reply().expect("answered at once");
    assert_eq!(reply.status, 500);
    assert_eq!(reply.body, "cannot call auth: BadArgument\n");
    assert_eq!(runner.parked(), 0);
}

#[test]
fn a_request_parked_in_an_instance_that_faulted_meets_the_failure_policy() {
    let rt = runtime();
    let mut runner = runner(vec![auth_plugin(&rt, 1)]);
    let (park, calls) = paused(&runner.on_request(get("/api/x")));
    let panicked = runner.on_request(get("/panic"));
    assert_eq!(status(&panicked), 500);
    runner.repair();
    let lost = runner
        .resume(park, calls[0].token, &answer(200, "ok", &[]))
        .unwrap();
    let Decision::Deny { cause, .. } = &lost.decision else {
        panic!("{:?}", lost.decision)
    };
    let DenyCause::Fault(fault) = cause else {
        panic!("{cause:?}")
    };
    assert!(
        fault.to_string().contains("replaced after a fault"),
        "{fault}"
    );
}

#[test]
fn a_pool_worker_parks_and_resumes_where_the_request_ran() {
    let rt = runtime();
    let chain = Arc::new(FilterChain::new("calls", vec![auth_plugin(&rt, 1)]));
    let pool = WorkerPool::start(Generation::new(1, vec![chain]), 2).unwrap();
    let done = pool.on_request(0, get("/api/x")).unwrap();
    let (park, calls) = paused(&done.outcome);
    // Another request meanwhile, on whichever worker.
    let other = pool.on_request(0, get("/public")).unwrap();
    assert_eq!(other.outcome.decision, Decision::Continue);

    let (tx, rx) = std::sync::mpsc::channel();
    pool.resume_with(
        done.ticket.clone(),
        park,
        calls[0].token,
        answer(200, "ok", &[]),
        move |r| {
            let _ = tx.send(r);
        },
    )
    .unwrap();
    let resumed = rx
        .recv_timeout(Duration::from_secs(10))
        .unwrap()
        .unwrap()
        .expect("parked on that worker");
    assert_eq!(resumed.ticket.worker, done.ticket.worker);
    assert_eq!(resumed.outcome.decision, Decision::Continue);
    assert_eq!(resumed.outcome.head.header("x-auth").as_deref(), Some("ok"));

    // Given up on the worker: its response phase runs there.
    let done = pool.on_request(0, get("/api/y")).unwrap();
    let (park, _) = paused(&done.outcome);
    let (tx, rx) = std::sync::mpsc::channel();
    pool.abandon_with(done.ticket, park, info(504), move |r| {
        let _ = tx.send(r);
    })
    .unwrap();
    let (_, faults) = rx
        .recv_timeout(Duration::from_secs(10))
        .unwrap()
        .unwrap()
        .expect("parked on that worker");
    assert!(faults.is_empty(), "{faults:?}");
}

#[test]
fn calls_from_the_root_context_are_not_made_and_do_not_use_up_the_tokens() {
    let rt = runtime();
    let config = json!({
        "tick_ms": 1,
        "tick_call": "auth",
        "auth": {"prefix": "/api", "upstream": "auth", "path": "/check", "timeout_ms": 700},
    });
    let filter = rt
        .load_filter(
            dpumesh_runtime::FilterSettings::new("pw-tick-calls", config.to_string())
                .namespace("pw-calls")
                .deadline(Duration::from_millis(500)),
            &artifacts::read(artifacts::PROXY_WASM_TEST),
        )
        .unwrap();
    let mut runner = runner(vec![filter]);
    let count = |key: &str| {
        rt.services()
            .state
            .namespace("pw-calls")
            .get_bytes(key)
            .unwrap()
            .map_or(0, |(v, _)| {
                std::str::from_utf8(&v).unwrap().parse::<u64>().unwrap()
            })
    };
    // More ticks, each making a call, than an instance may have calls under way.
    let mut due = runner.tick(std::time::Instant::now()).unwrap();
    while count("ticks") < 1100 {
        std::thread::sleep(due.saturating_duration_since(std::time::Instant::now()));
        due = runner.tick(std::time::Instant::now()).unwrap();
    }
    assert_eq!(count("tick-call-refused"), 0, "each tick's call was taken");
    // A request's call still gets a token: the root's were released.
    let (_, calls) = paused(&runner.on_request(get("/api/x")));
    assert_eq!(calls.len(), 1);
}

#[test]
fn calls_from_the_root_context_are_handed_to_an_owner_that_makes_them_and_answered_to_the_root() {
    let rt = runtime();
    let config = json!({"tick_ms": 1, "tick_call": "auth"});
    let filter = rt
        .load_filter(
            dpumesh_runtime::FilterSettings::new("pw-root-calls", config.to_string())
                .namespace("pw-root-calls")
                .deadline(Duration::from_millis(500)),
            &artifacts::read(artifacts::PROXY_WASM_TEST),
        )
        .unwrap();
    let shared = |key: &str| {
        rt.services()
            .state
            .namespace("pw-root-calls")
            .get_bytes(key)
            .unwrap()
            .map(|(v, _)| String::from_utf8(v.to_vec()).unwrap())
    };
    // A shard's slot: it makes its instances' root calls.
    let slot = Arc::new(dpumesh_runtime::queues::WakeSlot::default());
    slot.set_performs_calls();
    let mut runner = ChainRunner::with_wake(Arc::new(FilterChain::new("root", vec![filter])), slot);
    let mut due = runner.tick(std::time::Instant::now()).unwrap();
    while shared("ticks").as_deref() != Some("2") {
        std::thread::sleep(due.saturating_duration_since(std::time::Instant::now()));
        due = runner.tick(std::time::Instant::now()).unwrap();
    }
    // Each tick's call, as the plugin made it, with the filter and instance it came from.
    let calls = runner.take_root_calls();
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert!(runner.take_root_calls().is_empty(), "taken once");
    let (index, instance, first) = &calls[0];
    assert_eq!((*index, first.upstream.as_str()), (0, "auth"));
    assert_eq!(first.header(":path"), Some("/tick"));
    assert_eq!(shared("tick-call-refused"), None);

    // The answer reaches the root's on_http_call_response.
    runner.root_callout(*index, *instance, first.token, &answer(200, "fine", &[]));
    assert_eq!(shared("root-answer-last").as_deref(), Some("200 fine"));
    assert_eq!(shared("root-answers").as_deref(), Some("1"));
    // A second answer for the same call, or one for an instance that is not there, is
    // dropped.
    runner.root_callout(*index, *instance, first.token, &answer(500, "again", &[]));
    runner.root_callout(
        *index,
        instance + 1,
        calls[1].2.token,
        &answer(500, "x", &[]),
    );
    assert_eq!(shared("root-answers").as_deref(), Some("1"));
    // A failed call: the root is told with no status.
    let failed = CalloutReply::Failed {
        reason: "refused".into(),
    };
    runner.root_callout(*index, *instance, calls[1].2.token, &failed);
    assert_eq!(shared("root-answer-last").as_deref(), Some("none"));
    assert_eq!(shared("root-answers").as_deref(), Some("2"));
    // The root's answered calls released their tokens: a request still gets one.
    let outcome = runner.on_request(get("/"));
    assert!(outcome.faults.is_empty(), "{:?}", outcome.faults);
}

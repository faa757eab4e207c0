//! Misbehaving filters: deadlines, memory caps, traps, invalid replies, and the
//! failure policy applied to each.

use std::time::{Duration, Instant};

use dpumesh_runtime::{ChainRunner, Decision, DenyCause, FailurePolicy, FaultKind, FilterSettings};
use serde_json::json;

use crate::support::{chain, get, runtime, settings};

fn marker() -> FilterSettings {
    settings(
        "after",
        json!({"request": [{"set_header": ["x-after", "ran"]}]}),
    )
}

fn fault_of(decision: &Decision) -> &dpumesh_runtime::FilterFault {
    match decision {
        Decision::Deny {
            cause: DenyCause::Fault(fault),
            ..
        } => fault,
        other => panic!("expected a fault denial, got {other:?}"),
    }
}

#[test]
fn an_infinite_loop_is_interrupted_at_its_deadline_and_fails_closed() {
    let rt = runtime();
    let spin =
        settings("spinner", json!({"request": ["spin"]})).deadline(Duration::from_millis(20));
    let mut runner = ChainRunner::new(chain(&rt, vec![spin, marker()]));
    let started = Instant::now();
    let outcome = runner.on_request(get("/"));
    let elapsed = started.elapsed();
    let fault = fault_of(&outcome.decision);
    assert_eq!(fault.filter, "spinner");
    assert_eq!(fault.kind, FaultKind::Deadline(Duration::from_millis(20)));
    let reply = outcome.decision.reply().unwrap();
    assert_eq!(reply.status, 500);
    assert!(reply.body.contains("\"spinner\""), "{}", reply.body);
    assert!(reply.body.contains("CPU deadline"), "{}", reply.body);
    assert_eq!(outcome.head.header("x-after"), None);
    // Interrupted, not left running: generous bound for a loaded 2-core machine.
    assert!(elapsed < Duration::from_secs(2), "took {elapsed:?}");
}

#[test]
fn a_filter_that_sleeps_is_woken_at_once_and_does_not_hold_its_thread() {
    // `std::thread::sleep` in a component: a WASI clock subscription and a block on
    // it. Sleeping spends no CPU, so no deadline would end it; the subscription is
    // ready when made instead.
    let rt = runtime();
    let sleeper = settings("sleeper", json!({"request": [{"sleep": 30000}]}));
    let mut runner = ChainRunner::new(chain(&rt, vec![sleeper, marker()]));
    let started = Instant::now();
    let outcome = runner.on_request(get("/"));
    let elapsed = started.elapsed();
    assert_eq!(outcome.decision, Decision::Continue);
    assert_eq!(outcome.head.header("x-after").as_deref(), Some("ran"));
    let slept: u64 = outcome.head.header("x-slept-ms").unwrap().parse().unwrap();
    // It asked for 30 s; a held thread would take all of it. 10 s leaves a loaded
    // machine all the room it needs.
    assert!(slept < 10_000, "the guest slept {slept} ms");
    assert!(elapsed < Duration::from_secs(10), "took {elapsed:?}");
}

#[test]
fn a_deadline_holds_after_the_proxy_sat_idle() {
    // The epoch ticker parks after ~100 idle ticks; the next call must wake it, or a
    // spinning filter would run unbounded.
    let rt = runtime();
    let spin =
        settings("spinner", json!({"request": ["spin"]})).deadline(Duration::from_millis(20));
    let mut runner = ChainRunner::new(chain(&rt, vec![spin, marker()]));
    std::thread::sleep(Duration::from_millis(500));
    let started = Instant::now();
    let outcome = runner.on_request(get("/"));
    let elapsed = started.elapsed();
    assert_eq!(
        fault_of(&outcome.decision).kind,
        FaultKind::Deadline(Duration::from_millis(20))
    );
    assert!(elapsed < Duration::from_secs(2), "took {elapsed:?}");
}

#[test]
fn fail_open_skips_the_faulting_filter_and_continues() {
    let rt = runtime();
    let spin = settings("spinner", json!({"request": ["spin"]}))
        .deadline(Duration::from_millis(10))
        .failure_policy(FailurePolicy::FailOpen);
    let mut runner = ChainRunner::new(chain(&rt, vec![spin, marker()]));
    let outcome = runner.on_request(get("/"));
    assert_eq!(outcome.decision, Decision::Continue);
    assert_eq!(outcome.head.header("x-after").as_deref(), Some("ran"));
    assert_eq!(outcome.faults.len(), 1);
    assert_eq!(outcome.faults[0].kind.label(), "deadline");
}

/// Skipping a filter means none of its edits: what it changed before it faulted is
/// undone (as the batched call, which applies edits when it returns, always did).
#[test]
fn a_filter_skipped_after_a_fault_leaves_no_edits() {
    let rt = runtime();
    let half = settings(
        "half",
        json!({"request": [
            {"set_header": ["x-half", "1"]},
            {"set_metadata": ["half", "1"]},
            {"panic": "after two edits"}
        ]}),
    )
    .failure_policy(FailurePolicy::FailOpen);
    let mut runner = ChainRunner::new(chain(&rt, vec![half, marker()]));
    let outcome = runner.on_request(get("/"));
    assert_eq!(outcome.decision, Decision::Continue);
    assert_eq!(outcome.faults.len(), 1);
    assert_eq!(outcome.head.header("x-half"), None);
    assert_eq!(outcome.head.metadata("half"), None);
    assert_eq!(outcome.head.header("x-after").as_deref(), Some("ran"));
}

#[test]
fn a_memory_bomb_is_stopped_at_its_cap() {
    let rt = runtime();
    let bomb = settings("bomb", json!({"request": [{"alloc_mib": 64}]}))
        .memory_cap(8 << 20)
        .deadline(Duration::from_secs(5));
    let mut runner = ChainRunner::new(chain(&rt, vec![bomb, marker()]));
    let outcome = runner.on_request(get("/"));
    let fault = fault_of(&outcome.decision);
    assert_eq!(fault.kind, FaultKind::MemoryCap(8 << 20));
    assert!(
        outcome
            .decision
            .reply()
            .unwrap()
            .body
            .contains("memory cap of 8192 KiB"),
        "{:?}",
        outcome.decision
    );
}

#[test]
fn a_compact_address_space_runs_filters_and_holds_the_memory_cap() {
    // What kernels with small address spaces and emulators use: no instance pool,
    // bounds-checked memories. Same filters, same caps.
    let rt = dpumesh_runtime::Runtime::new(dpumesh_runtime::RuntimeConfig {
        cache_dir: Some(crate::support::cache_dir()),
        address_space: dpumesh_runtime::AddressSpace::Compact,
        ..dpumesh_runtime::RuntimeConfig::default()
    })
    .unwrap();
    let mut runner = ChainRunner::new(chain(&rt, vec![marker()]));
    let outcome = runner.on_request(get("/"));
    assert_eq!(outcome.decision, Decision::Continue);
    assert_eq!(outcome.head.header("x-after").as_deref(), Some("ran"));
    let bomb = settings("bomb", json!({"request": [{"alloc_mib": 64}]}))
        .memory_cap(8 << 20)
        .deadline(Duration::from_secs(5));
    let mut runner = ChainRunner::new(chain(&rt, vec![bomb, marker()]));
    let outcome = runner.on_request(get("/"));
    assert_eq!(
        fault_of(&outcome.decision).kind,
        FaultKind::MemoryCap(8 << 20)
    );
}

#[test]
fn a_trapping_instance_is_replaced_and_the_next_request_succeeds() {
    let rt = runtime();
    let trapper = settings(
        "trapper",
        json!({"request": [{"panic_if_header": "x-boom"}, {"increment": "served"}]}),
    );
    let mut runner = ChainRunner::new(chain(&rt, vec![trapper]));
    let mut boom = get("/");
    boom.append_received("x-boom", "1").unwrap();
    let outcome = runner.on_request(boom);
    let fault = fault_of(&outcome.decision);
    let FaultKind::Trap(message) = &fault.kind else {
        panic!("expected a trap, got {:?}", fault.kind);
    };
    // The guest's panic message is quoted.
    assert!(message.contains("header x-boom present"), "{message}");
    assert_eq!(runner.instances(), 0, "the trapped instance is discarded");
    runner.repair();
    assert_eq!(runner.instances(), 1);
    for _ in 0..3 {
        assert_eq!(runner.on_request(get("/")).decision, Decision::Continue);
    }
    let served = rt.shared_state().namespace("test").get("served").unwrap();
    assert_eq!(served, Some(3));
}

#[test]
fn a_discarded_instance_is_recreated_even_without_repair() {
    let rt = runtime();
    let trapper = settings(
        "trapper",
        json!({"request": [{"panic_if_header": "x-boom"}]}),
    );
    let mut runner = ChainRunner::new(chain(&rt, vec![trapper]));
    let mut boom = get("/");
    boom.append_received("x-boom", "1").unwrap();
    assert!(matches!(
        runner.on_request(boom).decision,
        Decision::Deny { .. }
    ));
    assert_eq!(runner.on_request(get("/")).decision, Decision::Continue);
}

#[test]
fn an_invalid_reply_is_a_500_naming_the_filter() {
    let rt = runtime();
    let bad = settings("bad", json!({"request": [{"deny": [42, "x"]}]}))
        .failure_policy(FailurePolicy::FailOpen);
    let outcome = ChainRunner::new(chain(&rt, vec![bad])).on_request(get("/"));
    let fault = fault_of(&outcome.decision);
    assert_eq!(fault.filter, "bad");
    assert!(matches!(&fault.kind, FaultKind::BadReply(m) if m.contains("status 42")));
    assert_eq!(outcome.decision.reply().unwrap().status, 500);
}

#[test]
fn faults_in_the_response_phase_are_reported_and_do_not_poison_requests() {
    let rt = runtime();
    // The response phase runs last filter first: `after` before `resp`, so the fault
    // must be named for the filter entered last, not the one entered first.
    let f = settings("resp", json!({"response": [{"panic": "late"}]}));
    let after = settings(
        "after",
        json!({"tag": "after", "response": [{"record_order": "resp"}]}),
    );
    let mut runner = ChainRunner::new(chain(&rt, vec![f, after]));
    let outcome = runner.on_request(get("/"));
    assert_eq!(outcome.decision, Decision::Continue);
    let info = dpumesh_runtime::ResponseInfo {
        status: 200,
        latency_ns: 1,
        upstream: Some("10.0.0.2:8080".to_owned()),
        failure: dpumesh_runtime::FailureKind::None,
    };
    let (_, faults) = runner.on_response(outcome.head, &info, outcome.ran);
    assert_eq!(faults.len(), 1);
    assert_eq!(faults[0].phase, dpumesh_runtime::Phase::Response);
    assert_eq!(faults[0].filter, "resp");
    assert_eq!(runner.on_request(get("/")).decision, Decision::Continue);
}

#[test]
fn the_reload_policy_retries_once_on_a_fresh_instance_with_the_original_head() {
    let rt = runtime();
    let flaky = |policy| {
        settings(
            "flaky",
            json!({"request": [
                {"append_header": ["x-seen", "1"]},
                {"panic_on_call": 3},
            ]}),
        )
        .failure_policy(policy)
    };
    let mut runner = ChainRunner::new(chain(&rt, vec![flaky(FailurePolicy::Reload), marker()]));
    // Request 3 faults and is retried on a fresh instance (whose own third call is
    // request 5, past this loop).
    for i in 1..=4 {
        let outcome = runner.on_request(get("/"));
        assert_eq!(outcome.decision, Decision::Continue, "request {i}");
        // The failed call's edit was not kept: the retry started from the original.
        assert_eq!(outcome.head.header_all("x-seen"), vec!["1"], "request {i}");
        assert_eq!(outcome.head.header("x-after").as_deref(), Some("ran"));
        assert_eq!(outcome.faults.len(), usize::from(i == 3), "request {i}");
    }

    // The same filter failing closed denies the third request.
    let mut runner = ChainRunner::new(chain(&rt, vec![flaky(FailurePolicy::FailClosed)]));
    let statuses: Vec<Option<u16>> = (0..4)
        .map(|_| {
            runner
                .on_request(get("/"))
                .decision
                .reply()
                .map(|r| r.status)
        })
        .collect();
    assert_eq!(statuses, [None, None, Some(500), None]);
}

#[test]
fn a_retry_that_faults_again_fails_closed() {
    let rt = runtime();
    let broken = settings("broken", json!({"request": [{"panic": "always"}]}))
        .failure_policy(FailurePolicy::Reload);
    let mut runner = ChainRunner::new(chain(&rt, vec![broken, marker()]));
    let outcome = runner.on_request(get("/"));
    assert_eq!(outcome.decision.reply().map(|r| r.status), Some(500));
    assert_eq!(outcome.faults.len(), 2, "the call and its retry");
}

#[test]
fn repeated_faults_degrade_a_filter_until_its_backoff_ends() {
    use dpumesh_clock::ManualClock;
    use dpumesh_runtime::{HealthState, Runtime, RuntimeConfig};

    let clock = ManualClock::at_unix_secs(1_700_000_000);
    let rt = Runtime::new(RuntimeConfig {
        cache_dir: Some(crate::support::cache_dir()),
        max_instances: 8,
        clock: clock.clone(),
        ..RuntimeConfig::default()
    })
    .unwrap();
    let trapper = settings(
        "trapper",
        json!({"request": [{"increment": "calls"}, {"panic_if_header": "x-boom"}]}),
    );
    let chain = chain(&rt, vec![trapper]);
    let filter = chain.filters()[0].clone();
    let mut runner = ChainRunner::new(chain);
    let boom = || {
        let mut head = get("/");
        head.append_received("x-boom", "1").unwrap();
        head
    };
    let calls = || {
        rt.shared_state()
            .namespace("test")
            .get("calls")
            .unwrap()
            .unwrap_or(0)
    };
    for _ in 0..5 {
        assert_eq!(
            runner.on_request(boom()).decision.reply().map(|r| r.status),
            Some(500)
        );
    }
    assert_eq!(calls(), 5);
    assert_eq!(
        filter.health().state(),
        HealthState::Degraded { retry_in_ms: 1000 }
    );

    // Degraded: the policy applies without calling the filter, even for good requests.
    let outcome = runner.on_request(get("/"));
    let reply = outcome.decision.reply().unwrap();
    assert_eq!(reply.status, 503);
    assert!(reply.body.contains("degraded"), "{}", reply.body);
    assert_eq!(fault_of(&outcome.decision).kind.label(), "degraded");
    assert_eq!(calls(), 5, "a degraded filter is not called");

    // After the backoff the filter is tried again; a success makes it healthy.
    clock.advance_ms(1000);
    assert_eq!(runner.on_request(get("/")).decision, Decision::Continue);
    assert_eq!(calls(), 6);
    assert_eq!(filter.health().state(), HealthState::Healthy);
}

#[test]
fn a_degraded_fail_open_filter_is_skipped() {
    let rt = runtime();
    let trapper = settings("trapper", json!({"request": [{"panic": "always"}]}))
        .failure_policy(FailurePolicy::FailOpen);
    let mut runner = ChainRunner::new(chain(&rt, vec![trapper, marker()]));
    for _ in 0..8 {
        let outcome = runner.on_request(get("/"));
        assert_eq!(outcome.decision, Decision::Continue);
        assert_eq!(outcome.head.header("x-after").as_deref(), Some("ran"));
    }
    assert!(runner.chain().filters()[0].health().is_degraded());
}

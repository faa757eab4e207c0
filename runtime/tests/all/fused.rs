//! Fused chains: what holds only of a chain composed into one component. (The chain
//! and fault tests run a second time with every test chain fused, under
//! `DPUMESH_TEST_FUSED=1`: the same behaviour, order, edits, policies, limits.)
//! Here: each filter keeps its own identity, deadline and memory cap inside the one
//! instance; components of earlier WIT versions fuse with current ones; what cannot
//! be fused says why.

use std::sync::Arc;
use std::time::Duration;

use dpumesh_runtime::{
    ChainRunner, Decision, FailureKind, FaultKind, FilterChain, FilterSettings, LoadError,
    ResponseInfo,
};
use dpumesh_test_artifacts as artifacts;
use serde_json::json;

use crate::support::{get, load, runtime, settings};

fn fused(rt: &dpumesh_runtime::Runtime, filters: Vec<FilterSettings>) -> ChainRunner {
    let loaded = filters.into_iter().map(|s| load(rt, s)).collect();
    let chain = FilterChain::new("fused", loaded).fuse().expect("fuses");
    assert!(chain.is_fused());
    ChainRunner::new(Arc::new(chain))
}

fn denial(decision: &Decision) -> (&str, &dpumesh_runtime::FilterFault) {
    match decision {
        Decision::Deny {
            filter,
            cause: dpumesh_runtime::DenyCause::Fault(fault),
            ..
        } => (filter, fault),
        other => panic!("expected a fault's denial, got {other:?}"),
    }
}

#[test]
fn a_fused_chain_runs_its_filters_in_order_and_the_first_deny_wins() {
    let rt = runtime();
    let tagged = |tag: &str| {
        settings(
            tag,
            json!({"tag": tag, "request": [
                {"append_header": ["x-order", tag]},
                {"deny_if_header": [format!("x-deny-{tag}"), 403]}
            ]}),
        )
    };
    let mut runner = fused(&rt, vec![tagged("a"), tagged("b"), tagged("c")]);
    let outcome = runner.on_request(get("/"));
    assert_eq!(outcome.decision, Decision::Continue);
    assert_eq!(outcome.head.header_all("x-order"), vec!["a", "b", "c"]);
    assert_eq!(runner.instances(), 3);

    let mut head = get("/");
    head.append_received("x-deny-b", "1").unwrap();
    let outcome = runner.on_request(head);
    let Decision::Deny { filter, reply, .. } = &outcome.decision else {
        panic!("expected a denial, got {:?}", outcome.decision);
    };
    assert_eq!(&**filter, "b");
    assert_eq!(reply.status, 403);
    assert_eq!(outcome.ran, 2);
}

#[test]
fn each_filter_of_a_fused_chain_keeps_its_own_shared_state_namespace() {
    let rt = runtime();
    let counting = |name: &str, namespace: &str| {
        FilterSettings::new(
            name,
            json!({"request": [{"increment": "n"}], "response": [{"increment": "r"}]}).to_string(),
        )
        .namespace(namespace)
        // Not a deadline test: a first call on a loaded CI host once used 5 ms of CPU.
        .deadline(Duration::from_secs(2))
    };
    let mut runner = fused(
        &rt,
        vec![
            counting("one", "ns-one"),
            counting("two", "ns-two"),
            counting("three", "ns-two"),
        ],
    );
    let outcome = runner.on_request(get("/"));
    assert_eq!(outcome.decision, Decision::Continue);
    let info = ResponseInfo {
        status: 200,
        latency_ns: 1,
        upstream: None,
        failure: FailureKind::None,
    };
    runner.on_response(outcome.head, &info, outcome.ran);
    let state = rt.shared_state();
    assert_eq!(state.namespace("ns-one").get("n").unwrap(), Some(1));
    assert_eq!(state.namespace("ns-two").get("n").unwrap(), Some(2));
    assert_eq!(state.namespace("ns-one").get("r").unwrap(), Some(1));
    assert_eq!(state.namespace("ns-two").get("r").unwrap(), Some(2));
}

#[test]
fn each_filter_of_a_fused_chain_runs_under_its_own_deadline() {
    let rt = runtime();
    // First a filter with a 50 ms deadline that spins only when asked, then one that
    // always works ~0.3 s (natively; far longer under qemu) under its own 60 s: the
    // first one's deadline must not cut the second one short, and the first one's
    // spin must be cut at its own.
    let hasty = settings("hasty", json!({"request": [{"spin_if_header": "x-spin"}]}))
        .deadline(Duration::from_millis(50));
    let patient = settings("patient", json!({"request": [{"work": 300_000_000u64}]}))
        .deadline(Duration::from_secs(60));
    let mut runner = fused(&rt, vec![hasty, patient]);
    let outcome = runner.on_request(get("/"));
    assert_eq!(outcome.decision, Decision::Continue, "{:?}", outcome.faults);
    let mut head = get("/");
    head.append_received("x-spin", "1").unwrap();
    let outcome = runner.on_request(head);
    let (filter, fault) = denial(&outcome.decision);
    assert_eq!(filter, "hasty");
    assert_eq!(fault.kind, FaultKind::Deadline(Duration::from_millis(50)));
    // The fused instance is made again; the next request runs through it.
    assert!(!runner.is_fused());
    runner.repair();
    assert!(runner.is_fused());
    assert_eq!(runner.instances(), 2);
    assert_eq!(runner.on_request(get("/")).decision, Decision::Continue);
}

#[test]
fn each_filter_of_a_fused_chain_is_held_to_its_own_memory_cap() {
    let rt = runtime();
    let roomy = settings(
        "roomy",
        json!({"request": [{"alloc_mib_if_header": ["x-big", 24]}]}),
    )
    .memory_cap(64 << 20);
    let tight = settings(
        "tight",
        json!({"request": [{"alloc_mib_if_header": ["x-small", 24]}]}),
    )
    .memory_cap(16 << 20);
    let mut runner = fused(&rt, vec![roomy, tight]);
    let mut head = get("/");
    head.append_received("x-big", "1").unwrap();
    let outcome = runner.on_request(head);
    assert_eq!(outcome.decision, Decision::Continue, "24 MiB fit in 64");
    let mut head = get("/");
    head.append_received("x-small", "1").unwrap();
    let outcome = runner.on_request(head);
    let (filter, fault) = denial(&outcome.decision);
    assert_eq!(filter, "tight");
    assert_eq!(fault.kind, FaultKind::MemoryCap(16 << 20));
}

#[test]
fn a_fault_names_the_filter_it_happened_in_and_the_rest_runs_on_separate_instances() {
    let rt = runtime();
    let open = settings(
        "flaky",
        json!({"request": [{"append_header": ["x-order", "flaky"]}, {"panic_if_header": "x-boom"}]}),
    )
    .failure_policy(dpumesh_runtime::FailurePolicy::FailOpen);
    let after = settings(
        "after",
        json!({"request": [{"append_header": ["x-order", "after"]}]}),
    );
    let mut runner = fused(&rt, vec![open, after]);
    let mut head = get("/");
    head.append_received("x-boom", "1").unwrap();
    let outcome = runner.on_request(head);
    assert_eq!(outcome.decision, Decision::Continue);
    assert_eq!(outcome.faults.len(), 1);
    assert_eq!(outcome.faults[0].filter, "flaky");
    assert!(
        matches!(&outcome.faults[0].kind, FaultKind::Trap(m) if m.contains("header x-boom present")),
        "{:?}",
        outcome.faults[0].kind
    );
    // The skipped filter's edit is undone (as with separate instances), the next
    // filter's stays.
    assert_eq!(outcome.head.header_all("x-order"), vec!["after"]);
    // Until repair, requests run on separate instances (both phases on one kind);
    // repair makes the fused instance again.
    assert!(!runner.is_fused());
    let outcome = runner.on_request(get("/"));
    assert_eq!(outcome.decision, Decision::Continue);
    assert!(outcome.faults.is_empty());
    runner.repair();
    assert!(runner.is_fused());
    let outcome = runner.on_request(get("/"));
    assert_eq!(outcome.head.header_all("x-order"), vec!["flaky", "after"]);
}

#[test]
fn a_request_the_driver_cannot_take_runs_unfused_and_no_filter_is_passed_over() {
    let rt = runtime();
    // The first filter is fail-closed; the second, fail-open, is the one the first
    // request enters last. A path larger than every cap cannot be lowered into the
    // driver's memory: that is no filter's fault (it used to be blamed on the filter
    // the last request entered, whose fail-open policy then let it past the first).
    // The first filter reads the line (`describe`), so its own instance cannot take
    // the path either.
    let authz = settings(
        "authz",
        json!({"request": ["describe", {"deny_if_header": ["x-deny", 403]}]}),
    )
    .memory_cap(4 << 20);
    let logger = settings(
        "logger",
        json!({"request": [{"set_metadata": ["seen", "1"]}]}),
    )
    .memory_cap(4 << 20)
    .failure_policy(dpumesh_runtime::FailurePolicy::FailOpen);
    let mut runner = fused(&rt, vec![authz, logger]);
    assert_eq!(runner.on_request(get("/")).decision, Decision::Continue);
    let huge = format!("/{}", "a".repeat(6 << 20));
    let outcome = runner.on_request(get(&huge));
    let Decision::Deny { filter, cause, .. } = &outcome.decision else {
        panic!("a huge path went through: {:?}", outcome.faults);
    };
    // Run unfused, the first filter's own instance cannot take it either.
    assert_eq!(&**filter, "authz");
    assert!(
        matches!(cause, dpumesh_runtime::DenyCause::Fault(f) if matches!(f.kind, FaultKind::MemoryCap(_))),
        "{cause:?}"
    );
}

#[test]
fn a_degraded_fail_open_filter_is_counted_once_and_only_when_the_chain_reached_it() {
    let rt = runtime();
    let gate = settings(
        "gate",
        json!({"request": [{"deny_if_header": ["x-deny", 403]}]}),
    );
    let flaky = settings("flaky", json!({"request": [{"panic_if_header": "x-boom"}]}))
        .failure_policy(dpumesh_runtime::FailurePolicy::FailOpen);
    let mut runner = fused(&rt, vec![gate, flaky]);
    let with = |name: &str| {
        let mut head = get("/");
        head.append_received(name, "1").unwrap();
        head
    };
    for _ in 0..5 {
        let outcome = runner.on_request(with("x-boom"));
        assert_eq!(outcome.decision, Decision::Continue);
        runner.repair();
    }
    assert!(runner.chain().filters()[1].health().is_degraded());
    // Reached: counted once.
    let outcome = runner.on_request(get("/"));
    assert_eq!(outcome.decision, Decision::Continue);
    assert_eq!(outcome.faults.len(), 1, "{:?}", outcome.faults);
    assert_eq!(outcome.faults[0].filter, "flaky");
    // Not reached (the gate denied first): not counted.
    let outcome = runner.on_request(with("x-deny"));
    assert!(outcome.decision.reply().is_some_and(|r| r.status == 403));
    assert!(outcome.faults.is_empty(), "{:?}", outcome.faults);
}

#[test]
fn components_built_for_earlier_wit_versions_fuse_with_current_ones() {
    let rt = runtime();
    let old = std::fs::read(format!(
        "{}/../tests/fixtures/components/rbac-wit-0.1.1.wasm",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap();
    let rbac = r#"{"action": "ALLOW", "policies": [{"name": "all", "permissions": [{"any": true}], "principals": [{"any": true}]}]}"#;
    // Generous deadlines: this is not about them (and qemu runs this test too).
    let slack = Duration::from_secs(2);
    let rbac = rt
        .load_filter(
            FilterSettings::new("rbac-0.1.1", rbac).deadline(slack),
            &old,
        )
        .unwrap();
    let guard = rt
        .load_filter(
            FilterSettings::new("guard", r#"{"rules": []}"#).deadline(slack),
            &artifacts::read(artifacts::SAMPLE_GUARD),
        )
        .unwrap();
    let current = load(
        &rt,
        settings(
            "current",
            json!({"request": [{"set_header": ["x-ran", "yes"]}]}),
        ),
    );
    let chain = FilterChain::new("mixed", vec![rbac, guard, current])
        .fuse()
        .expect("0.1.1 and 0.1.2 components fuse");
    let mut runner = ChainRunner::new(Arc::new(chain));
    let outcome = runner.on_request(get("/"));
    assert_eq!(outcome.decision, Decision::Continue, "{:?}", outcome.faults);
    assert_eq!(outcome.head.header_all("x-ran"), vec!["yes"]);
}

#[test]
fn a_chain_that_cannot_be_fused_says_why() {
    let rt = runtime();
    assert_eq!(
        FilterChain::new("empty", Vec::new()).unfusable().as_deref(),
        Some("the chain is empty")
    );
    let plugin = rt
        .load_filter(
            FilterSettings::new("plugin", ""),
            &artifacts::read(artifacts::PROXY_WASM_TEST),
        )
        .unwrap();
    let component = load(&rt, settings("component", json!({})));
    let chain = FilterChain::new("mixed", vec![component, plugin]);
    let reason = chain.unfusable().expect("a plugin cannot be fused");
    assert!(
        reason.contains("\"plugin\" is a proxy-wasm plugin"),
        "{reason}"
    );
    match chain.fuse() {
        Err(LoadError::Fuse { chain, detail }) => {
            assert_eq!(chain, "mixed");
            assert!(detail.contains("proxy-wasm"), "{detail}");
        }
        other => panic!("expected a fuse error, got {other:?}"),
    }
}

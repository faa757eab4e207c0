//! The hand-written canonical ABI (`canon`: a component's one core module, lifted and
//! lowered by hand) against wasmtime's component calls: the same guest, the same
//! configuration and the same request through both must give the same decision, the
//! same head and the same metadata. Guests and requests are generated: random edits,
//! reads, denials and names that are not valid HTTP (so the error paths are compared
//! too), through the plain and the batched call.
//!
//! Bounded for CI (`DIFF_CASES`, 48 by default); run longer with, for example,
//! `DPUMESH_DIFF_CASES=5000 cargo test -p dpumesh-runtime --test all differential`.

use std::sync::{Arc, OnceLock};

use dpumesh_runtime::{
    ChainRunner, Decision, DenyCause, FailurePolicy, FaultKind, FilterChain, FilterSettings,
    RequestHead, Runtime,
};
use dpumesh_test_artifacts as artifacts;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use serde_json::{Value, json};

use crate::support::runtime_with;

/// Cases a CI run tries.
const DIFF_CASES: u32 = 48;

/// Header names: common, unusual and invalid ones (upper case, spaces, empty).
fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("x-a".to_owned()),
        Just("x-b".to_owned()),
        Just("authorization".to_owned()),
        Just("content-type".to_owned()),
        Just("X-Upper".to_owned()),
        Just("bad name".to_owned()),
        Just(String::new()),
        "[a-z][a-z0-9-]{0,12}",
    ]
}

/// Header values: text, empty, and bytes HTTP refuses (control characters).
fn value() -> impl Strategy<Value = String> {
    prop_oneof![
        "[ -~]{0,24}",
        Just(String::new()),
        Just("line\nbreak".to_owned()),
        Just("ünïcødé".to_owned()),
    ]
}

/// Metadata keys and values (any text: metadata is not HTTP).
fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("user".to_owned()),
        Just("role".to_owned()),
        "[a-z.]{1,10}"
    ]
}

/// One step of the test filter that behaves the same whoever runs it (no time, no
/// shared state, no faults on purpose: a fault here is a difference to explain).
fn action() -> impl Strategy<Value = Value> {
    prop_oneof![
        (name(), value()).prop_map(|(n, v)| json!({"set_header": [n, v]})),
        (name(), value()).prop_map(|(n, v)| json!({"append_header": [n, v]})),
        name().prop_map(|n| json!({"remove_header": n})),
        (key(), "[ -~]{0,16}").prop_map(|(k, v)| json!({"set_metadata": [k, v]})),
        (key(), name()).prop_map(|(k, n)| json!({"metadata_to_header": [k, n]})),
        (name(), 400u16..600).prop_map(|(n, s)| json!({"deny_if_header": [n, s]})),
        key().prop_map(|k| json!({"require_metadata": k})),
        (name(), value()).prop_map(|(n, v)| json!({"try_set_header": [n, v]})),
        prop::collection::vec(name(), 0..4).prop_map(|ns| json!({"join_headers": ns})),
        Just(json!("describe")),
        (200u16..600, "[ -~]{0,16}").prop_map(|(s, b)| json!({"deny": [s, b]})),
    ]
}

/// A filter's configuration: its steps, and sometimes declared headers (then the
/// proxy uses the batched call); and its failure policy (a fail-open filter that
/// faults is skipped with none of its edits, whichever path ran it).
fn config() -> impl Strategy<Value = (Value, FailurePolicy)> {
    (
        prop::collection::vec(action(), 0..6),
        prop::collection::vec(name(), 0..3),
        prop_oneof![
            Just(FailurePolicy::FailClosed),
            Just(FailurePolicy::FailOpen)
        ],
    )
        .prop_map(|(request, interest, policy)| {
            let config = json!({"tag": "d", "request": request, "interest": interest});
            (config, policy)
        })
}

/// A request head: method, path and query, headers (repeated names too) and
/// metadata.
fn head() -> impl Strategy<Value = RequestHead> {
    (
        prop_oneof![Just("GET"), Just("POST"), Just("DELETE"), Just("PATCH")],
        "/[a-z0-9/._-]{0,20}",
        prop::option::of("[a-z0-9=&]{0,12}"),
        prop::collection::vec(("[a-z][a-z0-9-]{0,8}", "[ -~]{0,16}"), 0..6),
        prop::collection::vec((key(), "[ -~]{0,12}"), 0..3),
    )
        .prop_map(|(method, path, query, headers, metadata)| {
            let mut head = RequestHead::new(method, &path);
            head.authority = "api.example.com".to_owned();
            head.query = query;
            for (n, v) in headers {
                let _ = head.append_header(&n, &v);
            }
            for (k, v) in metadata {
                head.set_metadata(&k, &v);
            }
            head
        })
}

/// What a user of the chain sees: the decision (a fault by its kind only: a trap's
/// text names the path that raised it), the head's headers in order, its metadata.
#[derive(Debug, PartialEq)]
struct Seen {
    decision: String,
    headers: Vec<(String, Vec<u8>)>,
    metadata: Vec<(String, String)>,
}

fn seen(decision: &Decision, head: &RequestHead) -> Seen {
    // A fault under fail-closed denies the request: its head goes no further, and what
    // the faulted call had edited in it by then is not compared (the batched call
    // applies edits when it returns, the others as they are made).
    let faulted = matches!(
        decision,
        Decision::Deny {
            cause: DenyCause::Fault(_),
            ..
        }
    );
    let decision = match decision {
        Decision::Continue => "continue".to_owned(),
        Decision::Pause { .. } => "pause".to_owned(),
        Decision::Deny {
            cause: DenyCause::Fault(f),
            reply,
            ..
        } => {
            let kind = match f.kind {
                FaultKind::Trap(_) => "trap".to_owned(),
                ref other => format!("{other}"),
            };
            format!("fault {kind} {}", reply.status)
        }
        Decision::Deny { reply, .. } => format!("deny {reply:?}"),
    };
    if faulted {
        return Seen {
            decision,
            headers: Vec::new(),
            metadata: Vec::new(),
        };
    }
    Seen {
        decision,
        headers: head
            .headers()
            .iter()
            .map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec()))
            .collect(),
        metadata: head
            .metadata_entries()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect(),
    }
}

/// The two runtimes, made once: loading reuses their compiled artifacts.
fn runtimes() -> &'static (Runtime, Runtime) {
    static BOTH: OnceLock<(Runtime, Runtime)> = OnceLock::new();
    BOTH.get_or_init(|| (runtime_with(true), runtime_with(false)))
}

fn run(rt: &Runtime, config: &(Value, FailurePolicy), head: RequestHead, core: bool) -> Seen {
    let (config, policy) = config;
    let settings = FilterSettings::new("diff", config.to_string())
        .failure_policy(*policy)
        .namespace("diff")
        .deadline(std::time::Duration::from_secs(2));
    let filter = rt
        .load_filter(settings, &artifacts::read(artifacts::TEST_FILTER))
        .expect("the test filter loads");
    assert_eq!(filter.runs_as_core(), core, "the path under test");
    let mut runner = ChainRunner::new(Arc::new(FilterChain::new("diff", vec![filter])));
    let outcome = runner.on_request(head);
    seen(&outcome.decision, &outcome.head)
}

#[test]
fn canon_and_component_calls_agree_on_generated_guests_and_requests() {
    let cases = std::env::var("DPUMESH_DIFF_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(DIFF_CASES);
    let (core, component) = runtimes();
    let mut runner = TestRunner::new(Config {
        cases,
        // Shrinking reruns both paths many times; a difference is reported as found.
        max_shrink_iters: 64,
        ..Config::default()
    });
    runner
        .run(&(config(), head()), |(config, head)| {
            let by_canon = run(core, &config, head.clone(), true);
            let by_component = run(component, &config, head, false);
            prop_assert_eq!(by_canon, by_component, "config {:?}", config);
            Ok(())
        })
        .unwrap();
}

#[test]
fn the_comparison_sees_a_difference() {
    let policy = FailurePolicy::FailClosed;
    let edit = (
        json!({"tag": "d", "request": [{"set_header": ["x-a", "1"]}]}),
        policy,
    );
    let plain = (json!({"tag": "d", "request": []}), policy);
    let (core, component) = runtimes();
    let head = RequestHead::new("GET", "/");
    assert_ne!(
        run(core, &edit, head.clone(), true),
        run(component, &plain, head, false)
    );
}

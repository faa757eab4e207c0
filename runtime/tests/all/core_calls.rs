//! Components run as core instances: which ones do, and what a guest that breaks the
//! canonical ABI's rules gets (a fault naming the broken rule, the next request
//! served by a fresh instance), as it gets through component calls.

use std::sync::Arc;
use std::time::Duration;

use dpumesh_runtime::{ChainRunner, Decision, FaultKind, FilterChain, FilterSettings};
use dpumesh_test_artifacts as artifacts;

use serde_json::json;

use crate::support::{get, load, runtime_with, settings};

/// (The built-ins whose configuration cannot be empty are checked by the
/// conformance suites, which run each both ways.)
#[test]
fn the_rust_filters_run_as_core_instances_unless_turned_off() {
    let filters = [
        ("trace", artifacts::FILTER_TRACE),
        ("breaker", artifacts::FILTER_CIRCUIT_BREAKER),
        ("test", artifacts::TEST_FILTER),
        ("guard", artifacts::SAMPLE_GUARD),
    ];
    for (name, path) in filters {
        let bytes = artifacts::read(path);
        let on = runtime_with(true)
            .load_filter(FilterSettings::new(name, ""), &bytes)
            .unwrap();
        assert!(on.runs_as_core(), "{name}");
        let off = runtime_with(false)
            .load_filter(FilterSettings::new(name, ""), &bytes)
            .unwrap();
        assert!(!off.runs_as_core(), "{name}");
    }
}

/// A filter written by hand against the core ABI: on `/oob` it passes a name that
/// runs past its memory, on `/utf8` one that is not UTF-8, on `/handle` a head handle
/// it was never given, on `/ret` a misaligned return area, on `/keep` it keeps the
/// head's borrow past the call, on `/batch` it sets two metadata entries in one call,
/// the second's value not UTF-8; otherwise it drops the borrow and continues.
const BREAKER: &str = r#"
(module
  (import "dpumesh:filter/types@0.1.2" "[method]request-head.header"
    (func $header (param i32 i32 i32 i32)))
  (import "dpumesh:filter/types@0.1.2" "[method]request-head.set-metadata-batch"
    (func $batch (param i32 i32 i32)))
  (import "dpumesh:filter/types@0.1.2" "[resource-drop]request-head"
    (func $drop (param i32)))
  (memory (export "memory") 1)
  (global $bump (mut i32) (i32.const 1024))
  (data (i32.const 200) "\ff\fe")
  ;; The batch: ("a", "1") then ("b", the two bytes at 200), a table at 304.
  (data (i32.const 400) "a1b")
  (data (i32.const 304)
    "\90\01\00\00" "\01\00\00\00" "\91\01\00\00" "\01\00\00\00"
    "\92\01\00\00" "\01\00\00\00" "\c8\00\00\00" "\02\00\00\00")
  (func (export "cabi_realloc") (param i32 i32 i32 i32) (result i32)
    (local $p i32)
    (local.set $p (i32.and (i32.add (global.get $bump) (i32.const 7)) (i32.const -8)))
    (global.set $bump (i32.add (local.get $p) (local.get 3)))
    (if (i32.gt_u (global.get $bump) (i32.const 60000))
      (then (global.set $bump (i32.const 1024))))
    (local.get $p))
  (func (export "configure") (param i32 i32) (result i32)
    (i32.store8 (i32.const 48) (i32.const 0))
    (i32.const 48))
  (func (export "on-response") (param i32 i32 i64 i32 i32 i32 i32))
  (func (export "on-request")
    (param $mc i32) (param $mp i32) (param $ml i32) (param $scheme i32)
    (param $ap i32) (param $al i32) (param $pp i32) (param $pl i32) (param $h i32)
    (result i32)
    (local $c i32)
    (local.set $c (i32.load8_u (i32.add (local.get $pp) (i32.const 1))))
    (if (i32.eq (local.get $c) (i32.const 111))
      (then (call $header (local.get $h) (i32.const 65520) (i32.const 100) (i32.const 16))))
    (if (i32.eq (local.get $c) (i32.const 117))
      (then (call $header (local.get $h) (i32.const 200) (i32.const 2) (i32.const 16))))
    (if (i32.eq (local.get $c) (i32.const 104))
      (then (call $header (i32.const 7) (i32.const 200) (i32.const 0) (i32.const 16))))
    (if (i32.eq (local.get $c) (i32.const 114))
      (then (call $header (local.get $h) (i32.const 200) (i32.const 0) (i32.const 17))))
    (if (i32.eq (local.get $c) (i32.const 98))
      (then (call $batch (local.get $h) (i32.const 304) (i32.const 2))))
    (if (i32.ne (local.get $c) (i32.const 107))
      (then (call $drop (local.get $h))))
    (i32.store8 (i32.const 32) (i32.const 0))
    (i32.const 32))
)
"#;

/// `BREAKER` as a component of the `filter` world.
fn breaker() -> Vec<u8> {
    let mut resolve = wit_parser::Resolve::default();
    let package = resolve
        .push_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../wit"))
        .unwrap()
        .0;
    let world = resolve.select_world(&[package], Some("filter")).unwrap();
    let mut module = wat::parse_str(BREAKER).unwrap();
    wit_component::embed_component_metadata(
        &mut module,
        &resolve,
        world,
        wit_component::StringEncoding::UTF8,
    )
    .unwrap();
    wit_component::ComponentEncoder::default()
        .validate(true)
        .module(&module)
        .unwrap()
        .encode()
        .unwrap()
}

#[test_case::test_case(true; "as a core instance")]
#[test_case::test_case(false; "through component calls")]
fn a_guest_that_breaks_the_abi_faults_and_the_next_request_is_served(core: bool) {
    let rt = runtime_with(core);
    let filter = rt
        .load_filter(
            // Its fault is the ABI's, not the deadline's.
            FilterSettings::new("breaker", "").deadline(Duration::from_secs(2)),
            &breaker(),
        )
        .expect("the hand-written component loads");
    assert_eq!(filter.runs_as_core(), core);
    let mut runner = ChainRunner::new(Arc::new(FilterChain::new("c", vec![filter])));
    let cases = [
        ("/oob", "out of bounds"),
        ("/utf8", "UTF-8"),
        ("/handle", "handle"),
        ("/ret", "unaligned"),
        ("/keep", "borrow"),
        ("/batch", "UTF-8"),
    ];
    for (path, why) in cases {
        let outcome = runner.on_request(get(path));
        let Decision::Deny { reply, .. } = &outcome.decision else {
            panic!("{path}: a broken call must not let the request through");
        };
        assert_eq!(reply.status, 500, "{path}: fail-closed");
        let [fault] = outcome.faults.as_slice() else {
            panic!("{path}: one fault, got {:?}", outcome.faults);
        };
        let FaultKind::Trap(message) = &fault.kind else {
            panic!("{path}: a trap, got {:?}", fault.kind);
        };
        // A list is checked whole before the host acts on it: no entry of the
        // malformed batch reached the head, not even the well-formed first one.
        assert_eq!(outcome.head.metadata("a"), None, "{path}");
        if core || path == "/keep" {
            // Component calls word the others their own way.
            assert!(message.contains(why), "{path}: {message}");
        }
        let next = runner.on_request(get("/fine"));
        assert!(
            matches!(next.decision, Decision::Continue) && next.faults.is_empty(),
            "{path}: the next request gets a fresh instance: {:?}",
            next.faults
        );
    }
}

/// A filter built for 0.1.3 is entered through `on-request-head`: the request line is
/// copied into its memory only when it reads it. A path larger than the filter's
/// memory cap passes a filter that never reads it, and fails closed one that does.
#[test]
fn the_line_reaches_a_core_filter_only_if_it_reads_it() {
    let rt = runtime_with(true);
    let huge = format!("/{}", "a".repeat(6 << 20));
    let run = |config: serde_json::Value| {
        let filter = load(&rt, settings("f", config).memory_cap(4 << 20));
        assert!(filter.runs_as_core());
        ChainRunner::new(Arc::new(FilterChain::new("c", vec![filter]))).on_request(get(&huge))
    };
    let blind = run(json!({"request": [{"set_metadata": ["seen", "1"]}]}));
    assert_eq!(blind.decision, Decision::Continue, "{:?}", blind.faults);
    assert_eq!(blind.head.metadata("seen"), Some("1"));
    let reader = run(json!({"request": ["describe"]}));
    let Decision::Deny { reply, .. } = &reader.decision else {
        panic!("a filter reading a path over its cap let it through");
    };
    assert_eq!(reply.status, 500, "fail-closed");
    assert!(
        matches!(reader.faults.as_slice(), [f] if matches!(f.kind, FaultKind::MemoryCap(_))),
        "{:?}",
        reader.faults
    );
}

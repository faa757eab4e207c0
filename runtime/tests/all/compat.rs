//! WIT 0.1.1 next to 0.1.0: a component built for 0.1.0 (kept as built) loads and
//! decides exactly as the same filter built for 0.1.1, both as core instances and
//! through component calls (where the 0.1.1 one takes the batched call); and the
//! batched call's input reads back as it was written.

use std::sync::Arc;
use std::time::Duration;

use dpumesh_runtime::{ChainRunner, Decision, FilterChain, FilterSettings, RequestHead};
use dpumesh_test_artifacts as artifacts;
use serde_json::json;

use crate::support::{get, runtime_with};

const FIXTURE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../tests/fixtures/components/guard-wit-0.1.0.wasm"
);

fn guard_config() -> String {
    json!({
        "rules": [
            {"name": "health", "path_prefix": "/healthz", "action": "allow"},
            {"name": "admin", "path_prefix": "/admin",
             "header": {"name": "x-role", "value": "admin"}, "action": "allow"},
            {"name": "admin-other", "path_prefix": "/admin", "action": "deny"}
        ],
        "default": "allow"
    })
    .to_string()
}

/// Status (200 for continue) and the `x-guard` header after the chain.
fn run(runner: &mut ChainRunner, head: RequestHead) -> (u16, Option<String>) {
    let outcome = runner.on_request(head);
    assert!(outcome.faults.is_empty(), "{:?}", outcome.faults);
    let status = match &outcome.decision {
        Decision::Continue => 200,
        Decision::Deny { reply, .. } => reply.status,
        Decision::Pause { .. } => panic!("a component never pauses"),
    };
    (status, outcome.head.header("x-guard"))
}

#[test_case::test_case(true; "as core instances")]
#[test_case::test_case(false; "through component calls")]
fn a_component_built_for_0_1_0_runs_as_the_same_filter_built_for_0_1_1(core: bool) {
    let rt = runtime_with(core);
    let old = rt
        .load_filter(
            // A generous deadline: this test is about the interface, and emulated
            // runs (aarch64 under qemu) take a guest's first calls past 5 ms.
            FilterSettings::new("guard-0.1.0", guard_config()).deadline(Duration::from_secs(1)),
            &std::fs::read(FIXTURE).unwrap(),
        )
        .expect("a 0.1.0 component still loads");
    let new = rt
        .load_filter(
            FilterSettings::new("guard-0.1.1", guard_config()).deadline(Duration::from_secs(1)),
            &artifacts::read(artifacts::SAMPLE_GUARD),
        )
        .unwrap();
    assert!(!old.is_batched(), "0.1.0 has no handle-request");
    if core {
        assert!(
            old.runs_as_core(),
            "0.1.0 is served the 0.1.2 core functions"
        );
        assert!(new.runs_as_core());
        assert!(!new.is_batched(), "host calls are cheap as core calls");
    } else {
        assert!(!old.runs_as_core() && !new.runs_as_core());
        assert!(new.is_batched(), "the Rust SDK builds batched filters");
    }
    let mut old = ChainRunner::new(Arc::new(FilterChain::new("old", vec![old])));
    let mut new = ChainRunner::new(Arc::new(FilterChain::new("new", vec![new])));
    let admin = || {
        let mut h = get("/admin/users");
        h.append_received("x-role", "admin").unwrap();
        h
    };
    let cases = [
        (get("/healthz"), (200, Some("health".to_owned()))),
        (admin(), (200, Some("admin".to_owned()))),
        (get("/admin/users"), (403, None)),
        (get("/other"), (200, None)),
    ];
    for (head, want) in cases {
        let path = head.path.clone();
        assert_eq!(run(&mut old, head.clone()), want, "0.1.0 on {path}");
        assert_eq!(run(&mut new, head), want, "0.1.1 on {path}");
    }
}

#[test]
fn the_batched_input_reads_back_as_written() {
    use dpumesh_filter_sdk::input::Input;
    let mut head = RequestHead::new("PROPFIND", "/a/b");
    head.authority = "api.example.com:8443".to_owned();
    head.scheme = "https".to_owned();
    head.query = Some("x=1&y=%20".to_owned());
    head.destination = Some("reservation".to_owned());
    head.source.addr = "10.1.2.3:4567".parse().unwrap();
    head.source.identity = Some("spiffe://td/ns/default/sa/frontend".to_owned());
    head.append_received("x-multi", "one").unwrap();
    head.append_received("x-multi", "two").unwrap();
    head.append_received("x-multi", "").unwrap();
    head.set_metadata("multi.line", "a\nb");
    head.set_metadata("jwt.claim.sub", "alice");
    let headers = ["x-multi".to_owned(), "absent".to_owned()];
    let metadata = [
        "jwt.claim.sub".to_owned(),
        "nope".to_owned(),
        "multi.line".to_owned(),
    ];
    let shared = dpumesh_runtime::input::Shared::new(&head, 1_700_000_000_000_000_000, 42);
    let mut bytes = Vec::new();
    dpumesh_runtime::input::encode(&mut bytes, &head, &shared, &headers, &metadata);
    let input = Input::decode(&bytes, 2, 3).expect("reads back");
    assert_eq!(input.method(), "PROPFIND");
    assert_eq!(input.line().scheme.as_str(), "https");
    assert_eq!(input.authority(), "api.example.com:8443");
    assert_eq!(input.path(), "/a/b");
    assert_eq!(input.query(), Some("x=1&y=%20"));
    assert_eq!(input.destination(), Some("reservation"));
    assert_eq!(input.source_address(), "10.1.2.3");
    assert_eq!(input.source_port, 4567);
    assert_eq!(
        input.source_identity(),
        Some("spiffe://td/ns/default/sa/frontend")
    );
    assert_eq!(
        (input.wall_ns, input.monotonic_ns),
        (1_700_000_000_000_000_000, 42)
    );
    assert_eq!(input.header(0).collect::<Vec<_>>(), ["one", "two", ""]);
    assert_eq!(input.header(1).count(), 0);
    assert_eq!(input.metadata(0), Some("alice"));
    assert_eq!(input.metadata(1), None);
    assert_eq!(
        input.metadata(2),
        Some("a\nb"),
        "metadata may hold newlines"
    );
    // Declared counts that do not match the bytes are refused, not guessed at.
    assert!(Input::decode(&bytes, 1, 3).is_err());
    // A field that runs past the text reads as absent, never as other bytes.
    let cut = Input::decode(&bytes[..bytes.len() - 1], 2, 3).expect("the rest is readable");
    assert_eq!(cut.metadata(2), None);
    assert_eq!(cut.path(), "/a/b");
}

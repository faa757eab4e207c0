//! Chain semantics: order, first deny wins, reverse response phase, metadata and
//! header edits flowing downstream.

use dpumesh_runtime::{ChainRunner, Decision, DenyCause, FailureKind, ResponseInfo};
use serde_json::json;

use crate::support::{chain, get, runtime, settings};

fn tagged(tag: &str, extra: serde_json::Value) -> dpumesh_runtime::FilterSettings {
    let mut request = vec![json!({"append_header": ["x-order", tag]})];
    if let serde_json::Value::Array(more) = extra {
        request.extend(more);
    }
    settings(
        tag,
        json!({"tag": tag, "request": request, "response": [{"record_order": "resp"}]}),
    )
}

#[test]
fn filters_run_in_order_and_the_first_deny_wins() {
    let rt = runtime();
    let chain = chain(
        &rt,
        vec![
            tagged("a", json!([])),
            tagged("b", json!([{"deny_if_header": ["x-deny", 401]}])),
            tagged("c", json!([{"deny_if_header": ["x-deny", 403]}])),
        ],
    );
    let mut runner = ChainRunner::new(chain);

    let outcome = runner.on_request(get("/"));
    assert_eq!(outcome.decision, Decision::Continue);
    assert_eq!(outcome.ran, 3);
    assert_eq!(outcome.head.header_all("x-order"), vec!["a", "b", "c"]);

    let mut head = get("/");
    head.append_received("x-deny", "1").unwrap();
    let outcome = runner.on_request(head);
    let Decision::Deny {
        filter,
        reply,
        cause,
    } = &outcome.decision
    else {
        panic!("expected a denial, got {:?}", outcome.decision);
    };
    assert_eq!(&**filter, "b");
    assert_eq!(*cause, DenyCause::Policy);
    assert_eq!(reply.status, 401);
    assert_eq!(reply.header("x-denied-by"), Some("b"));
    // c never ran.
    assert_eq!(outcome.ran, 2);
    assert_eq!(outcome.head.header_all("x-order"), vec!["a", "b"]);
}

#[test]
fn response_phase_runs_in_reverse_for_filters_that_ran() {
    let rt = runtime();
    let chain = chain(
        &rt,
        vec![
            tagged("a", json!([])),
            tagged("b", json!([])),
            tagged("c", json!([{"deny_if_header": ["x-deny", 401]}])),
            tagged("d", json!([])),
        ],
    );
    let mut runner = ChainRunner::new(chain);
    let mut head = get("/");
    head.append_received("x-deny", "1").unwrap();
    let outcome = runner.on_request(head);
    assert_eq!(outcome.ran, 3);
    let info = ResponseInfo {
        status: 401,
        latency_ns: 1000,
        upstream: None,
        failure: FailureKind::LocalReply,
    };
    let (_, faults) = runner.on_response(outcome.head, &info, outcome.ran);
    assert!(faults.is_empty(), "{faults:?}");
    let ns = rt.shared_state().namespace("test");
    let seq = |tag: &str| ns.get(&format!("resp-{tag}")).unwrap();
    assert_eq!((seq("c"), seq("b"), seq("a")), (Some(1), Some(2), Some(3)));
    assert_eq!(
        seq("d"),
        None,
        "d's on-request never ran, so its on-response must not"
    );
}

#[test]
fn metadata_and_header_edits_flow_downstream() {
    let rt = runtime();
    let chain = chain(
        &rt,
        vec![
            settings(
                "producer",
                json!({"request": [
                    {"set_metadata": ["jwt.sub", "bob"]},
                    {"set_metadata": ["jwt.sub", "alice"]},
                    // A filter reads its own writes (the SDK sends them when it returns).
                    {"metadata_to_header": ["jwt.sub", "x-own"]},
                    {"set_header": ["x-added", "1"]},
                    {"remove_header": "x-secret"},
                    {"set_header": ["x-replaced", "new"]},
                ]}),
            ),
            settings(
                "consumer",
                json!({"request": [
                    {"require_metadata": "jwt.sub"},
                    {"metadata_to_header": ["jwt.sub", "x-user"]},
                    {"deny_if_header": ["x-secret", 400]},
                    {"join_headers": ["x-added", "x-replaced", "x-missing"]},
                ]}),
            ),
        ],
    );
    let mut runner = ChainRunner::new(chain);
    let mut head = get("/");
    head.append_received("x-secret", "s3cret").unwrap();
    head.append_received("x-replaced", "old").unwrap();
    head.append_received("x-replaced", "older").unwrap();
    let outcome = runner.on_request(head);
    assert_eq!(
        outcome.decision,
        Decision::Continue,
        "{:?}",
        outcome.decision
    );
    assert_eq!(outcome.head.header("x-user").as_deref(), Some("alice"));
    assert_eq!(outcome.head.header("x-secret"), None);
    assert_eq!(outcome.head.header_all("x-replaced"), vec!["new"]);
    assert_eq!(outcome.head.header("x-joined").as_deref(), Some("1,new,-"));
    assert_eq!(outcome.head.metadata("jwt.sub"), Some("alice"));
    assert_eq!(outcome.head.header("x-own").as_deref(), Some("alice"));
    assert_eq!(outcome.head.metadata_entries().len(), 1);

    // Without the producer, the consumer denies: the metadata really came from it.
    let alone = crate::support::chain(
        &rt,
        vec![settings(
            "consumer",
            json!({"request": [{"require_metadata": "jwt.sub"}]}),
        )],
    );
    let outcome = ChainRunner::new(alone).on_request(get("/"));
    assert_eq!(outcome.decision.reply().map(|r| r.status), Some(403));
}

#[test]
fn filters_see_query_source_destination_and_line() {
    let rt = runtime();
    let chain = chain(&rt, vec![settings("d", json!({"request": ["describe"]}))]);
    let mut head = get("/api/items?id=7&x=y");
    head.source.addr = "10.1.2.3:4567".parse().unwrap();
    head.source.identity = Some("spiffe://cluster.local/ns/default/sa/web".to_owned());
    head.destination = Some("items.default".to_owned());
    let outcome = ChainRunner::new(chain).on_request(head);
    let h = |n: &str| outcome.head.header(n).unwrap_or_default();
    assert_eq!(h("x-query"), "id=7&x=y");
    assert_eq!(h("x-source"), "10.1.2.3:4567");
    assert_eq!(h("x-identity"), "spiffe://cluster.local/ns/default/sa/web");
    assert_eq!(h("x-destination"), "items.default");
    assert_eq!(h("x-line"), "GET http api.example.com /api/items");
}

#[test]
fn proxy_owned_headers_cannot_be_edited() {
    let rt = runtime();
    let chain = chain(
        &rt,
        vec![settings(
            "e",
            json!({"request": [{"try_set_header": ["Content-Length", "0"]}]}),
        )],
    );
    let mut head = get("/");
    head.append_received("content-length", "12").unwrap();
    let outcome = ChainRunner::new(chain).on_request(head);
    assert_eq!(
        outcome.head.header("x-edit-result").as_deref(),
        Some("ReadOnly")
    );
    assert_eq!(outcome.head.header("content-length").as_deref(), Some("12"));
}

#[test]
fn the_sample_guard_filter_runs_in_the_runtime() {
    let rt = runtime();
    let config = json!({"rules": [
        {"name": "admin", "path_prefix": "/admin", "header": {"name": "x-role", "value": "admin"}, "action": "allow"},
        {"name": "admin-other", "path_prefix": "/admin", "action": "deny"}
    ]});
    let guard = rt
        .load_filter(
            dpumesh_runtime::FilterSettings::new("guard", config.to_string())
                .deadline(std::time::Duration::from_secs(2)),
            &dpumesh_test_artifacts::read(dpumesh_test_artifacts::SAMPLE_GUARD),
        )
        .unwrap();
    let mut runner = ChainRunner::new(std::sync::Arc::new(dpumesh_runtime::FilterChain::new(
        "g",
        vec![guard],
    )));
    let mut admin = get("/admin/users");
    admin.append_received("x-role", "admin").unwrap();
    let outcome = runner.on_request(admin);
    assert_eq!(outcome.decision, Decision::Continue);
    assert_eq!(outcome.head.header("x-guard").as_deref(), Some("admin"));
    let outcome = runner.on_request(get("/admin/users"));
    let reply = outcome.decision.reply().expect("denied");
    assert_eq!(reply.status, 403);
    assert!(reply.body.contains("admin-other"));
}

#[test]
fn replacing_a_key_set_takes_effect_at_once_even_for_cached_tokens() {
    use dpumesh_keys::KeySet;

    let rt = runtime();
    rt.keys().insert(
        "shared",
        KeySet::from_secret(None, b"first-secret-0123456789abcdef"),
    );
    let config = json!({
        "providers": {"p": {"algorithms": ["HS256"], "key_set": "shared", "clock_skew_secs": 0}},
        "rules": [{"path_prefix": "/", "provider": "p"}],
    });
    let jwt = rt
        .load_filter(
            dpumesh_runtime::FilterSettings::new("jwt", config.to_string())
                .deadline(std::time::Duration::from_secs(2)),
            &dpumesh_test_artifacts::read(dpumesh_test_artifacts::FILTER_JWT),
        )
        .unwrap();
    let mut runner = ChainRunner::new(std::sync::Arc::new(dpumesh_runtime::FilterChain::new(
        "j",
        vec![jwt],
    )));
    let exp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 3600;
    let token = jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &json!({"sub": "alice", "exp": exp}),
        &jsonwebtoken::EncodingKey::from_secret(b"first-secret-0123456789abcdef"),
    )
    .unwrap();
    let request = || {
        let mut head = get("/");
        head.append_received("authorization", &format!("Bearer {token}"))
            .unwrap();
        head
    };
    // Verified, then served from the filter's cache.
    for _ in 0..2 {
        let outcome = runner.on_request(request());
        assert_eq!(
            outcome.decision,
            Decision::Continue,
            "{:?}",
            outcome.decision
        );
        assert_eq!(outcome.head.metadata("jwt.claim.sub"), Some("alice"));
    }
    // Rotate the key: the cached verification must not outlive the old key.
    rt.keys().insert(
        "shared",
        KeySet::from_secret(None, b"second-secret-0123456789abcdef"),
    );
    let outcome = runner.on_request(request());
    let reply = outcome.decision.reply().expect("refused after rotation");
    assert_eq!(reply.status, 401);
    assert!(
        reply
            .header("www-authenticate")
            .unwrap()
            .contains("verification fails")
    );
}

#[test]
fn filter_counters_reach_the_proxy_recorder() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        let rt = runtime();
        let trace = rt
            .load_filter(
                settings("trace", json!({})),
                &dpumesh_test_artifacts::read(dpumesh_test_artifacts::FILTER_TRACE),
            )
            .unwrap();
        let mut runner = ChainRunner::new(std::sync::Arc::new(dpumesh_runtime::FilterChain::new(
            "traced",
            vec![trace],
        )));
        // No ids: two counters per request (one batch). A valid traceparent and request
        // id: none.
        for _ in 0..5 {
            runner.on_request(get("/"));
        }
        let mut head = get("/");
        head.append_received("x-request-id", "abc").unwrap();
        head.append_received(
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        )
        .unwrap();
        runner.on_request(head);
    });
    // A snapshot drains counters, so take one.
    let snapshot = snapshotter.snapshot().into_vec();
    let counter = |name: &str| {
        snapshot
            .iter()
            .find(|(key, ..)| {
                key.key().name() == name
                    && key
                        .key()
                        .labels()
                        .any(|l| l.key() == "filter" && l.value() == "trace")
            })
            .map(|(.., value)| match value {
                DebugValue::Counter(n) => *n,
                other => panic!("{name} is not a counter: {other:?}"),
            })
    };
    assert_eq!(counter("trace_request_ids_generated_total"), Some(5));
    assert_eq!(counter("trace_new_traces_total"), Some(5));
}

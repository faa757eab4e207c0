//! `request-head.claims` (WIT 0.1.2): the proxy hands a filter the verified claims it
//! names, typed, from the payload an earlier filter left, and keeps it parsed.

use dpumesh_runtime::{ChainRunner, Decision};
use serde_json::json;

use crate::support::{chain, get, runtime, settings};

const PAYLOAD: &str = r#"{"sub":"alice","roles":["user","admin"],"scope":"read write","exp":1700000000,"org":{"id":42,"name":"acme"},"mixed":["a",1]}"#;
const NAMES: [&str; 7] = [
    "sub", "roles", "exp", "org.id", "org.name", "mixed", "missing",
];
const WANT: &str = "text:alice;list:user|admin;json:1700000000;json:42;text:acme;json:[\"a\",1];-";

fn reader(interest: &[&str]) -> dpumesh_runtime::FilterSettings {
    settings(
        "reader",
        json!({"request": [{"claims": NAMES}], "interest": interest}),
    )
}

fn writer(payload: &str) -> dpumesh_runtime::FilterSettings {
    settings(
        "writer",
        json!({"request": [{"set_metadata": ["jwt.payload", payload]}]}),
    )
}

fn claims_header(runner: &mut ChainRunner) -> String {
    let outcome = runner.on_request(get("/"));
    assert_eq!(
        outcome.decision,
        Decision::Continue,
        "{:?}",
        outcome.decision
    );
    outcome.head.header("x-claims").expect("the reader ran")
}

#[test]
fn a_filter_reads_the_claims_it_names_typed() {
    let rt = runtime();
    // Both ways a filter is called: `on-request`, and the batched call (the reader
    // declares a header, so the proxy hands it in and uses `handle-request`).
    for interest in [&[][..], &["x-anything"][..]] {
        let mut runner = ChainRunner::new(chain(&rt, vec![writer(PAYLOAD), reader(interest)]));
        assert_eq!(claims_header(&mut runner), WANT, "interest {interest:?}");
        // The same payload again (a cached token): the same answer.
        assert_eq!(claims_header(&mut runner), WANT, "interest {interest:?}");
    }
}

#[test]
fn no_verified_payload_means_no_claims() {
    let rt = runtime();
    let mut alone = ChainRunner::new(chain(&rt, vec![reader(&[])]));
    assert_eq!(claims_header(&mut alone), "none");
    // A payload that is not a JSON object is no verified token (as RBAC always held).
    for payload in ["[1,2]", "\"alice\"", "{broken", ""] {
        let mut runner = ChainRunner::new(chain(&rt, vec![writer(payload), reader(&[])]));
        assert_eq!(claims_header(&mut runner), "none", "{payload:?}");
    }
}

/// A filter that writes the payload and reads claims in the same call reads what it
/// wrote (its metadata is still pending in the guest when it asks), in both call forms.
#[test]
fn a_filter_reads_claims_of_the_payload_it_just_wrote() {
    let rt = runtime();
    for interest in [&[][..], &["x-anything"][..]] {
        let both = settings(
            "both",
            json!({
                "request": [
                    {"set_metadata": ["jwt.payload", "{\"sub\":\"old\"}"]},
                    {"set_metadata": ["other", "1"]},
                    {"set_metadata": ["jwt.payload", PAYLOAD]},
                    {"claims": NAMES},
                    {"set_metadata": ["later", "2"]},
                ],
                "interest": interest,
            }),
        );
        let mut runner = ChainRunner::new(chain(&rt, vec![both]));
        let outcome = runner.on_request(get("/"));
        assert_eq!(outcome.head.header("x-claims").as_deref(), Some(WANT));
        // Sending the pending entries early changed nothing of the metadata.
        assert_eq!(outcome.head.metadata("jwt.payload"), Some(PAYLOAD));
        assert_eq!(outcome.head.metadata("other"), Some("1"));
        assert_eq!(outcome.head.metadata("later"), Some("2"));
        assert_eq!(outcome.head.metadata_entries().len(), 3);
    }
}

//! Fused chains: the same chain composed into one component behaves as the chain of
//! separate instances (order, denials, edits, metadata, the response phase, faults
//! and failure policies), with each filter's identity and limits its own.

use std::sync::Arc;

use dpumesh_runtime::{ChainRunner, Decision, FilterChain};
use serde_json::json;

use crate::support::{get, load, runtime, settings};

#[test]
fn a_fused_chain_runs_its_filters_in_order_and_the_first_deny_wins() {
    let rt = runtime();
    let filters = ["a", "b", "c"]
        .iter()
        .map(|tag| {
            load(
                &rt,
                settings(
                    tag,
                    json!({"tag": tag, "request": [
                        {"append_header": ["x-order", tag]},
                        {"deny_if_header": [format!("x-deny-{tag}"), 403]}
                    ]}),
                ),
            )
        })
        .collect();
    let chain = FilterChain::new("fused", filters).fuse().expect("fuses");
    assert!(chain.is_fused());
    let mut runner = ChainRunner::new(Arc::new(chain));
    let outcome = runner.on_request(get("/"));
    assert_eq!(outcome.decision, Decision::Continue);
    assert_eq!(outcome.head.header_all("x-order"), vec!["a", "b", "c"]);

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

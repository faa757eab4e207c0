//! gRPC through the mesh, driven as a platform team would: gRPC's interop cases from
//! a real client (tonic's, `grpc-interop client`) to a tonic server that is a mesh pod
//! (`grpc-interop pod`, served by the host library's tower adapter), over h2c to the
//! ingress, through the node's chain and back with its trailers; a denial answered as
//! gRPC; the gRPC statuses a route retries on; and what a proxy must refuse (a call
//! without `te: trailers`, a message past the server's limit).

mod common;

use std::net::SocketAddr;
use std::process::Command;

use common::grpc::{interop, run_cases};
use common::mesh::{Mesh, mesh_files_with, metric_sum};
use common::token;

/// Runs the interop client against the mesh's ingress as the `grpc` service.
fn client(ingress: SocketAddr, token: Option<&str>, cases: &[&str]) -> (bool, String) {
    run_cases(ingress, "grpc", token, cases)
}

/// The hotel mesh with the interop service on node2, reached at the virtual host
/// `grpc` through a chain that wants a token of a user (JWT, then RBAC on the gRPC
/// service's path), retrying UNAVAILABLE twice.
fn grpc_mesh() -> Mesh {
    let dir = tempfile::tempdir().unwrap();
    let edit_mesh = |m: String| {
        m.replacen(
            "services:\n",
            "services:\n  grpc: {nodes: [node2], command: [grpc-interop, pod]}\n",
            1,
        )
    };
    let edit_policy = |p: String| {
        let p = p.replacen(
            "        - name: guests\n",
            "        - name: grpc-users\n          permissions: [{path: {prefix: /grpc.testing.TestService/}}]\n          principals: [{claim: {name: roles, contains: user}}]\n        - name: guests\n",
            1,
        );
        let p = p.replacen("chains:\n", "chains:\n  grpc: [jwt, rbac]\n", 1);
        let p = p.replacen(
            "services:\n",
            "services:\n  grpc: {chain: grpc, retries: {attempts: 2, grpc_on: [unavailable]}}\n",
            1,
        );
        p.replacen("routes:\n", "routes:\n  - {host: grpc, service: grpc}\n", 1)
    };
    let (file, ingress) = mesh_files_with(dir.path(), edit_mesh, edit_policy);
    Mesh::start(dir, &file, ingress)
}

/// gRPC's interop cases (`grpc-interop client`'s `CASES`).
const INTEROP_CASES: [&str; 12] = [
    "empty_unary",
    "large_unary",
    "client_streaming",
    "server_streaming",
    "ping_pong",
    "empty_stream",
    "status_code_and_message",
    "custom_metadata",
    "unimplemented_method",
    "timeout_on_sleeping_server",
    "cancel_after_begin",
    "cancel_after_first_response",
];

#[test]
fn grpc_through_the_mesh() {
    let _ = interop();
    let mesh = grpc_mesh();
    let user = token("alice", &["user"]);
    let node2 = mesh.admins[1];

    // Every case of gRPC's interop suite, trailers and metadata both ways; the
    // request streams of `client_streaming`, `ping_pong` and
    // `cancel_after_first_response` flow as the client sends them (answers come
    // while the request stream is open).
    let (ok, report) = client(mesh.ingress, Some(&user), &INTEROP_CASES);
    assert!(ok, "{report}");
    let by_status = |code: u32| {
        metric_sum(
            node2,
            &format!(
                "dpumesh_mesh_grpc_responses_total{{service=\"grpc\",grpc_status=\"{code}\"}}"
            ),
        )
    };
    assert!(by_status(0) >= 6.0, "OK answers counted by gRPC status");
    assert!(by_status(2) >= 2.0, "UNKNOWN (status_code_and_message)");
    assert!(by_status(12) >= 1.0, "UNIMPLEMENTED");
    // A call's deadline bounds the wait for its request stream at the ingress: a
    // client that keeps its stream open past `grpc-timeout` is DEADLINE_EXCEEDED.
    let (ok, report) = client(mesh.ingress, Some(&user), &["deadline_with_open_stream"]);
    assert!(ok, "{report}");

    // A filter's denial is UNAUTHENTICATED, not an HTTP 401 the client cannot read.
    let (ok, report) = client(mesh.ingress, None, &["unauthenticated"]);
    assert!(ok, "{report}");
    let (ok, report) = client(mesh.ingress, None, &["empty_unary"]);
    assert!(
        !ok && report.contains("does not have valid authentication credentials")
            && report.contains("Jwt is missing"),
        "UNAUTHENTICATED with the filter's reason: {report}"
    );

    // UNAVAILABLE is tried again twice (the route says so), then reaches the client.
    let retries = metric_sum(node2, "dpumesh_retries_total");
    let (ok, report) = client(mesh.ingress, Some(&user), &["unary_unavailable"]);
    assert!(ok, "{report}");
    assert_eq!(metric_sum(node2, "dpumesh_retries_total") - retries, 2.0);

    // A message past the server's limit is refused with its reason (the mesh
    // streams it: no ingress limit on a route that does not buffer), and the mesh
    // serves on.
    let (ok, report) = client(
        mesh.ingress,
        Some(&user),
        &["oversized_request", "empty_unary"],
    );
    assert!(ok, "{report}");

    // A gRPC call without `te: trailers` is refused with the reason, as gRPC.
    let out = Command::new("curl")
        .args(["-s", "-i", "--http2-prior-knowledge", "-X", "POST"])
        .args(["-H", "content-type: application/grpc", "-H", "host: grpc"])
        .args(["-H", &format!("authorization: Bearer {user}")])
        .arg(format!(
            "http://{}/grpc.testing.TestService/EmptyCall",
            mesh.ingress
        ))
        .args(["--data-binary", ""])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_lowercase();
    assert!(
        text.starts_with("http/2 200")
            && text.contains("grpc-status: 13")
            && text.contains("te: trailers"),
        "{text}"
    );
}

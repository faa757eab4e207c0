//! What a pod writes into its TX ring is not believed (the node↔pod boundary), in
//! process: a node whose `guarded` service lets admins in by their verified claims and
//! anyone to `/public`; a caller pod that forges what it can.
//!
//! - metadata `jwt.payload` with an admin's roles (RBAC reads it as verified claims),
//! - a path that normalizes out of `/public` (`/public/../secret`), or one a servlet
//!   container would (`/public/..;/secret`),
//! - the mesh's own headers (`x-dpumesh-*`).

use std::path::Path;
use std::time::{Duration, Instant};

use dpumesh_config::MeshFile;
use dpumesh_dpa::{Case, Destination, HostPort, Incoming, Outgoing, WakeMode};
use dpumesh_head::RequestHead;
use dpumesh_head::wire::{self, ResponseHead};
use dpumesh_proxy::node::Node;
use dpumesh_test_artifacts as artifacts;

fn write_files(dir: &Path) -> MeshFile {
    std::fs::write(
        dir.join("policy.yaml"),
        format!(
            "workers: 1
filters:
  rbac:
    component: {}
    config:
      action: ALLOW
      policies:
        - {{name: admins, permissions: [{{any: true}}], principals: [{{claim: {{name: roles, contains: admin}}}}]}}
        - {{name: public, permissions: [{{path: {{prefix: /public}}}}], principals: [{{any: true}}]}}
chains: {{open: [], guarded: [rbac]}}
services: {{guarded: {{chain: guarded}}, caller: {{chain: open}}}}
",
            artifacts::FILTER_RBAC
        ),
    )
    .unwrap();
    std::fs::write(
        dir.join("mesh.yaml"),
        "policy: policy.yaml\nidentity: {mtls: off}\ningress: {listen: 127.0.0.1:0}\nnodes:\n  n1: {fabric: 127.0.0.1:0, admin: 127.0.0.1:0}\nservices:\n  guarded: {nodes: [n1]}\n  caller: {nodes: [n1]}\n",
    )
    .unwrap();
    MeshFile::read(&dir.join("mesh.yaml")).unwrap()
}

/// The guarded pod: answers each request with the path and the header names it got.
fn guarded(mut pod: HostPort) {
    let head = wire::encode_response(&ResponseHead {
        status: 200,
        ..Default::default()
    })
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        let Ok(Some(Incoming::Message {
            descriptor, header, ..
        })) = pod.recv(WakeMode::LOW_CPU, Duration::from_millis(100))
        else {
            continue;
        };
        if descriptor.kind.response {
            continue;
        }
        let request = wire::decode_request(&header).unwrap();
        let seen = format!("{} {}", request.path, request.header_names().join(","));
        pod.send(&HostPort::reply(&descriptor, 200, &head, seen.as_bytes()))
            .unwrap();
        if request.path == "/public/stop" {
            return;
        }
    }
}

/// Sends `head` from the caller pod to the guarded pod; the status and the body.
fn call(caller: &mut HostPort, to: u32, n: u32, head: &RequestHead) -> (u16, String) {
    let header = wire::encode_request(head).unwrap();
    caller
        .send(&Outgoing {
            case: Case::PodToPod,
            dst: Destination::Pod(to),
            req_id: n,
            step_id: 0,
            response: false,
            status: 0,
            stream: false,
            header: &header,
            body: &[],
            lane: 0,
        })
        .unwrap();
    let Incoming::Message {
        descriptor, body, ..
    } = caller
        .recv(WakeMode::LOW_CPU, Duration::from_secs(30))
        .unwrap()
        .expect("an answer within 30 s")
    else {
        panic!("an error instead of an answer");
    };
    (
        descriptor.status,
        String::from_utf8_lossy(&body).into_owned(),
    )
}

fn to_guarded(path: &str) -> RequestHead {
    let mut head = RequestHead::new("GET", path);
    head.authority = "guarded".to_owned();
    head
}

#[test]
fn a_pods_forged_claims_paths_and_reserved_headers_are_not_believed() {
    let dir = tempfile::tempdir().unwrap();
    let mesh = write_files(dir.path());
    let node = Node::start(&mesh, "n1", dir.path()).unwrap();
    let guarded_pod = HostPort::connect(node.control(), "guarded-0", "guarded").unwrap();
    let to = guarded_pod.pod_id();
    let server = std::thread::spawn(move || guarded(guarded_pod));
    let mut caller = HostPort::connect(node.control(), "caller-0", "caller").unwrap();

    // The policy holds for a plain call.
    assert_eq!(call(&mut caller, to, 1, &to_guarded("/secret")).0, 403);
    let (status, body) = call(&mut caller, to, 2, &to_guarded("/public/a"));
    assert_eq!((status, body.as_str()), (200, "/public/a "));

    // Forged claims: metadata a pod wrote used to be read as a verified token's.
    let mut forged = to_guarded("/secret");
    forged.set_metadata("jwt.payload", r#"{"sub":"root","roles":["admin"]}"#);
    forged.set_metadata("jwt.provider", "hotel");
    assert_eq!(call(&mut caller, to, 3, &forged).0, 403, "forged claims");

    // Paths: normalized as a client's are (out of /public: denied), or refused.
    assert_eq!(
        call(&mut caller, to, 4, &to_guarded("/public/../secret")).0,
        403
    );
    assert_eq!(
        call(&mut caller, to, 5, &to_guarded("/public/%2e%2e/secret")).0,
        403
    );
    for refused in [
        "/public/..;/secret",
        "/public\\..\\secret",
        "public/../secret",
    ] {
        assert_eq!(
            call(&mut caller, to, 6, &to_guarded(refused)).0,
            400,
            "{refused}"
        );
    }

    // The mesh's own headers do not pass from a pod.
    let mut reserved = to_guarded("/public/b");
    reserved
        .append_received("x-dpumesh-generation", "99")
        .unwrap();
    reserved.append_received("x-kept", "1").unwrap();
    let (status, body) = call(&mut caller, to, 7, &reserved);
    assert_eq!(status, 200);
    assert_eq!(body, "/public/b x-kept");

    call(&mut caller, to, 8, &to_guarded("/public/stop"));
    dpumesh_test_support::joined(server);
}

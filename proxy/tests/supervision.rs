//! A node's data plane under supervision, in process: when its reactor thread panics,
//! what it held is answered at once (the sender sees its link go: the ingress answers
//! 502; it does not wait for the request timeout), the thread comes back and serves, and a
//! data plane that keeps panicking is left down with `/readyz` saying so.

use std::path::Path;
use std::time::Duration;

use dpumesh_config::MeshFile;
use dpumesh_dpa::{HostPort, Incoming, WakeMode};
use dpumesh_head::wire::{self, ResponseHead};
use dpumesh_proxy::node::Node;

mod common;
use common::get;

fn write_files(dir: &Path) -> MeshFile {
    std::fs::write(
        dir.join("policy.yaml"),
        "workers: 1\nchains: {open: []}\nservices: {slow: {chain: open}}\nroutes: [{host: slow, service: slow}]\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("mesh.yaml"),
        "policy: policy.yaml\nidentity: {mtls: off}\ningress: {listen: 127.0.0.1:0, request_timeout: 60s}\nnodes:\n  n1: {fabric: 127.0.0.1:0, admin: 127.0.0.1:0}\nservices:\n  slow: {nodes: [n1]}\n",
    )
    .unwrap();
    MeshFile::read(&dir.join("mesh.yaml")).unwrap()
}

/// The pod's next request (waits for it).
fn next_request(pod: &mut HostPort) -> dpumesh_dpa::Descriptor {
    loop {
        match pod
            .recv(WakeMode::LOW_CPU, Duration::from_secs(60))
            .unwrap()
        {
            Some(Incoming::Message { descriptor, .. }) if !descriptor.kind.response => {
                return descriptor;
            }
            Some(_) => {}
            None => panic!("no request reached the pod"),
        }
    }
}

#[test]
fn a_data_plane_panic_answers_what_it_held_and_a_crash_loop_is_not_ready() {
    let dir = tempfile::tempdir().unwrap();
    let mesh = write_files(dir.path());
    let node = Node::start(&mesh, "n1", dir.path()).unwrap();
    let admin = node.admin_addr().unwrap();
    let mut pod = HostPort::connect(node.control(), "slow-0", "slow").unwrap();
    let fabric = node.fabric_addr();
    let timeout = Duration::from_secs(60);
    assert_eq!(get(admin, &admin.to_string(), "/readyz").0, 200);

    // A request the pod holds; the reactor panics under it.
    let held = std::thread::spawn(move || common::fabric_get(fabric, "slow", "/held", timeout));
    let _unanswered = next_request(&mut pod);
    node.dataplane().inject_panic();
    let (status, body) = dpumesh_test_support::joined(held);
    assert_eq!(
        status, 502,
        "answered when the link went, not at the 60 s timeout: {body}"
    );

    // The reactor is back: the ingress links again and the pod's answer comes through.
    let answered =
        std::thread::spawn(move || common::fabric_get(fabric, "slow", "/after", timeout));
    let request = next_request(&mut pod);
    let head = wire::encode_response(&ResponseHead {
        status: 200,
        ..Default::default()
    })
    .unwrap();
    pod.send(&HostPort::reply(&request, 200, &head, b"served"))
        .unwrap();
    let (status, body) = dpumesh_test_support::joined(answered);
    assert_eq!((status, body.as_str()), (200, "served"));
    let reactor = node
        .dataplane()
        .supervisor()
        .threads()
        .into_iter()
        .find(|t| t.name() == "dpumesh-shard-0")
        .unwrap();
    assert_eq!(reactor.panics(), 1);
    assert_eq!(get(admin, &admin.to_string(), "/readyz").0, 200);

    // A reactor that keeps panicking is left down, and readiness says which thread.
    for n in 2..=6 {
        node.dataplane().inject_panic();
        while reactor.panics() < n {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    while !reactor.dead() {
        std::thread::sleep(Duration::from_millis(5));
    }
    let (status, body) = get(admin, &admin.to_string(), "/readyz");
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("dpumesh-shard-0"), "{body}");
    assert!(body.contains("injected data plane panic"), "{body}");
}

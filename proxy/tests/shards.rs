//! A node with two shards (`cores: 2`), in process: a pod's requests take turns over
//! its lanes, each runs to completion on the shard that took it (its answer comes
//! back on the lane it left on), the metrics say how many each shard took, and links
//! from outside (the ingress's, one per worker) are served by whichever shard took
//! them.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use dpumesh_config::MeshFile;
use dpumesh_dpa::{Case, Destination, HostPort, Incoming, Outgoing, WakeMode};
use dpumesh_head::RequestHead;
use dpumesh_head::wire::{self, ResponseHead};
use dpumesh_proxy::node::Node;

mod common;
use common::get;

fn write_files(dir: &Path) -> MeshFile {
    std::fs::write(
        dir.join("policy.yaml"),
        "workers: 1\nchains: {open: []}\nservices: {echo: {chain: open}, caller: {chain: open}}\nroutes: [{host: echo, service: echo}]\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("mesh.yaml"),
        "policy: policy.yaml\nidentity: {mtls: off}\ningress: {listen: 127.0.0.1:0}\nnodes:\n  n1: {fabric: 127.0.0.1:0, admin: 127.0.0.1:0, cores: 2}\nservices:\n  echo: {nodes: [n1]}\n  caller: {nodes: [n1]}\n",
    )
    .unwrap();
    MeshFile::read(&dir.join("mesh.yaml")).unwrap()
}

/// The echo pod: answers every request with the lane it came on, until told to stop.
fn echo(mut pod: HostPort) -> Vec<u8> {
    let mut lanes = Vec::new();
    let head = wire::encode_response(&ResponseHead {
        status: 200,
        ..Default::default()
    })
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        let Some(Incoming::Message {
            descriptor, header, ..
        }) = pod
            .recv(WakeMode::LOW_CPU, Duration::from_millis(100))
            .unwrap()
        else {
            continue;
        };
        if descriptor.kind.response {
            continue;
        }
        let path = wire::decode_request(&header).unwrap().path;
        lanes.push(descriptor.lane);
        let body = format!("lane {}", descriptor.lane);
        pod.send(&HostPort::reply(&descriptor, 200, &head, body.as_bytes()))
            .unwrap();
        if path == "/stop" {
            break;
        }
    }
    lanes
}

/// `dpumesh_shard_requests_total` of each shard, from the node's `/metrics`.
fn shard_requests(admin: SocketAddr) -> BTreeMap<String, u64> {
    let (_, body) = get(admin, &admin.to_string(), "/metrics");
    body.lines()
        .filter_map(|l| l.strip_prefix("dpumesh_shard_requests_total{shard=\""))
        .filter_map(|l| {
            let (shard, rest) = l.split_once("\"}")?;
            Some((shard.to_owned(), rest.trim().parse().ok()?))
        })
        .collect()
}

#[test]
fn two_shards_each_run_their_requests_to_completion() {
    let dir = tempfile::tempdir().unwrap();
    let mesh = write_files(dir.path());
    let node = Node::start(&mesh, "n1", dir.path()).unwrap();
    assert_eq!(node.dataplane().shards(), 2);
    let admin = node.admin_addr().unwrap();
    let echo_pod = HostPort::connect(node.control(), "echo-0", "echo").unwrap();
    let echo_id = echo_pod.pod_id();
    let echo = std::thread::spawn(move || echo(echo_pod));

    // A caller pod's requests take turns over its two lanes; each answer comes back
    // on the lane its request left on (the shard that took it answered it).
    let mut caller = HostPort::connect(node.control(), "caller-0", "caller").unwrap();
    let calls = 8u32;
    let mut answered = Vec::new();
    for n in 0..calls {
        let path = format!("/{n}");
        let mut head = RequestHead::new("GET", &path);
        head.authority = "echo".to_owned();
        let header = wire::encode_request(&head).unwrap();
        caller
            .send(&Outgoing {
                case: Case::PodToPod,
                dst: Destination::Pod(echo_id),
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
        assert!(descriptor.kind.response);
        assert_eq!((descriptor.req_id, descriptor.status), (n, 200));
        assert_eq!(
            String::from_utf8(body).unwrap(),
            format!("lane {}", descriptor.lane),
            "the answer came back on the lane the echo pod got the request on"
        );
        answered.push(descriptor.lane);
    }
    assert!(
        answered.contains(&0) && answered.contains(&1),
        "requests took turns over both lanes: {answered:?}"
    );

    // Both shards took requests, and the counters say so per shard.
    let counted = shard_requests(admin);
    assert_eq!(counted.len(), 2, "{counted:?}");
    assert!(counted.values().all(|&n| n > 0), "{counted:?}");
    assert_eq!(counted.values().sum::<u64>(), u64::from(calls));

    // Links from outside (the ingress's: one per worker) land on the shards in turn;
    // requests over them are answered whichever shard took the link.
    let fabric = node.fabric_addr();
    let timeout = Duration::from_secs(30);
    let before = wire::counts::now();
    for n in 0..6 {
        let (status, body) = common::fabric_get(fabric, "echo", &format!("/{n}"), timeout);
        assert_eq!(status, 200, "{body}");
        assert!(body.starts_with("lane "), "{body}");
    }
    // Each hop encodes the request head once and decodes it once: the sender (the
    // ingress's part) and the node encode, the node and the pod decode. The pod's
    // answer was encoded once before the loop; the node passes it on without reading
    // it (no cache, no plugin here), and the sender decodes it.
    let counted = wire::counts::now() - before;
    assert_eq!(
        counted,
        wire::counts::Counts {
            request_encodes: 12,
            request_decodes: 12,
            response_encodes: 0,
            response_decodes: 6,
        }
    );
    let (status, _) = common::fabric_get(fabric, "echo", "/stop", timeout);
    assert_eq!(status, 200);
    let echoed = dpumesh_test_support::joined(echo);
    assert_eq!(echoed.len(), answered.len() + 7);
    assert_eq!(echoed[..answered.len()], answered[..]);
}

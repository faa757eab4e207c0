//! The data paths end to end through real processes: pods are child processes (this
//! binary re-executed as `pod_entry`) that register over the control channel and map
//! their pools and rings; the node runs in the test, which plays the proxy on the
//! node's shard (its DMA work runs on the test's thread). Bytes are checked with CRC32
//! at the far end.

use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

mod common;
#[path = "cases/staging.rs"]
mod staging;
#[path = "cases/streams.rs"]
mod streams;

use dpumesh_dpa::control::transport::Endpoint;
use dpumesh_dpa::{
    Case, Descriptor, DescriptorStatus, Destination, Dpu, DpuConfig, DpuShard, HostPort, Incoming,
    Outgoing, WakeMode,
};

const ROLE: &str = "DPUMESH_DPA_POD_ROLE";
const CONTROL: &str = "DPUMESH_DPA_POD_CONTROL";

struct Pod(Child);

impl Pod {
    fn wait(&mut self) -> std::process::ExitStatus {
        self.0.wait().unwrap()
    }
}

impl Drop for Pod {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn_pod(role: &str, control: &Path) -> Pod {
    Pod(common::this_test_binary()
        .args([
            "--exact",
            "pod_entry",
            "--ignored",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(ROLE, role)
        .env(CONTROL, control)
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn a pod"))
}

/// Bodies every size test sends: empty, 1 KiB, 8 MiB.
const SIZES: [usize; 3] = [0, 1024, 8 << 20];

fn body(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[0] ^ seed)
        .collect()
}

/// A head in the tiny text format these tests use: `key=value` lines.
fn head(fields: &[(&str, String)]) -> Vec<u8> {
    fields
        .iter()
        .map(|(k, v)| format!("{k}={v}\n"))
        .collect::<String>()
        .into_bytes()
}

fn field(head: &[u8], key: &str) -> Option<String> {
    String::from_utf8_lossy(head)
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{key}=")).map(str::to_owned))
}

fn recv(port: &mut HostPort) -> Incoming {
    port.recv(WakeMode::LOW_CPU, Duration::from_secs(20))
        .unwrap()
        .expect("a message within 20 s")
}

/// As [`recv`], sleeping in `poll` on the pod's bell instead of on the ring's futex.
fn recv_on_bell(port: &mut HostPort) -> Incoming {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(incoming) = port.try_recv().unwrap() {
            return incoming;
        }
        let left = deadline
            .checked_duration_since(Instant::now())
            .expect("a message within 20 s: the node rings the bell of a pod asleep on it");
        if !port.sleep_begins() {
            let fd = port.bell().fd();
            let mut fds = [rustix::event::PollFd::new(
                &fd,
                rustix::event::PollFlags::IN,
            )];
            let ts = rustix::fs::Timespec {
                tv_sec: left.as_secs() as i64,
                tv_nsec: 0,
            };
            let rung = rustix::event::poll(&mut fds, Some(&ts)).unwrap();
            assert!(rung > 0, "the node rings the bell of a pod asleep on it");
        }
        port.sleep_ends();
    }
}

/// The pods' side. Ignored in normal runs; the tests start it.
#[test]
#[ignore = "entry point of the pod processes the other tests spawn"]
fn pod_entry() {
    let role = std::env::var(ROLE).expect("run by the case tests");
    let control = Endpoint::Unix(std::env::var(CONTROL).unwrap().into());
    match role.as_str() {
        // Answers every request with the reversed body and the CRC it saw; sleeping on
        // its ring's futex, or on its bell's eventfd as a pod in a reactor does.
        "server" | "bell-server" => {
            let mut port = HostPort::connect(&control, "pod-b", "svc-b").unwrap();
            loop {
                let incoming = if role == "bell-server" {
                    recv_on_bell(&mut port)
                } else {
                    recv(&mut port)
                };
                let Incoming::Message {
                    descriptor,
                    header,
                    body,
                } = incoming
                else {
                    continue;
                };
                if field(&header, "stop").is_some() {
                    break;
                }
                let seen = crc32fast::hash(&body);
                assert_eq!(
                    field(&header, "crc"),
                    Some(seen.to_string()),
                    "request body intact"
                );
                let mut reply = body.clone();
                reply.reverse();
                let h = head(&[
                    ("crc", crc32fast::hash(&reply).to_string()),
                    ("saw", seen.to_string()),
                ]);
                port.send(&HostPort::reply(&descriptor, 200, &h, &reply))
                    .unwrap();
            }
        }
        // Case 3: calls svc-b on the same node with each body size, checks replies.
        "client" => {
            let mut port = HostPort::connect(&control, "pod-a", "svc-a").unwrap();
            let b = loop {
                // pod-b may still be registering.
                let pods = port.control().resolve("svc-b").unwrap();
                if let Some(&b) = pods.first() {
                    break b;
                }
                std::thread::sleep(Duration::from_millis(10));
            };
            for (step, len) in SIZES.iter().enumerate() {
                let sent = body(*len, step as u8);
                let h = head(&[
                    ("crc", crc32fast::hash(&sent).to_string()),
                    ("path", "/x".into()),
                ]);
                port.send(&Outgoing {
                    case: Case::PodToPod,
                    dst: Destination::Pod(b),
                    req_id: 7,
                    step_id: step as u32,
                    response: false,
                    status: 0,
                    stream: false,
                    header: &h,
                    body: &sent,
                    lane: 0,
                })
                .unwrap();
                let Incoming::Message {
                    descriptor,
                    header,
                    body: got,
                } = recv(&mut port)
                else {
                    panic!("an error instead of a reply");
                };
                assert!(descriptor.kind.response);
                assert_eq!((descriptor.req_id, descriptor.step_id), (7, step as u32));
                assert_eq!(descriptor.status, 200);
                assert_eq!(
                    field(&header, "saw"),
                    Some(crc32fast::hash(&sent).to_string())
                );
                assert_eq!(
                    field(&header, "crc"),
                    Some(crc32fast::hash(&got).to_string()),
                    "reply body intact"
                );
                assert_eq!(got.len(), *len);
            }
            // A request the proxy denies: a 403 reply, and the body slot comes back.
            let h = head(&[("deny", "1".into())]);
            port.send(&Outgoing {
                case: Case::PodToPod,
                dst: Destination::Pod(b),
                req_id: 8,
                step_id: 0,
                response: false,
                status: 0,
                stream: false,
                header: &h,
                body: b"secret",
                lane: 0,
            })
            .unwrap();
            let Incoming::Message {
                descriptor,
                header,
                body,
            } = recv(&mut port)
            else {
                panic!("an error instead of the denial");
            };
            assert_eq!((descriptor.status, descriptor.req_id), (403, 8));
            assert_eq!(field(&header, "reason"), Some("policy".into()));
            assert!(body.is_empty());
            // Every TX slot came back (completions are processed while receiving).
            let deadline = Instant::now() + Duration::from_secs(10);
            while port.in_flight() > 0 && Instant::now() < deadline {
                let _ = port
                    .recv(WakeMode::LOW_CPU, Duration::from_millis(50))
                    .unwrap();
            }
            assert_eq!(port.in_flight(), 0, "TX slots handed back");
            port.send(&Outgoing {
                case: Case::PodToPod,
                dst: Destination::Pod(b),
                req_id: 9,
                step_id: 0,
                response: false,
                status: 0,
                stream: false,
                header: &head(&[("stop", "1".into())]),
                body: &[],
                lane: 0,
            })
            .unwrap();
        }
        // Sends one request with a body to svc-b and exits at once, skipping every
        // destructor: the node must still carry what it published.
        "fire-and-forget" => {
            let mut port = HostPort::connect(&control, "pod-f", "svc-f").unwrap();
            let b = loop {
                if let Some(&b) = port.control().resolve("svc-b").unwrap().first() {
                    break b;
                }
                std::thread::sleep(Duration::from_millis(10));
            };
            let sent = body(64 << 10, 9);
            let h = head(&[
                ("crc", crc32fast::hash(&sent).to_string()),
                ("last", "1".into()),
            ]);
            port.send(&Outgoing {
                case: Case::PodToPod,
                dst: Destination::Pod(b),
                req_id: 99,
                step_id: 0,
                response: false,
                status: 0,
                stream: false,
                header: &h,
                body: &sent,
                lane: 0,
            })
            .unwrap();
            std::process::exit(0);
        }
        // Receives one request, checks it, and leaves.
        "receive-one" => {
            let mut port = HostPort::connect(&control, "pod-b", "svc-b").unwrap();
            let Incoming::Message {
                descriptor,
                header,
                body,
            } = recv(&mut port)
            else {
                panic!("an error instead of the request");
            };
            assert_eq!(descriptor.req_id, 99);
            assert_eq!(
                field(&header, "crc"),
                Some(crc32fast::hash(&body).to_string())
            );
            assert_eq!(body.len(), 64 << 10);
        }
        // Registers, says so on stdout... and stays until killed.
        "idle" => {
            let _port = HostPort::connect(&control, "pod-c", "svc-c").unwrap();
            std::thread::sleep(Duration::from_secs(60));
        }
        // Registers by hand and tries what a hostile pod would with what it got:
        // truncate its regions (under the node) and find others' by name.
        "hostile" => {
            use dpumesh_dpa::control::Role;
            use dpumesh_dpa::control::transport::ControlClient;
            let mut control = ControlClient::connect(&control, Role::Host, "pod-h").unwrap();
            let exports = control.register_pod("pod-h", "svc-h", None).unwrap();
            let fds = control.take_fds();
            assert_eq!(fds.len(), exports.descriptors());
            let lanes = exports.lanes.len();
            // The regions (after the lanes' bell eventfds, before the pod bell's):
            // none can change size.
            for fd in &fds[lanes..fds.len() - 1] {
                let file = std::fs::File::from(fd.try_clone().unwrap());
                let e = file.set_len(0).unwrap_err();
                assert_eq!(e.raw_os_error(), Some(libc::EPERM), "truncate: {e}");
                assert!(file.set_len(1 << 30).is_err(), "grow");
            }
            // No region of the node's pods has a name to open.
            let named: Vec<String> = std::fs::read_dir(dpumesh_dpa::shm::shm_dir())
                .unwrap()
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.contains("dpumesh-hostile"))
                .collect();
            assert!(named.is_empty(), "{named:?}");
        }
        other => panic!("unknown role {other}"),
    }
}

#[test]
fn a_pods_regions_come_as_sealed_descriptors_it_cannot_truncate_under_the_node() {
    let dir = tempfile::tempdir().unwrap();
    let node = node(dir.path(), "hostile");
    let mut port = node.take_shards().remove(0);
    // A well-behaved pod first, then the hostile one beside it.
    let mut idle = spawn_pod("idle", &dir.path().join("control.sock"));
    // Registered before the hostile one starts (under qemu a pod takes seconds to):
    // what is left at the end is judged against a node that had both.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !node.pods().iter().any(|p| p.name == "pod-c") {
        assert!(Instant::now() < deadline, "the idle pod registers");
        let _ = port.recv(Duration::from_millis(20));
    }
    let mut hostile = spawn_pod("hostile", &dir.path().join("control.sock"));
    assert!(hostile.wait().success(), "the hostile pod's checks held");
    // The node (which maps every one of those regions) is alive and reclaims it.
    until_pods_left_but(&node, &mut port, "pod-c", Duration::from_secs(10));
    assert_eq!(
        node.pods()
            .iter()
            .map(|p| p.name.clone())
            .collect::<Vec<_>>(),
        ["pod-c"]
    );
    drop(idle.0.kill());
}

/// Runs the shard until every pod but `keep` has left.
fn until_pods_left_but(node: &Dpu, port: &mut DpuShard, keep: &str, within: Duration) {
    let deadline = Instant::now() + within;
    while node.pods().iter().any(|p| p.name != keep) {
        assert!(Instant::now() < deadline, "pods still registered");
        let _ = port.recv(Duration::from_millis(20));
    }
}

fn node(dir: &Path, name: &str) -> Dpu {
    node_with_shards(dir, name, 1)
}

fn node_with_shards(dir: &Path, name: &str, shards: usize) -> Dpu {
    node_with(dir, name, shards, false)
}

fn node_with(dir: &Path, name: &str, shards: usize, across_pcie: bool) -> Dpu {
    let mut config = DpuConfig::new(name);
    config.pod.body_slots = 8;
    config.shards = shards;
    config.across_pcie = across_pcie;
    Dpu::start(config, &Endpoint::Unix(dir.join("control.sock"))).unwrap()
}

/// The proxy's job in these tests: forward requests and responses as the pods
/// addressed them, answer a head with `deny=` itself. Returns when `until` holds.
fn proxy(port: &mut DpuShard, until: impl FnMut(&Descriptor) -> bool) {
    proxy_until(port, until, || false);
}

/// As [`proxy`], and also returns once `stop` says so.
fn proxy_until(
    port: &mut DpuShard,
    until: impl FnMut(&Descriptor) -> bool,
    stop: impl Fn() -> bool,
) {
    proxy_sleeping(port, until, stop, Duration::from_millis(20));
}

/// As [`proxy_until`], the shard sleeping up to `sleep` on its bell between passes.
fn proxy_sleeping(
    port: &mut DpuShard,
    mut until: impl FnMut(&Descriptor) -> bool,
    stop: impl Fn() -> bool,
    sleep: Duration,
) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if stop() {
            return;
        }
        let Some(d) = port.recv(sleep).unwrap() else {
            continue;
        };
        if d.kind.error {
            panic!("the data path reported {:?} for {d:?}", d.error_status());
        }
        let head = port.header(&d).unwrap();
        if field(&head, "deny").is_some() {
            // Answer at once; the body never moves, and its slot goes back to the pod.
            let reply = port.alloc_header(&head_bytes("reason=policy\n")).unwrap();
            let mut r =
                Descriptor::request(d.case, d.req_id, d.step_id, 0, Destination::Pod(d.src_pod))
                    .with_header(reply);
            r.kind.response = true;
            r.status = 403;
            port.forward(&r).unwrap();
            let mut done = d;
            done.kind.completion = true;
            port.forward(&done).unwrap();
            continue;
        }
        port.forward(&d).unwrap();
        if until(&d) {
            // The last delivery's wake-up: a shard batches them until it sleeps.
            port.wake_pods();
            return;
        }
    }
    panic!("the pods did not finish within 60 s");
}

/// Runs `shards` until the node has no pod left (a shard lets go of a departed pod
/// when it runs), for at most `within`.
fn until_pods_left(node: &Dpu, shards: &mut [&mut DpuShard], within: Duration) {
    let deadline = Instant::now() + within;
    while !node.pods().is_empty() && Instant::now() < deadline {
        for shard in shards.iter_mut() {
            let _ = shard.recv(Duration::from_millis(5));
        }
    }
}

/// Both pods of a case run passed their checks.
fn pods_passed(client: &mut Pod, server: &mut Pod) {
    assert!(
        client.wait().success(),
        "the client pod checked every reply"
    );
    assert!(
        server.wait().success(),
        "the server pod checked every request"
    );
}

fn head_bytes(s: &str) -> Vec<u8> {
    s.as_bytes().to_vec()
}

/// Case 3 between the "client" pod and pod-b in role `server`, checked end to end.
fn case_3(server: &str) {
    case_3_with(server, false);
}

/// [`case_3`], the node's shards reaching the pods' regions only across an emulated
/// PCIe (`across_pcie`) when asked.
fn case_3_with(server: &str, across_pcie: bool) {
    let dir = tempfile::tempdir().unwrap();
    let node = node_with(dir.path(), server, 1, across_pcie);
    let mut port = node.take_shards().remove(0);
    let socket = dir.path().join("control.sock");
    let mut server = spawn_pod(server, &socket);
    let mut client = spawn_pod("client", &socket);
    proxy(&mut port, |d| d.req_id == 9);
    pods_passed(&mut client, &mut server);
    let stats = node.stats();
    use std::sync::atomic::Ordering::Relaxed;
    // 3 requests + 3 replies + the denial + stop, and the 8 MiB bodies were copied.
    assert!(stats.delivered.load(Relaxed) >= 8);
    assert!(stats.bytes.load(Relaxed) >= 2 * (8 << 20));
    assert_eq!(stats.errors.load(Relaxed), 0);
    // Both pods exited: their connections closed and the node reclaimed them.
    until_pods_left(&node, &mut [&mut port], Duration::from_secs(10));
    assert!(node.pods().is_empty());
    assert_eq!(node.dpu_pool_use(), (0, 0), "no DPU header slot leaked");
}

#[test]
fn case_3_moves_heads_through_the_proxy_and_bodies_pod_to_pod() {
    case_3("server");
}

#[test]
fn case_3_across_pcie_keeps_rings_and_words_in_step_by_dma_alone() {
    // The BlueField split in software: the shard works on mirrors of the pods' rings
    // and ownership words, moved by its engine's pulls and pushes, and copies slot
    // bytes host to host through aliases. Three 8 MiB round trips, slots reused.
    case_3_with("server", true);
}

#[test]
fn across_pcie_a_pod_asleep_on_its_bell_is_woken_by_the_host_side() {
    case_3_with("bell-server", true);
}

const AGENT_NODE: &str = "DPUMESH_DPA_AGENT_NODE";
const AGENT_LISTEN: &str = "DPUMESH_DPA_AGENT_LISTEN";

/// The host agent's process. Ignored in normal runs; the agent tests start it. It
/// serves until the node goes away.
#[test]
#[ignore = "entry point of the host agent process the agent tests spawn"]
fn agent_entry() {
    use dpumesh_dpa::agent::{AgentConfig, HostAgent, PushSink};
    let node = std::path::PathBuf::from(std::env::var(AGENT_NODE).expect("run by a test"));
    let listen = std::path::PathBuf::from(std::env::var(AGENT_LISTEN).unwrap());
    let sink = PushSink::default();
    let pushes = sink.clone();
    let link = dpumesh_dpa::control::transport::MuxClient::connect(&node, "host-0", move |r| {
        pushes.deliver(r)
    })
    .unwrap();
    let node_name = link.node().to_owned();
    let config = AgentConfig {
        name: "host-0".to_owned(),
        listen,
        exporter: None,
    };
    let agent = HostAgent::start(config, std::sync::Arc::new(link), &sink, node_name).unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while agent.closed().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(agent.closed().is_some(), "the node went away within 120 s");
}

/// Case 3 with the BlueField split as processes: the node reaches the pods' regions
/// only through its engine, the pods register with a host agent in another process
/// (which made their regions and passed them to the node), wake-ups cross as
/// `Wake` and `Doorbell` messages. The shard sleeps up to `sleep` between passes.
fn case_3_through_a_host_agent(server: &str, sleep: Duration) {
    let dir = tempfile::tempdir().unwrap();
    let node = node_with(dir.path(), server, 1, true);
    let mut port = node.take_shards().remove(0);
    let agent_socket = dir.path().join("agent.sock");
    let mut agent = Pod(common::this_test_binary()
        .args([
            "--exact",
            "agent_entry",
            "--ignored",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(AGENT_NODE, dir.path().join("control.sock"))
        .env(AGENT_LISTEN, &agent_socket)
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn the host agent"));
    let up = Instant::now() + Duration::from_secs(20);
    while !agent_socket.exists() && Instant::now() < up {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(agent_socket.exists(), "the host agent listens within 20 s");
    let mut server = spawn_pod(server, &agent_socket);
    let mut client = spawn_pod("client", &agent_socket);
    proxy_sleeping(&mut port, |d| d.req_id == 9, || false, sleep);
    pods_passed(&mut client, &mut server);
    let stats = node.stats();
    use std::sync::atomic::Ordering::Relaxed;
    assert!(stats.delivered.load(Relaxed) >= 8);
    assert!(stats.bytes.load(Relaxed) >= 2 * (8 << 20));
    assert_eq!(stats.errors.load(Relaxed), 0);
    // The pods exited: the agent unregistered them at the node.
    until_pods_left(&node, &mut [&mut port], Duration::from_secs(15));
    assert!(
        node.pods().is_empty(),
        "the agent unregistered the pods that left"
    );
    assert_eq!(node.dpu_pool_use(), (0, 0), "no DPU header slot leaked");
    // The node goes: the agent hears it and exits.
    drop(port);
    drop(node);
    assert!(
        agent.wait().success(),
        "the agent saw the node go and exited cleanly"
    );
}

#[test]
fn through_a_host_agent_pods_register_unchanged_and_case_3_runs_across_pcie() {
    case_3_through_a_host_agent("server", Duration::from_millis(20));
}

#[test]
fn through_a_host_agent_a_pod_asleep_on_its_bell_is_woken_by_the_agent() {
    // The server sleeps on its bell's eventfd, which only the agent can write (told
    // by the node's `Wake`): without it the pod waits out its 20 s and fails.
    case_3_through_a_host_agent("bell-server", Duration::from_millis(20));
}

#[test]
fn through_a_host_agent_a_pods_doorbell_wakes_the_sleeping_shard() {
    // The shard sleeps up to a minute: only the agent's doorbells (a pod rang the
    // agent's lane bell) wake it for each request within the proxy's 60 s.
    case_3_through_a_host_agent("server", Duration::from_secs(60));
}

#[test]
fn a_pod_asleep_on_its_bell_is_woken_by_each_delivery() {
    // The case-3 exchange, with a server that sleeps where a pod in a reactor does:
    // had the node not rung its bell, it would wait out its 20 s and fail.
    case_3("bell-server");
}

#[test]
fn with_two_shards_a_request_and_its_answer_stay_on_the_shard_that_took_it() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    let dir = tempfile::tempdir().unwrap();
    let node = node_with_shards(dir.path(), "lanes", 2);
    let socket = dir.path().join("control.sock");
    let mut server = spawn_pod("server", &socket);
    let mut client = spawn_pod("client", &socket);
    // Each shard on a thread of its own, as the proxy runs them; each records what
    // it carried: (request id, step, response?).
    let stop = Arc::new(AtomicBool::new(false));
    let shards: Vec<_> = node
        .take_shards()
        .into_iter()
        .map(|mut shard| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut carried = Vec::new();
                proxy_until(
                    &mut shard,
                    |d| {
                        carried.push((d.req_id, d.step_id, d.kind.response));
                        if d.req_id == 9 {
                            stop.store(true, SeqCst);
                        }
                        false
                    },
                    || stop.load(SeqCst),
                );
                (shard, carried)
            })
        })
        .collect();
    let mut ran: Vec<_> = shards
        .into_iter()
        .map(dpumesh_test_support::joined)
        .collect();
    pods_passed(&mut client, &mut server);
    // The client's requests took turns over the lanes: both shards carried some, and
    // every answer came back through the shard that carried its request.
    for (shard, carried) in &ran {
        let requests: Vec<_> = carried.iter().filter(|c| !c.2).collect();
        assert!(
            !requests.is_empty(),
            "shard {} carried no request: {carried:?}",
            shard.index()
        );
        for &&(req, step, _) in &requests {
            if req == 7 {
                assert!(
                    carried.contains(&(req, step, true)),
                    "the answer to ({req}, {step}) left shard {}: {carried:?}",
                    shard.index()
                );
            }
        }
    }
    // Both pods exited: every shard let go of them and nothing leaked.
    let mut shards: Vec<&mut DpuShard> = ran.iter_mut().map(|(shard, _)| shard).collect();
    until_pods_left(&node, &mut shards, Duration::from_secs(10));
    assert!(node.pods().is_empty());
    assert_eq!(node.dpu_pool_use(), (0, 0), "no DPU header slot leaked");
}

#[test]
fn a_killed_pod_is_reclaimed_and_deliveries_to_it_fail_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let node = node(dir.path(), "reclaim");
    let mut port = node.take_shards().remove(0);
    let mut pod = spawn_pod("idle", &dir.path().join("control.sock"));
    let deadline = Instant::now() + Duration::from_secs(20);
    while node.pods().is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let info = node.pods().pop().expect("the pod registered");
    // Its regions are anonymous: no name another process could open, nothing to
    // sweep when it dies (the kernel frees them with the last mapping).
    for region in [info.rx_body.region(), info.tx_body.region()] {
        let path = region.path().to_string_lossy().into_owned();
        assert!(path.starts_with("/proc/"), "{path}");
        assert!(!dpumesh_dpa::shm::shm_dir().join(region.name()).exists());
    }
    // A body is on its way to the pod (reserved in its RX pool) when it dies.
    let body = port.reserve_body(info.id, 100).unwrap();
    let pod_id = info.id;
    drop(info);
    pod.0.kill().unwrap();
    pod.wait();
    until_pods_left(&node, &mut [&mut port], Duration::from_secs(10));
    assert!(node.pods().is_empty(), "the dead pod was unregistered");
    // The delivery that was under way fails with a reason, and its header slot is freed.
    let header = port.alloc_header(b"h").unwrap();
    let d = Descriptor::request(Case::ExternalToHost, 1, 0, 0, Destination::Pod(pod_id))
        .with_header(header)
        .with_body(body);
    port.forward(&d).unwrap();
    let e = port.recv(Duration::from_secs(10)).unwrap().unwrap();
    assert!(e.kind.error);
    assert_eq!(e.error_status(), Some(DescriptorStatus::UnknownPod));
    assert_eq!(node.dpu_pool_use(), (0, 0));
    drop(port);
}

#[test]
fn a_restarted_pod_registers_under_its_name_while_the_node_still_lets_go_of_the_old_one() {
    let dir = tempfile::tempdir().unwrap();
    let node = node(dir.path(), "restart");
    let mut port = node.take_shards().remove(0);
    let control = Endpoint::Unix(dir.path().join("control.sock"));
    let old = HostPort::connect(&control, "reservation-0", "reservation").unwrap();
    let old_id = old.pod_id();
    // It dies. Until the shard (not run here yet) lets go of it, it stays in the
    // node's table, marked as leaving.
    drop(old);
    let deadline = Instant::now() + Duration::from_secs(5);
    while !node.pods().iter().any(|p| p.id == old_id && p.is_leaving()) {
        assert!(Instant::now() < deadline, "the node never saw the pod go");
        std::thread::sleep(Duration::from_millis(5));
    }
    // Its restarted process registers under the same name at once, and is the one
    // the service resolves to.
    let mut new = HostPort::connect(&control, "reservation-0", "reservation")
        .expect("a leaving pod's name is free for its successor");
    assert_ne!(new.pod_id(), old_id);
    assert_eq!(
        new.control().resolve("reservation").unwrap(),
        vec![new.pod_id()]
    );
    let deadline = Instant::now() + Duration::from_secs(15);
    while node.pods().iter().any(|p| p.id == old_id) {
        assert!(Instant::now() < deadline, "the old pod was never let go of");
        let _ = port.recv(Duration::from_millis(20));
    }
    assert_eq!(
        node.pods().iter().map(|p| p.id).collect::<Vec<_>>(),
        vec![new.pod_id()]
    );
}

#[test]
fn a_pod_that_sends_and_exits_at_once_still_gets_its_message_delivered() {
    let dir = tempfile::tempdir().unwrap();
    let node = node(dir.path(), "fire");
    let mut port = node.take_shards().remove(0);
    let socket = dir.path().join("control.sock");
    let mut receiver = spawn_pod("receive-one", &socket);
    let mut sender = spawn_pod("fire-and-forget", &socket);
    assert!(sender.wait().success());
    // The sender is gone; its request (and the body still in its memory) must not be.
    proxy(&mut port, |d| d.req_id == 99);
    assert!(
        receiver.wait().success(),
        "the receiver got the request intact"
    );
    until_pods_left(&node, &mut [&mut port], Duration::from_secs(15));
    assert!(node.pods().is_empty(), "both pods were reclaimed");
    assert_eq!(node.dpu_pool_use(), (0, 0));
}

#[test]
fn a_pod_calling_itself_through_a_tiny_ring_gets_its_message_and_every_slot_back() {
    // Case 3 with source = destination: the delivery and the completion of the copied
    // body go to the same RX SQ. With room for only two entries the manager must wait
    // for both, not deliver and then find the ring full.
    let dir = tempfile::tempdir().unwrap();
    let mut config = DpuConfig::new("self");
    config.pod.ring_capacity = 2;
    config.pod.body_slots = 4;
    let node = Dpu::start(config, &Endpoint::Unix(dir.path().join("control.sock"))).unwrap();
    let mut port = node.take_shards().remove(0);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let proxy_stop = stop.clone();
    let proxy = std::thread::spawn(move || {
        while !proxy_stop.load(std::sync::atomic::Ordering::Relaxed) {
            if let Some(d) = port.recv(Duration::from_millis(20)).unwrap() {
                assert!(!d.kind.error, "{:?}", d.error_status());
                port.forward(&d).unwrap();
            }
        }
    });
    let mut me = HostPort::connect(
        &Endpoint::Unix(dir.path().join("control.sock")),
        "loop",
        "svc-loop",
    )
    .unwrap();
    let id = me.pod_id();
    for round in 0..20u32 {
        let sent = body(3000 + round as usize, round as u8);
        let h = head(&[("crc", crc32fast::hash(&sent).to_string())]);
        me.send(&Outgoing {
            case: Case::PodToPod,
            dst: Destination::Pod(id),
            req_id: round,
            step_id: 0,
            response: false,
            status: 0,
            stream: false,
            header: &h,
            body: &sent,
            lane: 0,
        })
        .unwrap();
        let Incoming::Message {
            descriptor,
            header,
            body: got,
        } = recv(&mut me)
        else {
            panic!("an error instead of our own message");
        };
        assert_eq!(descriptor.req_id, round);
        assert_eq!(
            field(&header, "crc"),
            Some(crc32fast::hash(&got).to_string())
        );
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while me.in_flight() > 0 && Instant::now() < deadline {
        let _ = me
            .recv(WakeMode::LOW_CPU, Duration::from_millis(20))
            .unwrap();
    }
    assert_eq!(me.in_flight(), 0, "every TX slot came back");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    dpumesh_test_support::joined(proxy);
}

#[test]
fn a_pod_that_stops_reading_is_refused_at_once_until_it_reads_again() {
    // Back-pressure, not a queue: a pod whose full ring takes nothing for the stall
    // time gets what is held for it failed (RingFull) and new deliveries refused at
    // once; once it reads, deliveries land again. Every DPU slot comes back.
    let dir = tempfile::tempdir().unwrap();
    let mut config = DpuConfig::new("stall");
    config.pod.ring_capacity = 4;
    let node = Dpu::start(config, &Endpoint::Unix(dir.path().join("control.sock"))).unwrap();
    let mut port = node.take_shards().remove(0);
    let mut pod = HostPort::connect(
        &Endpoint::Unix(dir.path().join("control.sock")),
        "stuck",
        "svc-stuck",
    )
    .unwrap();
    let id = pod.pod_id();
    // The shard learns of the pod when it runs.
    for _ in 0..5 {
        let _ = port.recv(Duration::from_millis(20));
    }
    let send = |port: &mut DpuShard, n: u32| {
        let header = port.alloc_header(b"h").unwrap();
        let d = Descriptor::request(Case::ExternalToHost, n, 0, 0, Destination::Pod(id))
            .with_header(header);
        port.forward(&d).unwrap();
    };
    for n in 1..=10 {
        send(&mut port, n);
    }
    // The pod reads nothing: after the stall time, what was held comes back refused.
    let started = Instant::now();
    let mut refused = Vec::new();
    while started.elapsed() < Duration::from_secs(5) && refused.len() < 7 {
        if let Some(d) = port.recv(Duration::from_millis(20)).unwrap() {
            assert!(d.kind.error, "{d:?}");
            assert_eq!(d.error_status(), Some(DescriptorStatus::RingFull));
            refused.push(d.req_id);
        }
    }
    assert!(
        started.elapsed() >= dpumesh_dpa::dma::manager::STALL_AFTER - Duration::from_millis(50),
        "refused only after the stall time: {:?}",
        started.elapsed()
    );
    let in_ring = 10 - refused.len() as u32;
    assert!(
        (2..=4).contains(&in_ring),
        "{in_ring} delivered, {refused:?} refused"
    );
    // A new delivery is refused at once, not held.
    let asked = Instant::now();
    send(&mut port, 11);
    let d = loop {
        if let Some(d) = port.recv(Duration::from_millis(20)).unwrap() {
            break d;
        }
        assert!(
            asked.elapsed() < Duration::from_secs(2),
            "no answer for a stalled pod"
        );
    };
    assert_eq!(d.error_status(), Some(DescriptorStatus::RingFull));
    assert!(
        asked.elapsed() < Duration::from_millis(400),
        "{:?}",
        asked.elapsed()
    );
    // It reads again: what was in its ring, then a new delivery lands.
    for _ in 0..in_ring {
        assert!(matches!(recv(&mut pod), Incoming::Message { .. }));
    }
    send(&mut port, 12);
    let _ = port.recv(Duration::from_millis(50));
    match recv(&mut pod) {
        Incoming::Message { descriptor, .. } => assert_eq!(descriptor.req_id, 12),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        node.dpu_pool_use(),
        (0, 0),
        "every DPU header slot came back"
    );
}

#[test]
fn a_node_runs_1_to_256_shards() {
    // A descriptor names its lane (its shard) in one byte.
    let dir = tempfile::tempdir().unwrap();
    for shards in [0, 257] {
        let mut config = DpuConfig::new("limits");
        config.shards = shards;
        let e = Dpu::start(config, &Endpoint::Unix(dir.path().join("control.sock"))).unwrap_err();
        assert!(e.to_string().contains("1 to 256 shards"), "{e}");
    }
}

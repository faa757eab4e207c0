//! Cases 1 and 2 across two nodes over the software fabric, through real pod
//! processes: pod A on node 1 calls pod B on node 2.
//!
//! - Case 1 (host → other node): A's TX SQ → node 1's DMA manager (header to the
//!   DPU, body stays in A's memory) → node 1's proxy RDMA-WRITEs the body straight
//!   from A's TX pool into B's RX pool on node 2 and SENDs the head to node 2's proxy.
//! - Case 2 (outside → host): node 2's proxy gets the head and hands node 2's DMA
//!   manager a descriptor whose body is already in B's RX pool; B is woken.
//! - The response returns the same way, into the RX slot node 1's proxy granted with
//!   the request (as an RDMA RPC client names its response buffer).
//!
//! The test plays both proxies (threads). Which RX slot a sender may write into is
//! decided here by test scaffolding (the proxies see each other's pod tables); the
//! ingress/proxy protocol of the mesh issue replaces it. Bodies are checked by CRC32
//! at the far end; every slot is back in its pool at the end.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

mod common;

use dpumesh_dpa::control::transport::Endpoint;
use dpumesh_dpa::fabric::soft::{SoftCq, SoftFabric, SoftMr, SoftPd, SoftQp};
use dpumesh_dpa::fabric::{
    Access, CompletionQueue, Fabric, MemoryRegion, QpCaps, QpListener, QueuePair, RecvWr,
    RemoteAddr, SendOp, SendWr, WcOpcode, WcStatus,
};
use dpumesh_dpa::{
    BufAddr, Buffer, BufferPool, Case, Descriptor, Destination, Dpu, DpuConfig, DpuShard, HostPort,
    Incoming, Outgoing, OwnerId, PodInfo, SharedRegion, WakeMode,
};
use parking_lot::Mutex;

const ROLE: &str = "DPUMESH_DPA_POD_ROLE";
const CONTROL: &str = "DPUMESH_DPA_POD_CONTROL";
const PEER: &str = "DPUMESH_DPA_PEER_ADDR";
const SIZES: [usize; 3] = [0, 1024, 8 << 20];

struct Pod(Child);

impl Drop for Pod {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn_pod(role: &str, control: &Path, peer: &str) -> Pod {
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
        .env(PEER, peer)
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn a pod"))
}

fn body(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| ((i as u32).wrapping_mul(2_654_435_761) >> 7) as u8 ^ seed)
        .collect()
}

fn recv(port: &mut HostPort) -> Incoming {
    port.recv(WakeMode::LOW_CPU, Duration::from_secs(30))
        .unwrap()
        .expect("a message within 30 s")
}

#[test]
#[ignore = "entry point of the pod processes the test spawns"]
fn pod_entry() {
    let role = std::env::var(ROLE).unwrap();
    let control = Endpoint::Unix(std::env::var(CONTROL).unwrap().into());
    match role.as_str() {
        "b" => {
            let mut port = HostPort::connect(&control, "pod-b", "svc-b").unwrap();
            for _ in SIZES {
                let Incoming::Message {
                    descriptor,
                    header,
                    body,
                } = recv(&mut port)
                else {
                    panic!("an error instead of a request");
                };
                assert_eq!(
                    descriptor.case,
                    Case::ExternalToHost,
                    "arrived from outside the node"
                );
                let crc = String::from_utf8(header).unwrap();
                assert_eq!(
                    crc,
                    crc32fast::hash(&body).to_string(),
                    "request body intact"
                );
                let mut reply = body.clone();
                reply.reverse();
                let head = crc32fast::hash(&reply).to_string();
                port.send(&HostPort::reply(&descriptor, 200, head.as_bytes(), &reply))
                    .unwrap();
            }
            // Let the completions of the replies come back before leaving.
            let deadline = Instant::now() + Duration::from_secs(10);
            while port.in_flight() > 0 && Instant::now() < deadline {
                let _ = port.recv(WakeMode::LOW_CPU, Duration::from_millis(20));
            }
            assert_eq!(port.in_flight(), 0);
        }
        "a" => {
            let peer: std::net::SocketAddr = std::env::var(PEER).unwrap().parse().unwrap();
            let mut port = HostPort::connect(&control, "pod-a", "svc-a").unwrap();
            for (step, len) in SIZES.iter().enumerate() {
                let sent = body(*len, step as u8 + 1);
                let head = crc32fast::hash(&sent).to_string();
                port.send(&Outgoing {
                    case: Case::HostToRemote,
                    dst: Destination::External(peer),
                    req_id: 40,
                    step_id: step as u32,
                    response: false,
                    status: 0,
                    stream: false,
                    header: head.as_bytes(),
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
                assert_eq!(
                    (descriptor.req_id, descriptor.step_id, descriptor.status),
                    (40, step as u32, 200)
                );
                assert_eq!(
                    String::from_utf8(header).unwrap(),
                    crc32fast::hash(&got).to_string(),
                    "reply body intact"
                );
                let mut want = sent.clone();
                want.reverse();
                assert!(
                    got == want,
                    "step {step}: the reply is the reversed request"
                );
            }
            let deadline = Instant::now() + Duration::from_secs(10);
            while port.in_flight() > 0 && Instant::now() < deadline {
                let _ = port.recv(WakeMode::LOW_CPU, Duration::from_millis(20));
            }
            assert_eq!(port.in_flight(), 0, "every TX slot came back");
        }
        other => panic!("unknown role {other}"),
    }
}

// === the proxies (test scaffolding around the real data path) ===

/// A head on the wire between proxies.
#[derive(Debug, Clone)]
struct WireHead {
    req: u32,
    step: u32,
    response: bool,
    status: u16,
    /// The pod on the receiving node (0: the receiver looks it up by `token`).
    dst_pod: u32,
    /// Where the body was written on the receiving node.
    body: Buffer,
    /// Where the reply's body may be written on the sending node, and the token that
    /// names the waiting pod there.
    reply: RemoteAddr,
    reply_slot: Buffer,
    token: u32,
    header: Vec<u8>,
}

impl WireHead {
    fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(64 + self.header.len());
        b.extend_from_slice(&self.req.to_le_bytes());
        b.extend_from_slice(&self.step.to_le_bytes());
        b.push(self.response as u8);
        b.extend_from_slice(&self.status.to_le_bytes());
        b.extend_from_slice(&self.dst_pod.to_le_bytes());
        b.extend_from_slice(&self.body.addr.bits().to_le_bytes());
        b.extend_from_slice(&self.body.len.to_le_bytes());
        b.extend_from_slice(&self.reply.addr.to_le_bytes());
        b.extend_from_slice(&self.reply.rkey.to_le_bytes());
        b.extend_from_slice(&self.reply_slot.addr.bits().to_le_bytes());
        b.extend_from_slice(&self.reply_slot.len.to_le_bytes());
        b.extend_from_slice(&self.token.to_le_bytes());
        b.extend_from_slice(&self.header);
        b
    }

    fn decode(b: &[u8]) -> Self {
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
        Self {
            req: u32_at(0),
            step: u32_at(4),
            response: b[8] == 1,
            status: u16::from_le_bytes([b[9], b[10]]),
            dst_pod: u32_at(11),
            body: Buffer::new(BufAddr::from_bits(u64_at(15)), u32_at(23)),
            reply: RemoteAddr {
                addr: u64_at(27),
                rkey: u32_at(35),
            },
            reply_slot: Buffer::new(BufAddr::from_bits(u64_at(39)), u32_at(47)),
            token: u32_at(51),
            header: b[55..].to_vec(),
        }
    }
}

/// What one proxy publishes for the other: its pods' RX pools and their rkeys.
#[derive(Default)]
struct Directory {
    /// (pod id, pool, address of the registered region's first byte, rkey) per pod
    /// name.
    rx: HashMap<String, (u32, BufferPool, u64, u32)>,
}

struct Proxy {
    node: Arc<Dpu>,
    port: DpuShard,
    pd: SoftPd,
    cq: SoftCq,
    qp: SoftQp,
    fabric: SoftFabric,
    /// Registered pod pools, by region path.
    regions: HashMap<PathBuf, SoftMr>,
    heads: Arc<SharedRegion>,
    heads_mr: SoftMr,
    mine: Arc<Mutex<Directory>>,
    theirs: Arc<Mutex<Directory>>,
    /// Replies expected: token → (pod, the RX slot granted for the reply body).
    waiting: HashMap<u32, (u32, Buffer)>,
    /// Requests from the peer: (req, step) → where their replies go.
    replies: HashMap<(u32, u32), (RemoteAddr, Buffer, u32)>,
    /// Sends in flight: wr_id → the descriptor to complete when they are done.
    sending: HashMap<u64, Descriptor>,
    next: u64,
}

const HEAD_SLOT: u64 = 64 << 10;
const RECVS: u64 = 32;

impl Proxy {
    fn new(
        node: Arc<Dpu>,
        fabric: SoftFabric,
        pd: SoftPd,
        cq: SoftCq,
        qp: SoftQp,
        mine: Arc<Mutex<Directory>>,
        theirs: Arc<Mutex<Directory>>,
    ) -> Self {
        let port = node.take_shards().remove(0);
        let heads = Arc::new(
            SharedRegion::create_unique("dpumesh-test-heads", (2 * RECVS * HEAD_SLOT) as usize)
                .unwrap(),
        );
        let heads_mr = fabric
            .register(&pd, &heads, 0, 2 * RECVS * HEAD_SLOT, Access::all())
            .unwrap();
        for i in 0..RECVS {
            qp.post_recv(RecvWr {
                wr_id: i,
                sge: heads_mr.sge(i * HEAD_SLOT, HEAD_SLOT as u32),
            })
            .unwrap();
        }
        Self {
            node,
            port,
            pd,
            cq,
            qp,
            fabric,
            regions: HashMap::new(),
            heads,
            heads_mr,
            mine,
            theirs,
            waiting: HashMap::new(),
            replies: HashMap::new(),
            sending: HashMap::new(),
            next: 1 << 32,
        }
    }

    fn mr(&mut self, pool: &BufferPool) -> &SoftMr {
        let path = pool.region().path().to_owned();
        let (fabric, pd) = (&self.fabric, &self.pd);
        self.regions.entry(path).or_insert_with(|| {
            fabric
                .register(
                    pd,
                    pool.region(),
                    0,
                    pool.region().len() as u64,
                    Access::all(),
                )
                .unwrap()
        })
    }

    /// Publishes the RX pools of this node's pods for the peer.
    fn publish(&mut self) {
        for pod in self.node.pods() {
            let (addr, rkey) = {
                let mr = self.mr(&pod.rx_body);
                (mr.addr(), mr.rkey())
            };
            self.mine
                .lock()
                .rx
                .insert(pod.name.clone(), (pod.id, pod.rx_body.clone(), addr, rkey));
        }
    }

    /// Sends a head (and first the body, if any) to the peer; `done` is completed
    /// back to the DMA manager once both have left.
    fn send(
        &mut self,
        body_src: Option<(&PodInfo, Buffer)>,
        body_dst: Option<(RemoteAddr, Buffer)>,
        mut head: WireHead,
        done: Descriptor,
    ) {
        if let (Some((pod, src)), Some((remote, dst))) = (body_src, body_dst) {
            let offset = pod.tx_body.offset_of(src).unwrap();
            let sge = self.mr(&pod.tx_body).sge(offset, src.len);
            self.qp
                .post_send(SendWr {
                    wr_id: 0,
                    op: SendOp::Write(remote),
                    sge,
                    signaled: false,
                })
                .unwrap();
            head.body = dst;
        }
        let bytes = head.encode();
        let slot = RECVS + self.next % RECVS;
        self.heads.write(slot * HEAD_SLOT, &bytes).unwrap();
        let id = self.next;
        self.next += 1;
        // Signaled: its completion means the write before it is done too (in order).
        self.qp
            .post_send(SendWr {
                wr_id: id,
                op: SendOp::Send,
                sge: self.heads_mr.sge(slot * HEAD_SLOT, bytes.len() as u32),
                signaled: true,
            })
            .unwrap();
        self.sending.insert(id, done);
    }

    fn handle_pod(&mut self, d: Descriptor) {
        assert!(
            !d.kind.error,
            "the data path reported {:?}",
            d.error_status()
        );
        let header = self.port.header(&d).unwrap();
        let src = self
            .node
            .pods()
            .into_iter()
            .find(|p| p.id == d.src_pod)
            .expect("the sending pod");
        let mut done = d;
        done.kind.completion = true;
        if d.kind.response {
            // B's reply to a request from the peer: into the slot that came with it.
            let (remote, slot, token) = self
                .replies
                .remove(&(d.req_id, d.step_id))
                .expect("a request to answer");
            let head = WireHead {
                req: d.req_id,
                step: d.step_id,
                response: true,
                status: d.status,
                dst_pod: 0,
                body: Buffer::NONE,
                reply: RemoteAddr::default(),
                reply_slot: Buffer::NONE,
                token,
                header,
            };
            let body = (!d.body.is_none()).then_some((&src, d.body));
            let dst = (!d.body.is_none()).then_some((remote, Buffer::new(slot.addr, d.body.len)));
            self.send(body, dst, head, done);
            return;
        }
        // A's request to svc-b on the peer: a slot in B's RX pool there, and one in
        // A's RX pool here for the reply.
        let (b_id, b_pool, b_addr, b_rkey) = self
            .theirs
            .lock()
            .rx
            .get("pod-b")
            .cloned()
            .expect("pod-b published");
        let body_dst = if d.body.is_none() {
            None
        } else {
            let slot = b_pool.alloc(OwnerId::FABRIC).unwrap();
            let buffer = b_pool.buffer(slot, d.body.len).unwrap();
            let remote = RemoteAddr {
                addr: b_addr + b_pool.offset_of(buffer).unwrap(),
                rkey: b_rkey,
            };
            Some((remote, buffer))
        };
        let reply_slot = src.rx_body.alloc(OwnerId::FABRIC).unwrap();
        let reply_buf = src
            .rx_body
            .buffer(reply_slot, src.rx_body.layout().slot_size)
            .unwrap();
        let reply_remote = {
            let offset = src.rx_body.offset_of(reply_buf).unwrap();
            self.mr(&src.rx_body).remote(offset)
        };
        let token = (self.next & 0xffff_ffff) as u32;
        self.waiting.insert(token, (src.id, reply_buf));
        let head = WireHead {
            req: d.req_id,
            step: d.step_id,
            response: false,
            status: 0,
            dst_pod: b_id,
            body: Buffer::NONE,
            reply: reply_remote,
            reply_slot: reply_buf,
            token,
            header,
        };
        let body_src = (!d.body.is_none()).then_some((&src, d.body));
        self.send(body_src, body_dst, head, done);
    }

    fn handle_fabric(&mut self, slot: u64, len: u32) {
        let bytes = self.heads.read_vec(slot * HEAD_SLOT, len as usize).unwrap();
        self.qp
            .post_recv(RecvWr {
                wr_id: slot,
                sge: self.heads_mr.sge(slot * HEAD_SLOT, HEAD_SLOT as u32),
            })
            .unwrap();
        let head = WireHead::decode(&bytes);
        let header = self.port.alloc_header(&head.header).unwrap();
        let (dst, body, case) = if head.response {
            let (pod, granted) = self
                .waiting
                .remove(&head.token)
                .expect("a reply we asked for");
            let pool = self
                .node
                .pods()
                .into_iter()
                .find(|p| p.id == pod)
                .unwrap()
                .rx_body;
            let body = if head.body.is_none() {
                // Nothing was written: give the granted slot back.
                let s = pool.slot_of(granted).unwrap();
                pool.release(s, OwnerId::FABRIC).unwrap();
                Buffer::NONE
            } else {
                head.body
            };
            (pod, body, Case::ExternalToHost)
        } else {
            self.replies.insert(
                (head.req, head.step),
                (head.reply, head.reply_slot, head.token),
            );
            (head.dst_pod, head.body, Case::ExternalToHost)
        };
        let mut d = Descriptor::request(case, head.req, head.step, 0, Destination::Pod(dst))
            .with_header(header)
            .with_body(body);
        d.kind.response = head.response;
        d.status = head.status;
        self.port.forward(&d).unwrap();
    }

    fn run(mut self, stop: Arc<AtomicBool>) {
        let mut completions = Vec::new();
        while !stop.load(Ordering::Relaxed) {
            self.publish();
            while let Some(d) = self.port.try_recv().unwrap() {
                self.handle_pod(d);
            }
            // The shard's contract: pods given descriptors are woken once per batch
            // (without it a sleeping pod sees them only when its own wait times out,
            // and the node takes it for a pod that stopped reading).
            self.port.wake_pods();
            completions.clear();
            self.cq.wait(Duration::from_millis(1)).unwrap();
            self.cq.poll(&mut completions, 64);
            for wc in completions.drain(..) {
                if stop.load(Ordering::Relaxed) {
                    // The other proxy may have stopped first and closed the pair.
                    return;
                }
                assert_eq!(wc.status, WcStatus::Success, "{}: {wc:?}", self.node.name());
                match wc.opcode {
                    WcOpcode::Recv => self.handle_fabric(wc.wr_id, wc.byte_len),
                    WcOpcode::Send => {
                        if let Some(done) = self.sending.remove(&wc.wr_id) {
                            // The body left A's (or B's) memory: its slot goes back.
                            self.port.forward(&done).unwrap();
                        }
                    }
                    _ => {}
                }
            }
        }
    }
}

fn start_node(dir: &Path, name: &str) -> Arc<Dpu> {
    let mut config = DpuConfig::new(name);
    config.pod.body_slots = 8;
    Arc::new(Dpu::start(config, &Endpoint::Unix(dir.join(format!("{name}.sock")))).unwrap())
}

#[test]
fn cases_1_and_2_carry_requests_and_replies_across_nodes_over_the_fabric() {
    let dir = tempfile::tempdir().unwrap();
    let node1 = start_node(dir.path(), "n1");
    let node2 = start_node(dir.path(), "n2");

    // The two proxies' queue pair.
    let fabric = SoftFabric::new();
    let (pd1, pd2) = (fabric.alloc_pd().unwrap(), fabric.alloc_pd().unwrap());
    let (cq1, cq2) = (
        fabric.create_cq(1024).unwrap(),
        fabric.create_cq(1024).unwrap(),
    );
    let listener = fabric
        .listen(
            &pd2,
            "127.0.0.1:0".parse().unwrap(),
            &cq2,
            QpCaps::default(),
        )
        .unwrap();
    let peer = listener.local_addr();
    let accept =
        std::thread::spawn(move || listener.accept(Duration::from_secs(10)).unwrap().unwrap());
    let qp1 = fabric.connect(&pd1, peer, &cq1, QpCaps::default()).unwrap();
    let qp2 = dpumesh_test_support::joined(accept);

    let dir1 = Arc::new(Mutex::new(Directory::default()));
    let dir2 = Arc::new(Mutex::new(Directory::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let p1 = Proxy::new(
        node1.clone(),
        fabric.clone(),
        pd1,
        cq1,
        qp1,
        dir1.clone(),
        dir2.clone(),
    );
    let p2 = Proxy::new(
        node2.clone(),
        fabric.clone(),
        pd2,
        cq2,
        qp2,
        dir2.clone(),
        dir1.clone(),
    );
    let proxies = [p1, p2].map(|p| {
        let stop = stop.clone();
        std::thread::spawn(move || p.run(stop))
    });

    let mut b = spawn_pod("b", &dir.path().join("n2.sock"), "");
    let deadline = Instant::now() + Duration::from_secs(20);
    while node2.pods().is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    while !dir2.lock().rx.contains_key("pod-b") && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut a = spawn_pod("a", &dir.path().join("n1.sock"), &peer.to_string());
    assert!(a.0.wait().unwrap().success(), "pod A checked every reply");
    assert!(b.0.wait().unwrap().success(), "pod B checked every request");

    stop.store(true, Ordering::Relaxed);
    for p in proxies {
        dpumesh_test_support::joined(p);
    }
    let s1 = node1.stats();
    let s2 = node2.stats();
    // Node 1 took A's requests in and delivered B's replies; node 2 the other way.
    assert_eq!(s1.intake.load(Ordering::Relaxed), 3);
    assert_eq!(s2.intake.load(Ordering::Relaxed), 3);
    assert_eq!(s1.delivered.load(Ordering::Relaxed), 3);
    assert_eq!(s2.delivered.load(Ordering::Relaxed), 3);
    assert_eq!(
        s1.errors.load(Ordering::Relaxed) + s2.errors.load(Ordering::Relaxed),
        0
    );
    // The bodies never went through a DPU pool: node 1 copied only heads.
    assert!(
        s1.bytes.load(Ordering::Relaxed) < 1 << 20,
        "bodies crossed by RDMA, not DMA copies"
    );
    assert_eq!(node1.dpu_pool_use(), (0, 0));
    assert_eq!(node2.dpu_pool_use(), (0, 0));
}

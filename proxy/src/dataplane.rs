//! The DPU proxy's data flow: heads come in from the fabric (the ingress,
//! or a peer node's proxy) and from the node's pods (sidecar TX SQ); the route's filter
//! chain runs on the workers; a denial is answered at once and the body never moves;
//! an allowed request goes to a pod of the service on this node (round robin) or, for a
//! pod's egress call to a service elsewhere, to the proxy of a node that runs it.
//! Responses come back the same way and pass the response phase.
//!
//! ```text
//! ingress ─Request(head, body@ingress, reply@ingress)─▶ link ─┐
//!                                                              ├▶ route → chain (workers)
//! pod A ─TX SQ─▶ DMA manager ─sidecar TX SQ──────────────────┘        │
//!   deny: local reply ◀──────────────────────────────────────────────┤
//!   allow, pod B here: [READ body → B's RX pool] → sidecar RX SQ → DMA → B
//!   allow, elsewhere:  Request(policed, body@A's TX pool, reply@A's RX pool) → peer
//! B's reply: sidecar TX SQ → [WRITE body → reply buffer] → Response → origin
//! ```
//!
//! One reactor thread owns every queue pair, the sidecar port and the in-flight
//! exchanges. It sleeps on the fabric completion queue; the DMA manager and the
//! workers interrupt that sleep when they hand it work.

use std::collections::{BTreeMap, BinaryHeap, HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use dpumesh_dpa::bell::{Bell, WaitSet};
use dpumesh_dpa::fabric::{
    CompletionQueue, Fabric, MemoryRegion, QpCaps, QpListener, WcStatus, WorkCompletion,
};
use dpumesh_dpa::frame::{Message, RemoteBuf, Request, RequestFlags, Response, ResponseBody};
use dpumesh_dpa::link::{Link, LinkEvent};
use dpumesh_dpa::{
    Buffer, BufferPool, Case, Descriptor, Destination, Dpu, DpuShard, OwnerId, PodInfo, Polling,
    Spin, Waited,
};
use dpumesh_error::{ErrorKind, ProxyError, Source, UpstreamFailure};
use dpumesh_head::wire::{self, ResponseHead};
use dpumesh_runtime::{
    Decision, FailureKind, LocalChains, Peer, PoolError, RequestDone, RequestHead, ResponseInfo,
    Ticket,
};
use dpumesh_supervise::{RestartPolicy, Supervisor};
use http::{HeaderMap, HeaderName, HeaderValue};

use crate::policy::Policy;
use dpumesh_config::RoutePolicy;

/// Where the other nodes are and what runs where.
#[derive(Debug, Clone, Default)]
pub struct Topology {
    /// This node's name.
    pub node: String,
    /// Other nodes' fabric addresses.
    pub peers: BTreeMap<String, SocketAddr>,
    /// Nodes running each service.
    pub placement: BTreeMap<String, Vec<String>>,
    /// How long a request may take when its route sets no timeout.
    pub timeout: Duration,
}

/// Counters, readable from any thread.
#[derive(Debug, Default)]
pub struct DataplaneStats {
    /// Requests taken in (fabric and pods).
    pub requests: AtomicU64,
    /// Answered by the proxy itself (denials, errors).
    pub local_replies: AtomicU64,
    /// Responses relayed from pods and peers.
    pub relayed: AtomicU64,
    /// Exchanges that timed out.
    pub timeouts: AtomicU64,
    /// Exchanges in flight.
    pub in_flight: AtomicU64,
}

/// A running data plane.
pub struct Dataplane {
    stop: Arc<AtomicBool>,
    accept_stop: Arc<AtomicBool>,
    bell: Bell,
    thread: Option<JoinHandle<()>>,
    addr: SocketAddr,
    stats: Arc<DataplaneStats>,
    supervisor: Arc<Supervisor>,
    #[cfg(feature = "fault-injection")]
    inbox: Sender<Inbox>,
}

impl std::fmt::Debug for Dataplane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dataplane")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl Dataplane {
    /// Starts the reactor: listens for queue pairs at `listen` and takes the node's
    /// first shard (its pods' rings and pools, its DMA work and its bell); the
    /// reactor runs every request's chain inline, polls as `polling` says after its
    /// last work, then sleeps on one epoll set (the shard's bell and its completion
    /// queue).
    pub fn start<F: Fabric>(
        fabric: F,
        listen: SocketAddr,
        dpu: Arc<Dpu>,
        policy: Arc<Policy>,
        topology: Topology,
        polling: Polling,
    ) -> anyhow::Result<Self> {
        let pd = fabric.alloc_pd()?;
        // Every link's receives and sends complete here.
        let cq = fabric.create_cq(1 << 16)?;
        let listener = fabric.listen(&pd, listen, &cq, QpCaps::default())?;
        let addr = listener.local_addr();
        // Accepting (with the peer's hello) may block on a slow or silent connection:
        // never on the reactor.
        let (accepted_tx, accepted) = crossbeam_channel::unbounded();
        let accept_stop = Arc::new(AtomicBool::new(false));
        let port = dpu
            .take_shards()
            .into_iter()
            .next()
            .ok_or_else(|| anyhow::anyhow!("the node's shards are taken"))?;
        let bell = port.bell().clone();
        let mut waits = WaitSet::new()?;
        waits.add(bell.fd(), 0)?;
        if let Some(fd) = cq.wait_fd() {
            waits.add(fd, 1)?;
        }
        let chains = LocalChains::new(SHARD_RUNNER, policy.snapshot().generation.clone());
        let generation = policy.add_runner();
        let supervisor = Supervisor::new();
        supervisor.spawn(
            "dpumesh-accept",
            RestartPolicy::default(),
            (listener, accepted_tx, accept_stop.clone(), bell.clone()),
            |(listener, accepted, stop, bell)| {
                while !stop.load(Ordering::Relaxed) {
                    match listener.accept(Duration::from_millis(100)) {
                        Ok(Some(qp)) => {
                            if accepted.send(qp).is_err() {
                                return;
                            }
                            bell.ring();
                        }
                        Ok(None) => {}
                        Err(e) => {
                            tracing::warn!(error = %e, "mesh accept failed");
                            std::thread::sleep(Duration::from_millis(100));
                        }
                    }
                }
            },
            |_| {},
        )?;
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(DataplaneStats::default());
        let (inbox_tx, inbox) = crossbeam_channel::unbounded();
        let reactor = Reactor {
            fabric,
            pd,
            cq,
            accepted,
            connect_failed: HashMap::new(),
            links: HashMap::new(),
            peer_links: HashMap::new(),
            port,
            chains,
            generation,
            waits,
            dpu,
            policy,
            topology,
            pods: Vec::new(),
            pods_at: Instant::now() - Duration::from_secs(1),
            regions: HashMap::new(),
            exchanges: HashMap::new(),
            at_pod: HashMap::new(),
            transfers: HashMap::new(),
            orphans: HashMap::new(),
            next_xid: 1,
            next_transfer: 1,
            pod_turns: HashMap::new(),
            node_turns: HashMap::new(),
            timers: BinaryHeap::new(),
            inbox,
            inbox_tx,
            bell: bell.clone(),
            stats: stats.clone(),
            stop: stop.clone(),
            completions: Vec::with_capacity(64),
            deferred: VecDeque::new(),
            spin: Spin::new(polling),
        };
        #[cfg(feature = "fault-injection")]
        let inbox = reactor.inbox_tx.clone();
        let thread = supervisor.spawn(
            "dpumesh-dataplane",
            RestartPolicy::default(),
            reactor,
            Reactor::run,
            Reactor::recover,
        )?;
        Ok(Self {
            stop,
            accept_stop,
            bell,
            thread: Some(thread),
            addr,
            stats,
            supervisor,
            #[cfg(feature = "fault-injection")]
            inbox,
        })
    }

    /// The data plane's threads (the reactor, the accept loop), for readiness.
    pub fn supervisor(&self) -> &Arc<Supervisor> {
        &self.supervisor
    }

    /// Makes the reactor thread panic at its next turn (tests of supervision).
    #[cfg(feature = "fault-injection")]
    pub fn inject_panic(&self) {
        let _ = self.inbox.send(Inbox::Panic);
        self.bell.ring();
    }

    /// Where peers and the ingress connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Counters.
    pub fn stats(&self) -> &Arc<DataplaneStats> {
        &self.stats
    }
}

impl Drop for Dataplane {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.accept_stop.store(true, Ordering::SeqCst);
        self.bell.interrupt();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What the workers hand back.
enum Inbox {
    Decided {
        xid: u32,
        done: Result<Box<RequestDone>, PoolError>,
    },
    /// Panic (tests of supervision).
    #[cfg(feature = "fault-injection")]
    Panic,
}

/// Where a request came from (and where its answer goes).
enum Origin {
    /// Over the fabric: the ingress or a peer proxy.
    Link { qp: u32, xid: u32, reply: RemoteBuf },
    /// A pod on this node; `d` is its descriptor as the DMA manager handed it over
    /// (its header in a DPU pool, its body still in the pod's TX pool).
    Pod { d: Descriptor },
}

/// Where an allowed request went.
enum Stage {
    /// Waiting for the chain.
    Filtering,
    /// Its body is being read into a pod's RX pool.
    Reading,
    /// Delivered to pod `pod`; its reply is awaited under `key` and must come from it.
    Pod { key: PodKey, pod: u32 },
    /// Sent to a peer proxy.
    Peer { qp: u32, reply_slot: Buffer },
}

/// How a pod's reply names the request: (the pod it goes to, req_id, step_id). The
/// proxy's own deliveries go to "pod 0" (outside the node).
type PodKey = (u32, u32, u32);

struct Exchange {
    origin: Origin,
    head: Option<RequestHead>,
    service: String,
    ticket: Option<Ticket>,
    started: Instant,
    deadline: Instant,
    stage: Stage,
    /// Body waiting at the origin's side of a link.
    body: Option<RemoteBuf>,
    /// Tries so far.
    attempt: u32,
    /// Timeout and retries of its route.
    policy: RoutePolicy,
    /// When the current try times out.
    try_deadline: Option<Instant>,
    /// GET, HEAD, OPTIONS, PUT, DELETE, TRACE.
    idempotent: bool,
    /// The request came with a body (a pod's body is handed on by the first try).
    had_body: bool,
}

enum Transfer {
    /// A request body read into pod `pod`'s RX slot `slot`; `header` (in a DPU pool)
    /// goes with it once it is in.
    Read {
        qp: u32,
        xid: u32,
        pod: u32,
        slot: Buffer,
        header: Buffer,
    },
    /// A response body written out of a pod's TX pool; `done` hands it back.
    Write { qp: u32, done: Descriptor },
}

/// A call to a peer that was answered locally (timeout) while the peer may still use
/// the caller's body and reply slot.
struct Orphan {
    qp: u32,
    d: Descriptor,
    reply_slot: Buffer,
}

struct LinkState<F: Fabric> {
    link: Link<F>,
    /// The peer node this link was connected to (`None`: accepted).
    node: Option<String>,
}

struct PodRegions<F: Fabric> {
    rx: F::Mr,
    tx: F::Mr,
    rx_pool: BufferPool,
    tx_pool: BufferPool,
}

struct Reactor<F: Fabric> {
    fabric: F,
    pd: F::Pd,
    cq: F::Cq,
    /// Queue pairs the accept thread took.
    accepted: Receiver<F::Qp>,
    /// Peers whose connect failed, and when (not tried again for a second).
    connect_failed: HashMap<String, Instant>,
    links: HashMap<u32, LinkState<F>>,
    peer_links: HashMap<String, u32>,
    port: DpuShard,
    /// The chains this reactor runs inline, per generation.
    chains: LocalChains,
    /// The generation it runs new requests on (readiness reads it).
    generation: Arc<AtomicU64>,
    /// Its one wait set: the shard's bell (pods, the accept loop, offloaded chains,
    /// shutdown) and the fabric completion queue.
    waits: WaitSet,
    dpu: Arc<Dpu>,
    policy: Arc<Policy>,
    topology: Topology,
    pods: Vec<PodInfo>,
    pods_at: Instant,
    regions: HashMap<u32, PodRegions<F>>,
    exchanges: HashMap<u32, Exchange>,
    at_pod: HashMap<PodKey, u32>,
    transfers: HashMap<u64, Transfer>,
    orphans: HashMap<u32, Orphan>,
    next_xid: u32,
    next_transfer: u64,
    /// Round-robin turns over a service's pods here, and over the nodes running it.
    pod_turns: HashMap<String, usize>,
    node_turns: HashMap<String, usize>,
    timers: BinaryHeap<std::cmp::Reverse<(Instant, u32)>>,
    inbox: Receiver<Inbox>,
    inbox_tx: Sender<Inbox>,
    bell: Bell,
    stats: Arc<DataplaneStats>,
    stop: Arc<AtomicBool>,
    completions: Vec<WorkCompletion>,
    /// Descriptors the DMA manager's ring had no room for, in order.
    deferred: VecDeque<Descriptor>,
    /// How long to keep polling after the last work before sleeping.
    spin: Spin,
}

/// The round-robin counter of `key` in `turns`, advanced (allocates only the first
/// time a key is seen).
fn next_turn(turns: &mut HashMap<String, usize>, key: &str) -> usize {
    match turns.get_mut(key) {
        Some(n) => {
            *n = n.wrapping_add(1);
            *n
        }
        None => {
            turns.insert(key.to_owned(), 0);
            0
        }
    }
}

/// The runner id of a shard's inline chains in tickets (pool workers count from 0).
const SHARD_RUNNER: usize = usize::MAX;

/// Largest local reply body sent inline to the fabric (a frame holds 64 KiB).
const MAX_LOCAL_BODY: usize = 16 << 10;

/// How a request the proxy ended counts for the response phase (the circuit breaker
/// counts only upstream failures): read from the error's kind, in this one place.
fn failure_kind(e: &ProxyError) -> FailureKind {
    match e.upstream_failure() {
        Some(UpstreamFailure::Connect) => FailureKind::ConnectFailure,
        Some(UpstreamFailure::Reset) => FailureKind::UpstreamReset,
        Some(UpstreamFailure::Timeout) => FailureKind::Timeout,
        None => match e.source() {
            // Nothing upstream saw the request: like a filter's denial, not the
            // service's failure.
            Source::Downstream | Source::Policy => FailureKind::LocalReply,
            Source::Internal | Source::Upstream => FailureKind::Internal,
        },
    }
}

impl<F: Fabric> Reactor<F> {
    /// After a panic in [`Reactor::run`]: the exchanges' state cannot be trusted, so
    /// every link goes (the ingress and peer nodes fail what they sent over them at
    /// once, and reconnect on their next request), and every exchange still open is
    /// answered with a 503. Descriptors owed to the DMA manager are kept.
    fn recover(&mut self) {
        let qps: Vec<u32> = self.links.keys().copied().collect();
        for qp in qps {
            self.link_down(
                qp,
                "the data plane thread restarted after a panic".to_owned(),
            );
        }
        let open: Vec<u32> = self.exchanges.keys().copied().collect();
        for xid in open {
            let e = ProxyError::new(
                ErrorKind::ThreadLost,
                "the data plane thread restarted after a panic",
            );
            self.fail(xid, e);
        }
        self.at_pod.clear();
        self.timers.clear();
        self.regions.clear();
        self.stats.in_flight.store(0, Ordering::Relaxed);
    }

    fn run(&mut self) {
        let mut last_tick = Instant::now() - Duration::from_secs(1);
        // Since when the loop has found nothing to do (it polls until the spin's
        // budget is spent, then sleeps).
        let mut idle_since: Option<Instant> = None;
        // What a pass posts on its links leaves together at the pass's end (one write
        // per link on the TCP fabric instead of one per frame).
        self.cq.hold_sends(true);
        while !self.stop.load(Ordering::Relaxed) {
            let mut work = 0;
            work += self.drain_sidecar();
            work += self.drain_completions();
            work += self.drain_inbox();
            work += self.flush_deferred();
            self.expire();
            if !self.accepted.is_empty() {
                self.accept();
            }
            if last_tick.elapsed() >= Duration::from_millis(20) {
                last_tick = Instant::now();
                self.forget_departed_pods();
                self.publish_occupancy();
                self.follow_generation();
            }
            // One wake-up per pod, one send per link, for everything this pass did.
            self.port.wake_pods();
            self.cq.flush_sends();
            if work > 0 {
                if idle_since.take().is_some() {
                    self.spin.record(Waited::WhilePolling);
                }
                continue;
            }
            let now = Instant::now();
            let since = *idle_since.get_or_insert(now);
            match self.spin.budget() {
                None => {
                    std::hint::spin_loop();
                    continue;
                }
                Some(budget) if now - since < budget => {
                    std::hint::spin_loop();
                    continue;
                }
                Some(_) => {}
            }
            let (slept, woken) = self.sleep();
            idle_since = None;
            self.spin.record(if woken {
                Waited::Slept(slept)
            } else {
                Waited::Nothing
            });
        }
        self.cq.hold_sends(false);
    }

    /// Builds the instances of a newly published generation between requests, so the
    /// next request does not wait for them.
    fn follow_generation(&mut self) {
        let published = self.policy.snapshot().generation.clone();
        if published.number() != self.chains.generation() {
            self.chains.switch(&published);
        }
        self.generation
            .store(self.chains.generation(), Ordering::Release);
    }

    /// Sleeps on the wait set until something arrives (the shard's bell: a pod sent, a
    /// chain finished on the pool, a link was accepted; the completion queue) or the
    /// next timer is due.
    /// Returns how long it slept and whether something woke it (rather than the
    /// timeout).
    fn sleep(&mut self) -> (Duration, bool) {
        let mut timeout = self
            .timers
            .peek()
            .map(|t| t.0.0.saturating_duration_since(Instant::now()))
            .unwrap_or(Duration::from_millis(20))
            .min(Duration::from_millis(20));
        if self.port.holding() || !self.deferred.is_empty() {
            // Pods do not say when they make room in their rings: look again soon.
            timeout = timeout.min(Duration::from_micros(200));
        }
        let started = Instant::now();
        let mut woken = true;
        self.bell.sleep_begins();
        let sleep = self.cq.prepare_sleep();
        if sleep && !self.port.has_work() && self.inbox.is_empty() && self.accepted.is_empty() {
            woken = self.waits.wait(timeout).is_ok_and(|n| n > 0);
        }
        self.cq.finish_sleep();
        self.bell.sleep_ends();
        self.bell.drain();
        (started.elapsed(), woken)
    }

    fn accept(&mut self) {
        while let Ok(qp) = self.accepted.try_recv() {
            match Link::new(&self.fabric, &self.pd, qp) {
                Ok(link) => {
                    tracing::debug!(qp = link.qp_num(), "mesh link accepted");
                    self.links
                        .insert(link.qp_num(), LinkState { link, node: None });
                }
                Err(e) => tracing::warn!(error = %e, "cannot set up an accepted mesh link"),
            }
        }
    }

    // === intake ===

    fn drain_sidecar(&mut self) -> usize {
        let mut n = 0;
        while n < 64 {
            let d = match self.port.try_recv() {
                Ok(Some(d)) => d,
                Ok(None) => break,
                Err(e) => {
                    tracing::error!(error = %e, "sidecar ring: undecodable descriptor");
                    n += 1;
                    continue;
                }
            };
            n += 1;
            if d.kind.error {
                self.delivery_failed(d);
            } else if d.kind.response {
                self.pod_response(d);
            } else {
                self.pod_request(d);
            }
        }
        n
    }

    fn drain_completions(&mut self) -> usize {
        self.completions.clear();
        let mut completions = std::mem::take(&mut self.completions);
        self.cq.poll(&mut completions, 64);
        let n = completions.len();
        for wc in completions.drain(..) {
            let Some(state) = self.links.get_mut(&wc.qp_num) else {
                continue;
            };
            match state.link.on_completion(&wc) {
                Ok(None) => {}
                Ok(Some(LinkEvent::Message(m))) => self.link_message(wc.qp_num, m),
                Ok(Some(LinkEvent::OpDone(token))) => self.transfer_done(token, None),
                Ok(Some(LinkEvent::OpFailed(token, status))) => {
                    self.transfer_done(token, Some(status));
                    self.link_down(wc.qp_num, format!("{status:?}"));
                }
                Err(e) => self.link_down(wc.qp_num, e.to_string()),
            }
        }
        self.completions = completions;
        n
    }

    fn drain_inbox(&mut self) -> usize {
        let mut n = 0;
        while let Ok(item) = self.inbox.try_recv() {
            n += 1;
            match item {
                Inbox::Decided { xid, done } => self.decided(xid, done),
                #[cfg(feature = "fault-injection")]
                Inbox::Panic => panic!("injected data plane panic"),
            }
        }
        n
    }

    fn link_message(&mut self, qp: u32, message: Message) {
        match message {
            Message::Request(r) => self.link_request(qp, r),
            Message::Response(r) => self.peer_response(qp, r),
            Message::Credit => {}
        }
    }

    fn new_xid(&mut self) -> u32 {
        loop {
            let xid = self.next_xid;
            self.next_xid = self.next_xid.wrapping_add(1).max(1);
            if !self.exchanges.contains_key(&xid) && !self.orphans.contains_key(&xid) {
                return xid;
            }
        }
    }

    /// A request from the ingress or a peer proxy.
    fn link_request(&mut self, qp: u32, r: Request) {
        self.stats.requests.fetch_add(1, Ordering::Relaxed);
        let origin = Origin::Link {
            qp,
            xid: r.xid,
            reply: r.reply,
        };
        let head = match wire::decode_request(&r.head) {
            Ok(head) => head,
            Err(e) => {
                let e = ProxyError::new(
                    ErrorKind::MalformedRequest,
                    format!("malformed request head: {e}"),
                );
                self.reply_origin_error(&origin, &e);
                return;
            }
        };
        let limit = (r.deadline_ms > 0).then(|| Duration::from_millis(u64::from(r.deadline_ms)));
        self.admit(origin, head, r.body, r.flags, limit);
    }

    /// A request from a pod on this node (case 1 or 3).
    fn pod_request(&mut self, d: Descriptor) {
        self.stats.requests.fetch_add(1, Ordering::Relaxed);
        let origin = Origin::Pod { d };
        let bytes = match self.port.header(&d) {
            Ok(b) => b,
            Err(e) => {
                let e = ProxyError::new(
                    ErrorKind::MalformedRequest,
                    format!("unreadable request head: {e}"),
                );
                self.reply_origin_error(&origin, &e);
                return;
            }
        };
        let mut head = match wire::decode_request(&bytes) {
            Ok(head) => head,
            Err(e) => {
                let e = ProxyError::new(
                    ErrorKind::MalformedRequest,
                    format!("malformed request head: {e}"),
                );
                self.reply_origin_error(&origin, &e);
                return;
            }
        };
        // Who is calling is the data path's to say, not the pod's.
        let service = self.pod(d.src_pod).map(|p| p.service.clone());
        head.source = Peer {
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            identity: service.map(|s| format!("spiffe://dpumesh/{}/{s}", self.topology.node)),
        };
        self.admit(origin, head, None, RequestFlags::default(), None);
    }

    /// Routes a request and runs its chain (unless a peer proxy already did).
    fn admit(
        &mut self,
        origin: Origin,
        mut head: RequestHead,
        body: Option<RemoteBuf>,
        flags: RequestFlags,
        limit: Option<Duration>,
    ) {
        let snapshot = self.policy.snapshot();
        let routed = if flags.policed {
            head.destination.clone().map(|s| {
                let policy = snapshot.service_policy(&s);
                (s, usize::MAX, policy)
            })
        } else {
            snapshot.resolve(&head.authority, &head.path)
        };
        let Some((service, chain, policy)) = routed else {
            let e = ProxyError::new(
                ErrorKind::NoRoute,
                format!(
                    "no route for host {:?} path {:?}",
                    head.authority, head.path
                ),
            );
            self.reply_origin_error(&origin, &e);
            return;
        };
        head.destination = Some(service.clone());
        let xid = self.new_xid();
        let now = Instant::now();
        // The route's timeout, within what the sender will wait.
        let timeout = policy.timeout.unwrap_or(self.topology.timeout);
        let timeout = limit.map_or(timeout, |l| l.min(timeout));
        let deadline = now + timeout;
        self.timers.push(std::cmp::Reverse((deadline, xid)));
        let had_body = match &origin {
            Origin::Link { .. } => body.is_some(),
            Origin::Pod { d } => !d.body.is_none(),
        };
        let idempotent = matches!(
            head.method.as_str(),
            "GET" | "HEAD" | "OPTIONS" | "PUT" | "DELETE" | "TRACE"
        );
        self.exchanges.insert(
            xid,
            Exchange {
                origin,
                head: None,
                service,
                ticket: None,
                started: now,
                deadline,
                stage: Stage::Filtering,
                body,
                attempt: 0,
                policy,
                try_deadline: None,
                idempotent,
                had_body,
            },
        );
        self.stats.in_flight.fetch_add(1, Ordering::Relaxed);
        if flags.policed {
            let exchange = self.exchanges.get_mut(&xid).expect("just added");
            exchange.head = Some(head);
            self.dispatch(xid);
            return;
        }
        let generation = &snapshot.generation;
        if !generation.chains()[chain].offload() {
            // Run to completion here: the chain's instances are this thread's.
            let done = self.chains.on_request(generation, chain, head);
            self.decided(xid, Ok(Box::new(done)));
            return;
        }
        // A chain with a filter slow by nature runs on the pool; its verdict comes
        // back through the inbox and the bell.
        let inbox = self.inbox_tx.clone();
        let bell = self.bell.clone();
        let submitted =
            self.policy
                .pool()
                .request_with(generation.clone(), chain, head, move |done| {
                    let _ = inbox.send(Inbox::Decided {
                        xid,
                        done: done.map(Box::new),
                    });
                    bell.ring();
                });
        if let Err(e) = submitted {
            self.fail(xid, pool_error(e));
        }
    }

    /// Runs a response phase where its request phase ran: inline, or on the pool for
    /// an offloaded chain. Response filters do not edit the response, so nobody waits
    /// for the result.
    fn run_response_phase(&mut self, ticket: Ticket, head: RequestHead, info: ResponseInfo) {
        if ticket.worker == SHARD_RUNNER {
            self.chains.on_response(&ticket, head, &info);
        } else {
            let _ = self.policy.pool().response_with(ticket, head, info, |_| {});
        }
    }

    /// The chain decided (or its worker died with the request).
    fn decided(&mut self, xid: u32, done: Result<Box<RequestDone>, PoolError>) {
        let done = match done {
            Ok(done) => *done,
            Err(e) => {
                self.fail(xid, pool_error(e));
                return;
            }
        };
        let Some(exchange) = self.exchanges.get_mut(&xid) else {
            // Timed out while filtering: the response phase still runs.
            let info = ResponseInfo {
                status: 504,
                latency_ns: 0,
                upstream: None,
                failure: FailureKind::Timeout,
            };
            self.run_response_phase(done.ticket, done.outcome.head, info);
            return;
        };
        exchange.ticket = Some(done.ticket);
        let outcome = done.outcome;
        match outcome.decision {
            Decision::Deny { filter, reply, .. } => {
                metrics::counter!(
                    "dpumesh_denials_total",
                    "service" => exchange.service.clone(),
                    "filter" => filter.to_string(),
                    "status" => reply.status.to_string(),
                )
                .increment(1);
                exchange.head = Some(outcome.head);
                let mut headers = HeaderMap::new();
                for (name, value) in &reply.headers {
                    if let (Ok(n), Ok(v)) = (
                        HeaderName::from_bytes(name.as_bytes()),
                        HeaderValue::from_str(value),
                    ) {
                        headers.append(n, v);
                    }
                }
                let head = ResponseHead {
                    status: reply.status,
                    headers,
                };
                self.finish_with(xid, &head, reply.body.into_bytes(), FailureKind::LocalReply);
            }
            Decision::Continue => {
                exchange.head = Some(outcome.head);
                self.dispatch(xid);
            }
        }
    }

    // === dispatch ===

    fn refresh_pods(&mut self, force: bool) {
        if force || self.pods_at.elapsed() >= Duration::from_millis(100) {
            self.pods = self.dpu.pods();
            self.pods_at = Instant::now();
        }
    }

    fn pod(&mut self, id: u32) -> Option<&PodInfo> {
        if !self.pods.iter().any(|p| p.id == id) {
            self.refresh_pods(true);
        }
        self.pods.iter().find(|p| p.id == id)
    }

    /// The next pod of `service` on this node, round robin.
    fn pick_pod(&mut self, service: &str) -> Option<u32> {
        self.refresh_pods(false);
        let mut count = self.pods.iter().filter(|p| p.service == service).count();
        if count == 0 {
            self.refresh_pods(true);
            count = self.pods.iter().filter(|p| p.service == service).count();
        }
        if count == 0 {
            return None;
        }
        let n = next_turn(&mut self.pod_turns, service);
        self.pods
            .iter()
            .filter(|p| p.service == service)
            .nth(n % count)
            .map(|p| p.id)
    }

    /// Pod `pod`'s body pools, registered with the fabric (once) for READs and WRITEs.
    fn pod_regions(&mut self, pod: u32) -> Option<&PodRegions<F>> {
        if !self.regions.contains_key(&pod) {
            let info = self.pod(pod)?.clone();
            let register = |pool: &BufferPool| {
                self.fabric.register(
                    &self.pd,
                    pool.region(),
                    0,
                    pool.region().len() as u64,
                    dpumesh_dpa::fabric::Access::all(),
                )
            };
            let (rx, tx) = match (register(&info.rx_body), register(&info.tx_body)) {
                (Ok(rx), Ok(tx)) => (rx, tx),
                (Err(e), _) | (_, Err(e)) => {
                    tracing::error!(pod, error = %e, "cannot register a pod's body pools");
                    return None;
                }
            };
            self.regions.insert(
                pod,
                PodRegions {
                    rx,
                    tx,
                    rx_pool: info.rx_body,
                    tx_pool: info.tx_body,
                },
            );
        }
        self.regions.get(&pod)
    }

    /// Drops the registrations of pods that left (their memory can go).
    fn forget_departed_pods(&mut self) {
        self.refresh_pods(true);
        let live: std::collections::HashSet<u32> = self.pods.iter().map(|p| p.id).collect();
        self.regions.retain(|id, _| live.contains(id));
    }

    /// Publishes the node's occupancy: pods, exchanges in flight, slots in use per
    /// pool.
    fn publish_occupancy(&self) {
        let (tx, rx) = self.dpu.dpu_pool_use();
        let bodies: usize = self
            .pods
            .iter()
            .map(|p| p.rx_body.in_use() + p.tx_body.in_use())
            .sum();
        metrics::gauge!("dpumesh_pods").set(self.pods.len() as f64);
        metrics::gauge!("dpumesh_exchanges_in_flight").set(self.exchanges.len() as f64);
        metrics::gauge!("dpumesh_pool_slots_in_use", "pool" => "dpu_tx_header").set(tx as f64);
        metrics::gauge!("dpumesh_pool_slots_in_use", "pool" => "dpu_rx_header").set(rx as f64);
        metrics::gauge!("dpumesh_pool_slots_in_use", "pool" => "pod_bodies").set(bodies as f64);
    }

    fn dispatch(&mut self, xid: u32) {
        let Some(exchange) = self.exchanges.get(&xid) else {
            return;
        };
        let service = exchange.service.clone();
        let from_pod = matches!(exchange.origin, Origin::Pod { .. });
        if let Some(pod) = self.pick_pod(&service) {
            self.send_to_pod(xid, pod);
            return;
        }
        let peer = from_pod.then(|| self.pick_peer(&service)).flatten();
        match peer {
            Some(node) => self.send_to_peer(xid, &node),
            None => {
                let e = ProxyError::new(
                    ErrorKind::NoEndpoint,
                    format!(
                        "no endpoint for service {service:?} on node {:?}",
                        self.topology.node
                    ),
                );
                self.fail(xid, e);
            }
        }
    }

    fn pick_peer(&mut self, service: &str) -> Option<String> {
        let is_peer =
            |n: &&String| **n != self.topology.node && self.topology.peers.contains_key(*n);
        let count = self
            .topology
            .placement
            .get(service)?
            .iter()
            .filter(is_peer)
            .count();
        if count == 0 {
            return None;
        }
        let n = next_turn(&mut self.node_turns, service);
        let is_peer =
            |n: &&String| **n != self.topology.node && self.topology.peers.contains_key(*n);
        self.topology.placement[service]
            .iter()
            .filter(is_peer)
            .nth(n % count)
            .cloned()
    }

    /// Starts a try: counts it and arms its timer.
    fn start_try(&mut self, xid: u32) {
        let exchange = self.exchanges.get_mut(&xid).expect("dispatching");
        exchange.attempt += 1;
        if let Some(per_try) = exchange.policy.per_try_timeout {
            let at = (Instant::now() + per_try).min(exchange.deadline);
            exchange.try_deadline = Some(at);
            self.timers.push(std::cmp::Reverse((at, xid)));
        }
    }

    /// Sends an allowed request to pod `pod` on this node.
    fn send_to_pod(&mut self, xid: u32, pod: u32) {
        self.start_try(xid);
        let exchange = self.exchanges.get_mut(&xid).expect("dispatching");
        let head = exchange.head.as_ref().expect("decided");
        let bytes = match wire::encode_request(head) {
            Ok(b) => b,
            Err(e) => {
                let e = ProxyError::new(
                    ErrorKind::HeadTooLarge,
                    format!("request head cannot be carried: {e}"),
                );
                self.fail(xid, e);
                return;
            }
        };
        let header = match self.port.alloc_header(&bytes) {
            Ok(h) => h,
            Err(e) => {
                let e = ProxyError::new(ErrorKind::Overloaded, format!("no header buffer: {e}"));
                self.fail(xid, e);
                return;
            }
        };
        let exchange = self.exchanges.get_mut(&xid).expect("dispatching");
        match &exchange.origin {
            Origin::Pod { d } => {
                // Case 3: the body goes pod A → pod B by DMA; the head is the one the
                // filters left.
                // Each try travels under its own ids, so a late answer to an
                // abandoned try cannot pass for the current one; A's ids go back on
                // the answer.
                let mut out = *d;
                out.case = Case::PodToPod;
                out.dst = Destination::Pod(pod);
                out.header = header;
                out.req_id = xid;
                out.step_id = exchange.attempt;
                let original = d.header;
                let key = (d.src_pod, xid, exchange.attempt);
                exchange.stage = Stage::Pod { key, pod };
                // The DMA manager hands A's body back once it copied it, and the
                // original head is freed here: neither is ours to complete later.
                if let Origin::Pod { d } = &mut exchange.origin {
                    d.header = Buffer::NONE;
                    d.body = Buffer::NONE;
                }
                self.at_pod.insert(key, xid);
                if !original.is_none() {
                    let _ = self.port.release_header(original);
                }
                self.forward(out);
            }
            Origin::Link { .. } => {
                let attempt = exchange.attempt;
                match exchange.body {
                    None => self.deliver(xid, pod, header, Buffer::NONE, attempt),
                    Some(body) => {
                        let slot = match self.port.reserve_body(pod, body.len) {
                            Ok(s) => s,
                            Err(e) => {
                                let _ = self.port.release_header(header);
                                let e = ProxyError::new(
                                    ErrorKind::EndpointRefused,
                                    format!("no body buffer at the service: {e}"),
                                );
                                self.fail_try(xid, e);
                                return;
                            }
                        };
                        let Some(regions) = self.pod_regions(pod) else {
                            self.release_rx(pod, slot);
                            let _ = self.port.release_header(header);
                            let e = ProxyError::new(
                                ErrorKind::Internal,
                                "the service's memory cannot be registered",
                            );
                            self.fail(xid, e);
                            return;
                        };
                        let offset = regions.rx_pool.offset_of(slot).expect("reserved here");
                        let sge = regions.rx.sge(offset, body.len);
                        let Origin::Link { qp, .. } = self.exchanges[&xid].origin else {
                            unreachable!()
                        };
                        let token = self.next_transfer;
                        self.next_transfer += 1;
                        let Some(state) = self.links.get_mut(&qp) else {
                            self.release_rx(pod, slot);
                            let _ = self.port.release_header(header);
                            self.drop_exchange(xid);
                            return;
                        };
                        if state.link.read(sge, body.at, token).is_err() {
                            self.release_rx(pod, slot);
                            let _ = self.port.release_header(header);
                            self.link_down(qp, "read refused".into());
                            return;
                        }
                        // The header waits in the DPU pool until the body is in.
                        self.transfers.insert(
                            token,
                            Transfer::Read {
                                qp,
                                xid,
                                pod,
                                slot,
                                header,
                            },
                        );
                        self.exchanges.get_mut(&xid).expect("live").stage = Stage::Reading;
                    }
                }
            }
        }
    }

    /// Case 2: hands the DMA manager a request for `pod` whose body (if any) is in
    /// the pod's RX pool already.
    fn deliver(&mut self, xid: u32, pod: u32, header: Buffer, body: Buffer, attempt: u32) {
        let d = Descriptor::request(Case::ExternalToHost, xid, attempt, 0, Destination::Pod(pod))
            .with_header(header)
            .with_body(body);
        let key = (0, xid, attempt);
        if let Some(exchange) = self.exchanges.get_mut(&xid) {
            exchange.stage = Stage::Pod { key, pod };
            // The try's clock starts when the pod has it (reading the body is not
            // the pod's time).
            if let Some(per_try) = exchange.policy.per_try_timeout {
                let at = (Instant::now() + per_try).min(exchange.deadline);
                exchange.try_deadline = Some(at);
                self.timers.push(std::cmp::Reverse((at, xid)));
            }
        }
        self.at_pod.insert(key, xid);
        self.forward(d);
    }

    /// To the DMA manager, in order; held while its ring is full.
    fn forward(&mut self, d: Descriptor) {
        if !self.deferred.is_empty() || self.port.forward(&d).is_err() {
            self.deferred.push_back(d);
        }
    }

    fn flush_deferred(&mut self) -> usize {
        let mut n = 0;
        while let Some(d) = self.deferred.front() {
            if self.port.forward(d).is_err() {
                break;
            }
            self.deferred.pop_front();
            n += 1;
        }
        n
    }

    fn release_rx(&mut self, pod: u32, slot: Buffer) {
        if let Some(info) = self.pod(pod)
            && let Ok(s) = info.rx_body.slot_of(slot)
        {
            let _ = info.rx_body.release(s, OwnerId::FABRIC);
        }
    }

    /// Hands what a pod's descriptor names back to the DMA manager (header slot, and a
    /// body still in the pod's TX pool).
    fn hand_back(&mut self, d: &Descriptor) {
        let mut done = *d;
        done.kind.completion = true;
        self.forward(done);
    }

    fn transfer_done(&mut self, token: u64, failed: Option<WcStatus>) {
        let Some(op) = self.transfers.remove(&token) else {
            return;
        };
        match op {
            Transfer::Read {
                xid,
                pod,
                slot,
                header,
                ..
            } => {
                if failed.is_some() || !self.exchanges.contains_key(&xid) {
                    self.release_rx(pod, slot);
                    let _ = self.port.release_header(header);
                    if let Some(status) = failed {
                        let e = ProxyError::new(
                            ErrorKind::DownstreamLost,
                            format!("the request body could not be read: {status:?}"),
                        );
                        self.fail(xid, e);
                    }
                    return;
                }
                let attempt = self.exchanges[&xid].attempt;
                self.deliver(xid, pod, header, slot, attempt);
            }
            Transfer::Write { done, .. } => self.hand_back(&done),
        }
    }

    // === responses ===

    /// A pod answered (a request from outside the node, or a pod's call).
    fn pod_response(&mut self, d: Descriptor) {
        let Destination::Pod(to) = d.dst else {
            self.hand_back(&d);
            return;
        };
        let key = (to, d.req_id, d.step_id);
        let expected = self
            .at_pod
            .get(&key)
            .and_then(|xid| match self.exchanges.get(xid)?.stage {
                Stage::Pod { pod, .. } => Some(pod),
                _ => None,
            });
        if expected != Some(d.src_pod) {
            // Its request timed out or its origin is gone, or the pod answers for a
            // request it was never given: drop it, free its buffers.
            if expected.is_some() {
                tracing::warn!(pod = d.src_pod, "a pod answered a request it was not given");
            }
            self.hand_back(&d);
            return;
        }
        let xid = self.at_pod.remove(&key).expect("checked");
        if matches!(d.status, 502..=504) && self.can_retry(xid) {
            self.hand_back(&d);
            self.retry(xid, d.status);
            return;
        }
        let header = self.port.header(&d).unwrap_or_default();
        self.stats.relayed.fetch_add(1, Ordering::Relaxed);
        let Some(mut exchange) = self.exchanges.remove(&xid) else {
            self.hand_back(&d);
            return;
        };
        self.stats.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.response_phase(&mut exchange, d.status, FailureKind::None, Some(d.src_pod));
        match exchange.origin {
            Origin::Pod { d: request } => {
                // Case 3: the DMA manager delivers B's reply to A (body B → A), under
                // the ids A sent.
                let mut d = d;
                d.req_id = request.req_id;
                d.step_id = request.step_id;
                self.forward(d);
            }
            Origin::Link {
                qp,
                xid: peer_xid,
                reply,
            } => {
                let body = if d.body.is_none() {
                    ResponseBody::None
                } else if d.body.len > reply.len {
                    self.hand_back(&d);
                    let e = ProxyError::new(
                        ErrorKind::BadResponse,
                        format!(
                            "response body of {} bytes exceeds the {}-byte reply buffer",
                            d.body.len, reply.len
                        ),
                    );
                    self.send_local(qp, peer_xid, &e.response_head(), e.body());
                    return;
                } else {
                    match self.write_body(qp, &d, reply) {
                        Ok(()) => ResponseBody::Written(d.body.len),
                        Err(e) => {
                            self.send_local(qp, peer_xid, &e.response_head(), e.body());
                            return;
                        }
                    }
                };
                if matches!(body, ResponseBody::None) {
                    self.hand_back(&d);
                }
                self.send_link(
                    qp,
                    Message::Response(Response {
                        xid: peer_xid,
                        body,
                        head: header,
                    }),
                );
            }
        }
    }

    /// RDMA-WRITEs a pod's response body (in its TX pool) to `reply`; the pod gets the
    /// slot back when the write is done.
    fn write_body(&mut self, qp: u32, d: &Descriptor, reply: RemoteBuf) -> Result<(), ProxyError> {
        let Some(regions) = self.pod_regions(d.src_pod) else {
            self.hand_back(d);
            return Err(ProxyError::new(
                ErrorKind::Internal,
                "the service's memory cannot be registered",
            ));
        };
        let Ok(offset) = regions.tx_pool.offset_of(d.body) else {
            self.hand_back(d);
            return Err(ProxyError::new(
                ErrorKind::BadResponse,
                "the service's response body is not in its pool",
            ));
        };
        let sge = regions.tx.sge(offset, d.body.len);
        let token = self.next_transfer;
        self.next_transfer += 1;
        let Some(state) = self.links.get_mut(&qp) else {
            self.hand_back(d);
            return Err(ProxyError::new(
                ErrorKind::DownstreamLost,
                "the link the request came on is gone",
            ));
        };
        if state.link.write(sge, reply.at, token).is_err() {
            self.hand_back(d);
            self.link_down(qp, "write refused".into());
            return Err(ProxyError::new(
                ErrorKind::DownstreamLost,
                "the response body could not be written back",
            ));
        }
        self.transfers
            .insert(token, Transfer::Write { qp, done: *d });
        Ok(())
    }

    fn send_link(&mut self, qp: u32, message: Message) {
        let failed = match self.links.get_mut(&qp) {
            Some(state) => state.link.send(message).err(),
            None => return,
        };
        if let Some(e) = failed {
            tracing::warn!(qp, error = %e, "mesh link send failed");
            if self.links.get(&qp).is_some_and(|s| s.link.is_down()) {
                self.link_down(qp, e.to_string());
            }
        }
    }

    /// Runs the response phase (circuit breaker accounting, metrics) without waiting:
    /// response filters do not edit the response head, so nobody needs its result.
    fn response_phase(
        &mut self,
        exchange: &mut Exchange,
        status: u16,
        failure: FailureKind,
        upstream: Option<u32>,
    ) {
        let latency = exchange.started.elapsed();
        metrics::counter!(
            "dpumesh_mesh_responses_total",
            "service" => exchange.service.clone(),
            "status" => status.to_string(),
        )
        .increment(1);
        metrics::histogram!("dpumesh_mesh_request_duration_seconds", "service" => exchange.service.clone())
            .record(latency.as_secs_f64());
        let (Some(ticket), Some(head)) = (exchange.ticket.take(), exchange.head.take()) else {
            return;
        };
        let info = ResponseInfo {
            status,
            latency_ns: latency.as_nanos() as u64,
            upstream: upstream.map(|p| format!("{}/pod-{p}", exchange.service)),
            failure,
        };
        self.run_response_phase(ticket, head, info);
    }

    /// A peer proxy answered a call one of our pods made.
    fn peer_response(&mut self, qp: u32, r: Response) {
        if self.orphans.get(&r.xid).is_some_and(|o| o.qp == qp) {
            // The late answer to a call we gave up on: the peer is done with A's
            // body and the reply slot.
            let o = self.orphans.remove(&r.xid).expect("checked");
            self.release_rx(o.d.src_pod, o.reply_slot);
            self.hand_back(&o.d);
            return;
        }
        let Some(exchange) = self.exchanges.get(&r.xid) else {
            return;
        };
        let Stage::Peer { qp: at, reply_slot } = exchange.stage else {
            return;
        };
        if at != qp {
            return;
        }
        let mut exchange = self.exchanges.remove(&r.xid).expect("checked");
        self.stats.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.stats.relayed.fetch_add(1, Ordering::Relaxed);
        let Origin::Pod { d } = exchange.origin else {
            return;
        };
        let status = wire::decode_response(&r.head)
            .map(|h| h.status)
            .unwrap_or(502);
        self.response_phase(&mut exchange, status, FailureKind::None, None);
        let body = match r.body {
            ResponseBody::None => {
                self.release_rx(d.src_pod, reply_slot);
                Buffer::NONE
            }
            ResponseBody::Written(len) if len <= reply_slot.len => {
                Buffer::new(reply_slot.addr, len)
            }
            ResponseBody::Written(_) => {
                self.release_rx(d.src_pod, reply_slot);
                let e = ProxyError::new(
                    ErrorKind::BadResponse,
                    "the peer wrote past the reply buffer",
                );
                self.reply_pod(&d, &e.response_head(), e.body());
                self.hand_back(&d);
                return;
            }
            ResponseBody::Inline(bytes) => {
                self.release_rx(d.src_pod, reply_slot);
                let head = wire::decode_response(&r.head).unwrap_or_default();
                self.reply_pod(&d, &head, bytes);
                self.hand_back(&d);
                return;
            }
        };
        let header = match self.port.alloc_header(&r.head) {
            Ok(h) => h,
            Err(_) => {
                if !body.is_none() {
                    self.release_rx(d.src_pod, body);
                }
                self.hand_back(&d);
                return;
            }
        };
        let mut out = Descriptor::request(
            Case::ExternalToHost,
            d.req_id,
            d.step_id,
            0,
            Destination::Pod(d.src_pod),
        )
        .with_header(header)
        .with_body(body);
        out.kind.response = true;
        out.status = status;
        self.forward(out);
        // The peer read A's body before it answered: A's TX slot goes back.
        self.hand_back(&d);
    }

    /// Sends a pod's call to a peer proxy (case 1): the body stays in the pod's TX
    /// pool for the peer to read, and the reply lands in a slot of its RX pool.
    fn send_to_peer(&mut self, xid: u32, node: &str) {
        let Some(qp) = self.peer_link(node) else {
            let e = ProxyError::new(
                ErrorKind::Unreachable,
                format!("node {node:?} is unreachable"),
            );
            self.fail(xid, e);
            return;
        };
        self.start_try(xid);
        let exchange = self.exchanges.get_mut(&xid).expect("dispatching");
        let Origin::Pod { d } = exchange.origin else {
            unreachable!("only pods' calls leave the node")
        };
        let head = match wire::encode_request(exchange.head.as_ref().expect("decided")) {
            Ok(h) => h,
            Err(e) => {
                let e = ProxyError::new(
                    ErrorKind::HeadTooLarge,
                    format!("request head cannot be carried: {e}"),
                );
                self.fail(xid, e);
                return;
            }
        };
        // A little less than we wait ourselves, so the peer's 504 usually arrives
        // before our deadline (and the buffers lent to it come back with it).
        let left = exchange.deadline.saturating_duration_since(Instant::now());
        let deadline_ms = (left.as_millis() * 9 / 10).clamp(1, u128::from(u32::MAX)) as u32;
        let pod = d.src_pod;
        let Some(info) = self.pod(pod).cloned() else {
            self.drop_exchange(xid);
            self.hand_back(&d);
            return;
        };
        let reply_slot = match info.rx_body.alloc(OwnerId::FABRIC) {
            Ok(s) => s,
            Err(e) => {
                let e = ProxyError::new(
                    ErrorKind::CallerOutOfBuffers,
                    format!("no buffer for the reply: {e}"),
                );
                self.fail(xid, e);
                return;
            }
        };
        let reply_buf = info
            .rx_body
            .buffer(reply_slot, info.rx_body.layout().slot_size)
            .expect("a whole slot");
        let Some(regions) = self.pod_regions(pod) else {
            self.release_rx(pod, reply_buf);
            let e = ProxyError::new(ErrorKind::Internal, "the pod's memory cannot be registered");
            self.fail(xid, e);
            return;
        };
        let reply = RemoteBuf {
            at: regions
                .rx
                .remote(regions.rx_pool.offset_of(reply_buf).expect("ours")),
            len: reply_buf.len,
        };
        let body = (!d.body.is_none()).then(|| RemoteBuf {
            at: regions
                .tx
                .remote(regions.tx_pool.offset_of(d.body).unwrap_or_default()),
            len: d.body.len,
        });
        self.exchanges.get_mut(&xid).expect("live").stage = Stage::Peer {
            qp,
            reply_slot: reply_buf,
        };
        self.send_link(
            qp,
            Message::Request(Request {
                xid,
                flags: RequestFlags { policed: true },
                deadline_ms,
                body,
                reply,
                head,
            }),
        );
    }

    fn peer_link(&mut self, node: &str) -> Option<u32> {
        if let Some(&qp) = self.peer_links.get(node)
            && self.links.get(&qp).is_some_and(|s| !s.link.is_down())
        {
            return Some(qp);
        }
        let addr = *self.topology.peers.get(node)?;
        if self
            .connect_failed
            .get(node)
            .is_some_and(|at| at.elapsed() < Duration::from_secs(1))
        {
            return None;
        }
        let qp = match self
            .fabric
            .connect(&self.pd, addr, &self.cq, QpCaps::default())
        {
            Ok(qp) => qp,
            Err(e) => {
                tracing::warn!(node, %addr, error = %e, "cannot reach peer node");
                self.connect_failed.insert(node.to_owned(), Instant::now());
                return None;
            }
        };
        let link = Link::new(&self.fabric, &self.pd, qp).ok()?;
        let num = link.qp_num();
        self.links.insert(
            num,
            LinkState {
                link,
                node: Some(node.to_owned()),
            },
        );
        self.peer_links.insert(node.to_owned(), num);
        Some(num)
    }

    // === failures, local replies, timeouts ===

    /// The DMA manager could not carry a descriptor we handed it.
    fn delivery_failed(&mut self, d: Descriptor) {
        let status = d.error_status();
        if d.kind.response {
            // A reply that could not reach its pod (it left, its pools are full): the
            // DMA manager freed what it held; the caller's own timeout answers it.
            tracing::warn!(?status, pod = ?d.dst, "a reply could not be delivered");
            return;
        }
        let key = match d.dst {
            Destination::Pod(_) if d.src_pod == 0 => (0, d.req_id, d.step_id),
            _ => (d.src_pod, d.req_id, d.step_id),
        };
        let Some(xid) = self.at_pod.remove(&key) else {
            tracing::debug!(?status, "data path error for a finished exchange");
            return;
        };
        let e = ProxyError::new(
            ErrorKind::EndpointRefused,
            format!("the service's pod could not take the request: {status:?}"),
        );
        self.fail_try(xid, e);
    }

    /// Whether a failed try of `xid` may be tried again: tries left, an idempotent
    /// method, its body still at hand, time left, and it went to a pod here (a try at
    /// a peer may still write into the reply buffer it was given).
    fn can_retry(&self, xid: u32) -> bool {
        let Some(e) = self.exchanges.get(&xid) else {
            return false;
        };
        let body_at_hand = match &e.origin {
            Origin::Link { .. } => true,
            Origin::Pod { .. } => !e.had_body,
        };
        e.attempt <= e.policy.retries
            && e.idempotent
            && body_at_hand
            && matches!(e.stage, Stage::Pod { .. })
            && Instant::now() < e.deadline
    }

    /// Tries again on the next pod; the failed try's reply, if it comes, is dropped.
    fn retry(&mut self, xid: u32, status: u16) {
        let Some(e) = self.exchanges.get_mut(&xid) else {
            return;
        };
        if let Stage::Pod { key, .. } = e.stage {
            self.at_pod.remove(&key);
        }
        e.stage = Stage::Filtering;
        e.try_deadline = None;
        metrics::counter!(
            "dpumesh_retries_total",
            "service" => e.service.clone(),
            "status" => status.to_string(),
        )
        .increment(1);
        tracing::debug!(xid, attempt = e.attempt, status, "retrying");
        self.dispatch(xid);
    }

    /// Ends a try that failed with `e`: tried again on the next pod when the error and
    /// the exchange allow it, answered with `e` otherwise.
    fn fail_try(&mut self, xid: u32, e: ProxyError) {
        if e.retryable() && self.can_retry(xid) {
            self.retry(xid, e.status());
        } else {
            self.fail(xid, e);
        }
    }

    /// Answers an exchange with the proxy's error `e`.
    fn fail(&mut self, xid: u32, e: ProxyError) {
        let failure = failure_kind(&e);
        self.finish_with(xid, &e.response_head(), e.body(), failure);
    }

    /// Answers an exchange from the proxy itself: an error, or a filter's denial.
    fn finish_with(&mut self, xid: u32, head: &ResponseHead, body: Vec<u8>, failure: FailureKind) {
        let Some(mut exchange) = self.exchanges.remove(&xid) else {
            return;
        };
        self.stats.in_flight.fetch_sub(1, Ordering::Relaxed);
        if let Stage::Pod { key, .. } = exchange.stage {
            self.at_pod.remove(&key);
        }
        self.response_phase(&mut exchange, head.status, failure, None);
        if let Stage::Peer { qp, reply_slot } = exchange.stage
            && let Origin::Pod { d } = exchange.origin
        {
            if self.links.contains_key(&qp) {
                // The peer may still read A's body and write into the reply slot:
                // both stay lent until its answer comes or the link goes.
                let mut lent = d;
                lent.header = Buffer::NONE;
                self.orphans.insert(
                    xid,
                    Orphan {
                        qp,
                        d: lent,
                        reply_slot,
                    },
                );
                self.stats.local_replies.fetch_add(1, Ordering::Relaxed);
                self.reply_pod(&d, head, body);
                let mut header_only = d;
                header_only.body = Buffer::NONE;
                self.hand_back(&header_only);
                return;
            }
            self.release_rx(d.src_pod, reply_slot);
        }
        self.reply_origin(&exchange.origin, head, body);
    }

    fn drop_exchange(&mut self, xid: u32) {
        if let Some(exchange) = self.exchanges.remove(&xid) {
            self.stats.in_flight.fetch_sub(1, Ordering::Relaxed);
            if let Stage::Pod { key, .. } = exchange.stage {
                self.at_pod.remove(&key);
            }
        }
    }

    fn reply_origin_error(&mut self, origin: &Origin, e: &ProxyError) {
        self.reply_origin(origin, &e.response_head(), e.body());
    }

    fn reply_origin(&mut self, origin: &Origin, head: &ResponseHead, body: Vec<u8>) {
        self.stats.local_replies.fetch_add(1, Ordering::Relaxed);
        match origin {
            Origin::Link { qp, xid, .. } => self.send_local(*qp, *xid, head, body),
            Origin::Pod { d } => {
                let d = *d;
                self.reply_pod(&d, head, body);
                // Its request is over: its buffers go back.
                self.hand_back(&d);
            }
        }
    }

    /// A reply from the proxy over link `qp` to the sender's exchange `xid`.
    fn send_local(&mut self, qp: u32, xid: u32, head: &ResponseHead, mut body: Vec<u8>) {
        // Local replies travel inline in one frame: a filter's oversized reply body is
        // cut rather than lost.
        body.truncate(MAX_LOCAL_BODY);
        let body = if body.is_empty() {
            ResponseBody::None
        } else {
            ResponseBody::Inline(body)
        };
        let head = wire::encode_response(head).unwrap_or_default();
        self.send_link(qp, Message::Response(Response { xid, body, head }));
    }

    /// A reply from the proxy to a pod's request `d`.
    fn reply_pod(&mut self, d: &Descriptor, head: &ResponseHead, body: Vec<u8>) {
        let pod = d.src_pod;
        let Ok(bytes) = wire::encode_response(head) else {
            return;
        };
        let Ok(header) = self.port.alloc_header(&bytes) else {
            tracing::warn!(pod, "no DPU header slot for a local reply");
            return;
        };
        let mut body_buf = Buffer::NONE;
        if !body.is_empty() {
            match self.port.reserve_body(pod, body.len() as u32) {
                Ok(slot) => {
                    let written = self.pod(pod).map(|info| {
                        info.rx_body
                            .slot_of(slot)
                            .and_then(|s| info.rx_body.write(s, &body))
                    });
                    match written {
                        Some(Ok(b)) => body_buf = b,
                        _ => self.release_rx(pod, slot),
                    }
                }
                Err(e) => tracing::warn!(pod, error = %e, "no body slot for a local reply"),
            }
        }
        let mut out = Descriptor::request(
            Case::ExternalToHost,
            d.req_id,
            d.step_id,
            0,
            Destination::Pod(pod),
        )
        .with_header(header)
        .with_body(body_buf);
        out.kind.response = true;
        out.status = head.status;
        self.forward(out);
    }

    fn expire(&mut self) {
        let now = Instant::now();
        while let Some(std::cmp::Reverse((at, xid))) = self.timers.peek().copied() {
            if at > now {
                break;
            }
            self.timers.pop();
            let Some(exchange) = self.exchanges.get(&xid) else {
                continue;
            };
            if exchange.deadline > now {
                if exchange.try_deadline.is_some_and(|t| t <= now)
                    && matches!(exchange.stage, Stage::Pod { .. })
                {
                    let e = ProxyError::new(
                        ErrorKind::TryTimeout,
                        format!(
                            "service {:?} did not answer a try within its per-try timeout",
                            exchange.service
                        ),
                    );
                    self.fail_try(xid, e);
                }
                continue;
            }
            self.stats.timeouts.fetch_add(1, Ordering::Relaxed);
            let waited = exchange.started.elapsed();
            let e = ProxyError::new(
                ErrorKind::Timeout,
                format!(
                    "service {:?} did not answer within {} ms",
                    exchange.service,
                    waited.as_millis()
                ),
            );
            self.fail(xid, e);
        }
    }

    /// A link failed: what came over it cannot be answered; what went out over it
    /// fails.
    fn link_down(&mut self, qp: u32, why: String) {
        let Some(state) = self.links.remove(&qp) else {
            return;
        };
        tracing::warn!(qp, node = ?state.node, why, "mesh link down");
        if let Some(node) = &state.node {
            self.peer_links.remove(node);
        }
        // The queue pair is gone: none of its operations will complete. What they
        // held goes back now (nothing can write into it any more).
        drop(state);
        let transfers: Vec<u64> = self
            .transfers
            .iter()
            .filter(|(_, op)| matches!(op, Transfer::Read { qp: q, .. } | Transfer::Write { qp: q, .. } if *q == qp))
            .map(|(t, _)| *t)
            .collect();
        for token in transfers {
            match self.transfers.remove(&token).expect("listed") {
                Transfer::Read {
                    xid,
                    pod,
                    slot,
                    header,
                    ..
                } => {
                    self.release_rx(pod, slot);
                    let _ = self.port.release_header(header);
                    if self
                        .exchanges
                        .get(&xid)
                        .is_some_and(|e| matches!(e.stage, Stage::Reading))
                    {
                        self.exchanges.get_mut(&xid).expect("checked").stage = Stage::Filtering;
                    }
                }
                Transfer::Write { done, .. } => self.hand_back(&done),
            }
        }
        let orphans: Vec<u32> = self
            .orphans
            .iter()
            .filter(|(_, o)| o.qp == qp)
            .map(|(x, _)| *x)
            .collect();
        for xid in orphans {
            let o = self.orphans.remove(&xid).expect("listed");
            self.release_rx(o.d.src_pod, o.reply_slot);
            self.hand_back(&o.d);
        }
        let affected: Vec<u32> = self
            .exchanges
            .iter()
            .filter(|(_, e)| {
                matches!(e.origin, Origin::Link { qp: q, .. } if q == qp)
                    || matches!(e.stage, Stage::Peer { qp: q, .. } if q == qp)
            })
            .map(|(x, _)| *x)
            .collect();
        for xid in affected {
            let from_link = matches!(self.exchanges[&xid].origin, Origin::Link { .. });
            if from_link {
                // Nobody to answer; a reply from the pod is dropped when it comes.
                self.drop_exchange(xid);
            } else {
                let e = ProxyError::new(
                    ErrorKind::LinkLost,
                    format!("lost the link to the service's node ({why})"),
                );
                self.fail(xid, e);
            }
        }
    }
}

/// The answer for a request the filter workers could not take or finish.
fn pool_error(e: PoolError) -> ProxyError {
    let kind = match e {
        PoolError::Stopped => ErrorKind::ShuttingDown,
        PoolError::WorkerLost => ErrorKind::ThreadLost,
        PoolError::UnknownChain(_) | PoolError::StaleGeneration { .. } => ErrorKind::Internal,
    };
    ProxyError::new(kind, format!("filter chain not run: {e}"))
}

#[cfg(test)]
mod tests {
    use test_case::test_case;

    use super::*;

    #[test_case(ErrorKind::EndpointRefused, FailureKind::ConnectFailure; "a pod that cannot take the request is the service's")]
    #[test_case(ErrorKind::Unreachable, FailureKind::ConnectFailure; "an unreachable node")]
    #[test_case(ErrorKind::NoEndpoint, FailureKind::ConnectFailure; "no endpoint")]
    #[test_case(ErrorKind::LinkLost, FailureKind::UpstreamReset; "a lost link to the service's node")]
    #[test_case(ErrorKind::BadResponse, FailureKind::UpstreamReset; "an unusable answer")]
    #[test_case(ErrorKind::TryTimeout, FailureKind::Timeout; "a try timeout")]
    #[test_case(ErrorKind::Timeout, FailureKind::Timeout; "a timeout")]
    #[test_case(ErrorKind::DownstreamLost, FailureKind::LocalReply; "the client's side went away")]
    #[test_case(ErrorKind::HeadTooLarge, FailureKind::LocalReply; "a head too large")]
    #[test_case(ErrorKind::NoRoute, FailureKind::LocalReply; "no route")]
    #[test_case(ErrorKind::Overloaded, FailureKind::Internal; "the proxy is out of buffers")]
    #[test_case(ErrorKind::ThreadLost, FailureKind::Internal; "a proxy thread died")]
    fn the_breaker_sees_each_error_by_its_source(kind: ErrorKind, failure: FailureKind) {
        assert_eq!(failure_kind(&ProxyError::new(kind, "x")), failure);
    }

    #[test]
    fn filter_workers_that_stopped_or_died_give_503() {
        let stopped = pool_error(PoolError::Stopped);
        assert_eq!(
            (stopped.kind(), stopped.status()),
            (ErrorKind::ShuttingDown, 503)
        );
        let lost = pool_error(PoolError::WorkerLost);
        assert_eq!((lost.kind(), lost.status()), (ErrorKind::ThreadLost, 503));
        assert!(lost.message().contains("died"), "{lost}");
    }
}

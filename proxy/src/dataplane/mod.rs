//! The DPU proxy's data flow: heads come in from the fabric (the ingress, or a peer
//! node's proxy) and from the node's pods (their TX rings); the route's filter chain
//! runs inline on the shard (an offloaded chain on the filter pool); a denial is
//! answered at once and the body never moves; an allowed request goes to a pod of the
//! service on this node (round robin) or, for a pod's egress call to a service
//! elsewhere, to the proxy of a node that runs it. Responses come back the same way
//! and pass the response phase.
//!
//! ```text
//! ingress ─Request(head, body@ingress, reply@ingress)─▶ link ─┐
//!                                                              ├▶ route → chain (inline)
//! pod A ─TX ring─▶ shard (DMA work inline) ──────────────────┘        │
//!   deny: local reply ◀──────────────────────────────────────────────┤
//!   allow, pod B here: [READ body → B's RX pool] → B's RX ring
//!   allow, elsewhere:  Request(policed, body@A's TX pool, reply@A's RX pool) → peer
//! B's reply: B's TX ring → [WRITE body → reply buffer] → Response → origin
//! ```
//!
//! A node runs a shard thread per core it is given (`cores:` in the mesh file). A
//! shard runs each request to completion: no request changes threads. It is made of
//! owners, each holding one concern, composed by its event loop (`event_loop`):
//! `Links` (its queue pairs, by number and by peer node, and reconnects: `links`),
//! `Pods` (the node's pods as it reaches them: lanes, registered regions, turns,
//! departures: `pods`), `Filters` (its chains, offloaded verdicts, filters' HTTP
//! calls, plugin ticks), the `exchange` table (the sans-I/O exchanges, timers,
//! transfers and orphans) and `Meter` (its counters). The policy steps around a try
//! are pure `layers` (timeouts, retries, what the breaker counts and blames) and the
//! response cache (`cache`). The steps of a request: `intake` (routing and the chain),
//! `dispatch` (to a pod or a peer), `respond` (answers back), `failure` (failed tries,
//! timeouts, lost links and pods).
use std::collections::{BTreeMap, HashMap, VecDeque};
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
use dpumesh_dpa::reconnect::Reconnect;
use dpumesh_dpa::{
    Buffer, BufferPool, Case, Descriptor, Destination, Dpu, DpuShard, OwnerId, PodInfo, Polling,
    Spin, Waited,
};
use dpumesh_error::{ErrorKind, ProxyError};
use dpumesh_head::wire::{self, ResponseHead};
use dpumesh_runtime::{
    CalloutReply, Decision, FailureKind, LocalChains, Peer, PoolError, RequestDone, RequestHead,
    ResponseHeaders, ResponseInfo, RootCall, Ticket,
};
use dpumesh_supervise::{RestartPolicy, Supervisor};
use http::{HeaderMap, HeaderName, HeaderValue};

use crate::callout::{Callouts, Target};
use crate::policy::Policy;

mod cache;
mod call_stream;
mod callouts;
mod dispatch;
mod event_loop;
mod exchange;
mod failure;
mod intake;
mod layers;
mod links;
mod observing;
mod pod_upload;
mod pods;
mod respond;
pub mod response_metrics;
mod stream;
mod upload;
mod wire_head;

use exchange::{
    Due, Exchange, ExchangeTable, Opening, Origin, Orphan, PeerAnswer, PodAnswer, RequestTraits,
    Stage, Transfer,
};
use layers::breaker::{failure_kind, node_upstream, pod_upstream};

/// Named once: a name given as text is parsed and hashed anew at every lookup, and a
/// node looks this one up twice a request while tracing is on.
static TRACEPARENT: http::HeaderName = http::HeaderName::from_static("traceparent");

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
    /// What a pod's service name is appended to for its SPIFFE ID
    /// (`spiffe://<td>/ns/<ns>/sa/`).
    pub workload_prefix: String,
    /// Links must prove a node's identity for their claims to be believed (mutual
    /// TLS is on); otherwise every link is believed.
    pub require_identity: bool,
    /// The node's HTTP response cache (routes with `cache` use it).
    pub cache: Option<Arc<crate::http_cache::HttpCache>>,
    /// How pods' call paths are normalized: the mesh's `ingress.path`, so a pod's
    /// call is read as a client's request would be.
    pub path: dpumesh_config::PathConfig,
    /// The node's taps and access log.
    pub observer: Arc<crate::observe::Observer>,
    /// The golden metrics' label budget, node-wide.
    pub labels: Arc<response_metrics::LabelBudget>,
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
    shards: Vec<ShardThread>,
    addr: SocketAddr,
    stats: Arc<DataplaneStats>,
    supervisor: Arc<Supervisor>,
}

/// A shard's thread, as the data plane keeps it.
struct ShardThread {
    bell: Bell,
    thread: Option<JoinHandle<()>>,
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
    /// Starts a shard per [`DpuShard`] of the node (a reactor thread each, with its
    /// pods' lanes, its DMA work, its bell and a completion queue of its own) and
    /// listens for queue pairs at `listen`, giving each accepted one to the next shard
    /// in turn. A shard runs every request that arrives on its links or lanes to
    /// completion (chain inline, answer back on the same link or lane), polls as
    /// `polling` says after its last work, then sleeps on one epoll set (its bell and
    /// its completion queue).
    pub fn start<F: Fabric + Clone>(
        fabric: F,
        listen: SocketAddr,
        dpu: Arc<Dpu>,
        policy: Arc<Policy>,
        topology: Topology,
        polling: Polling,
    ) -> anyhow::Result<Self> {
        let ports = dpu.take_shards();
        if ports.is_empty() {
            anyhow::bail!("the node's shards are taken");
        }
        // One protection domain: a queue pair accepted for any shard reaches the pods'
        // regions, registered once for the node (`node_regions`).
        let pd = fabric.alloc_pd()?;
        let cqs = ports
            .iter()
            .map(|_| fabric.create_cq(1 << 16))
            .collect::<Result<Vec<_>, _>>()?;
        let listener = fabric.listen(&pd, listen, &cqs[0], QpCaps::default())?;
        let addr = listener.local_addr();
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(DataplaneStats::default());
        let supervisor = Supervisor::new();
        let mut shards = Vec::with_capacity(ports.len());
        let mut handoffs = Vec::with_capacity(ports.len());
        let node_regions: NodeRegions<F> = Arc::default();
        for (port, cq) in ports.into_iter().zip(cqs) {
            let index = port.index();
            // Accepting (with the peer's hello) may block on a slow or silent
            // connection: never on a shard.
            let (accepted_tx, accepted) = crossbeam_channel::unbounded();
            let bell = port.bell().clone();
            handoffs.push((accepted_tx, cq.clone(), bell.clone()));
            let reactor = Reactor::new(ReactorParts {
                node_regions: node_regions.clone(),
                fabric: fabric.clone(),
                pd: pd.clone(),
                cq,
                accepted,
                port,
                dpu: dpu.clone(),
                policy: policy.clone(),
                topology: topology.clone(),
                self_addr: reachable(addr),
                stats: stats.clone(),
                stop: stop.clone(),
                polling,
            })?;
            #[cfg(feature = "fault-injection")]
            let inbox = reactor.filters.inbox_tx.clone();
            let thread = supervisor.spawn(
                format!("dpumesh-shard-{index}"),
                RestartPolicy::default(),
                reactor,
                Reactor::run,
                Reactor::recover,
            )?;
            shards.push(ShardThread {
                bell,
                thread: Some(thread),
                #[cfg(feature = "fault-injection")]
                inbox,
            });
        }
        let accept_stop = Arc::new(AtomicBool::new(false));
        supervisor.spawn(
            "dpumesh-accept",
            RestartPolicy::default(),
            (listener, handoffs, accept_stop.clone(), 0usize),
            |(listener, shards, stop, turn)| {
                while !stop.load(Ordering::Relaxed) {
                    // Links take turns over the shards (the ingress opens one per
                    // worker, each peer node one per shard of its own).
                    if shards.is_empty() {
                        return;
                    }
                    let k = *turn % shards.len();
                    let (to, cq, bell) = &shards[k];
                    match listener.accept_on(cq, ACCEPT_LOOK) {
                        Ok(Some(qp)) => {
                            if to.send(qp).is_err() {
                                // A shard the supervisor gave up on: the others keep
                                // taking links (the node is not ready meanwhile).
                                shards.remove(k);
                                continue;
                            }
                            bell.ring();
                            *turn = turn.wrapping_add(1);
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
        Ok(Self {
            stop,
            accept_stop,
            shards,
            addr,
            stats,
            supervisor,
        })
    }

    /// The data plane's threads (the shards, the accept loop), for readiness.
    pub fn supervisor(&self) -> &Arc<Supervisor> {
        &self.supervisor
    }

    /// Makes every shard's thread panic at its next turn (tests of supervision).
    #[cfg(feature = "fault-injection")]
    pub fn inject_panic(&self) {
        for shard in &self.shards {
            let _ = shard.inbox.send(Inbox::Panic);
            shard.bell.ring();
        }
    }

    /// How many shards run.
    pub fn shards(&self) -> usize {
        self.shards.len()
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
        for shard in &self.shards {
            shard.bell.interrupt();
        }
        for shard in &mut self.shards {
            if let Some(t) = shard.thread.take() {
                let _ = t.join();
            }
        }
    }
}

/// What the workers hand back.
enum Inbox {
    Decided {
        xid: u32,
        done: Result<Box<RequestDone>, PoolError>,
    },
    /// A plugin root's HTTP call came back.
    RootCallout {
        to: RootCall,
        token: u32,
        reply: Box<CalloutReply>,
    },
    /// A filter's HTTP call came back for the request parked under `park`.
    Callout {
        xid: u32,
        park: u32,
        token: u32,
        reply: Box<CalloutReply>,
    },
    /// Panic (tests of supervision).
    #[cfg(feature = "fault-injection")]
    Panic,
}

/// An address this node reaches itself at, for a listener bound to `addr` (the
/// unspecified address is reached on loopback).
fn reachable(addr: SocketAddr) -> SocketAddr {
    if addr.ip().is_unspecified() {
        let ip: std::net::IpAddr = if addr.is_ipv4() {
            std::net::Ipv4Addr::LOCALHOST.into()
        } else {
            std::net::Ipv6Addr::LOCALHOST.into()
        };
        SocketAddr::new(ip, addr.port())
    } else {
        addr
    }
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

/// A shard: the owners of its state, composed by its event loop. Each owner holds one
/// concern; a step that needs two (a dispatch reads the exchange and writes to a pod's
/// lane) borrows their fields side by side.
struct Reactor<F: Fabric> {
    /// The queue pairs to the ingress and to peer nodes.
    links: Links<F>,
    /// The node's pods as this shard reaches them.
    pods: Pods<F>,
    /// The filter chains this shard runs and what they wait on.
    filters: Filters,
    /// The exchanges in flight and their timers (the sans-I/O core).
    table: ExchangeTable,
    /// Streamed answers on their way to links.
    streams: stream::Streams,
    /// Streamed request bodies on their way from links to pods.
    uploads: upload::Uploads,
    /// Streamed answers on their way to pods' calls.
    call_streams: call_stream::CallStreams,
    /// Streamed request bodies of pods' calls on their way to their callees.
    pod_uploads: pod_upload::PodUploads,
    topology: Topology,
    /// Where this node's own proxy is reached (mesh calls to services it runs).
    self_addr: SocketAddr,
    /// Its one wait set: the shard's bell (pods, the accept loop, offloaded chains,
    /// shutdown) and the fabric completion queue.
    waits: WaitSet,
    bell: Bell,
    stop: Arc<AtomicBool>,
    /// How long to keep polling after the last work before sleeping.
    spin: Spin,
    meter: Meter,
}

/// The shard's queue pairs: to the ingress, to peer nodes, and the ones waiting to
/// be connected again.
struct Links<F: Fabric> {
    fabric: F,
    pd: F::Pd,
    cq: F::Cq,
    /// Queue pairs the accept thread took.
    accepted: Receiver<F::Qp>,
    /// Peers whose connect failed (tried again after a growing wait) or whose link
    /// went down.
    reconnect: Reconnect<String>,
    by_qp: HashMap<u32, LinkState<F>>,
    by_node: HashMap<String, u32>,
    /// Round-robin turns over the nodes running a service.
    node_turns: HashMap<String, usize>,
    /// The completion queue's batch, kept to reuse its allocation.
    completions: Vec<WorkCompletion>,
}

/// The node's pods as one shard reaches them: its lanes (the DPU port), their
/// registered regions, whom it sends to next, and the descriptors waiting for room.
struct Pods<F: Fabric> {
    port: DpuShard,
    dpu: Arc<Dpu>,
    /// The node's pods as last read (`known_at`), refreshed at housekeeping.
    known: Vec<PodInfo>,
    known_at: Instant,
    /// The pods' registrations this shard uses (from `node_regions`).
    regions: HashMap<u32, Arc<PodRegions<F>>>,
    /// Every shard's pod registrations: one per pod per node, not per shard.
    node_regions: NodeRegions<F>,
    /// Round-robin turns over a service's pods.
    turns: HashMap<String, usize>,
    /// Descriptors the DMA manager's ring had no room for, in order.
    deferred: VecDeque<Descriptor>,
}

/// The chains the shard runs and the answers it waits for: offloaded chains, filters'
/// HTTP calls, plugin ticks.
struct Filters {
    policy: Arc<Policy>,
    /// The chains this reactor runs inline, per generation.
    chains: LocalChains,
    /// The generation it runs new requests on (readiness reads it).
    generation: Arc<AtomicU64>,
    /// When a proxy-wasm plugin's next tick is due (its housekeeping runs them).
    plugin_tick: Option<Instant>,
    /// A plugin's shared queue has news for it (set by the queue, with the bell).
    queue_ready: Arc<AtomicBool>,
    inbox: Receiver<Inbox>,
    inbox_tx: Sender<Inbox>,
    /// The thread making filters' HTTP calls (started by the first call).
    callouts: Option<Callouts>,
    start_callouts: Box<dyn Fn() -> std::io::Result<Callouts> + Send>,
}

/// What the shard counts.
struct Meter {
    stats: Arc<DataplaneStats>,
    /// Requests this shard took (`dpumesh_shard_requests_total{shard}`): how evenly
    /// the links and lanes spread the load.
    shard_requests: metrics::Counter,
    /// Per-response metrics, their handles looked up once per service and status.
    response_metrics: response_metrics::ResponseMetrics,
    /// This shard's open exchanges as last added to `stats.in_flight`.
    in_flight_reported: u64,
}

/// The node's pod registrations, shared by its shards.
type NodeRegions<F> = Arc<parking_lot::Mutex<HashMap<u32, Arc<PodRegions<F>>>>>;

/// What a shard is built from.
struct ReactorParts<F: Fabric> {
    node_regions: NodeRegions<F>,
    fabric: F,
    pd: F::Pd,
    cq: F::Cq,
    accepted: Receiver<F::Qp>,
    port: DpuShard,
    dpu: Arc<Dpu>,
    policy: Arc<Policy>,
    topology: Topology,
    self_addr: SocketAddr,
    stats: Arc<DataplaneStats>,
    stop: Arc<AtomicBool>,
    polling: Polling,
}

impl<F: Fabric + Clone> Reactor<F> {
    fn new(parts: ReactorParts<F>) -> anyhow::Result<Self> {
        let ReactorParts {
            node_regions,
            fabric,
            pd,
            cq,
            accepted,
            port,
            dpu,
            policy,
            topology,
            self_addr,
            stats,
            stop,
            polling,
        } = parts;
        let bell = port.bell().clone();
        let labels = topology.labels.clone();
        let shard_requests =
            metrics::counter!("dpumesh_shard_requests_total", "shard" => port.index().to_string());
        let mut waits = WaitSet::new()?;
        waits.add(bell.fd(), 0)?;
        if let Some(fd) = cq.wait_fd() {
            waits.add(fd, 1)?;
        }
        let chains = LocalChains::new(SHARD_RUNNER, policy.snapshot().generation.clone());
        // A plugin's shared queue got an item: the shard tells it at its next turn.
        let queue_ready = Arc::new(AtomicBool::new(false));
        // The shard makes its plugins' root-context calls (from on_tick and the like).
        chains.perform_root_calls();
        chains.set_waker({
            let (flag, bell) = (queue_ready.clone(), bell.clone());
            Arc::new(move || {
                flag.store(true, Ordering::Release);
                bell.ring();
            })
        });
        let generation = policy.add_runner();
        let (inbox_tx, inbox) = crossbeam_channel::unbounded();
        let callout_fabric = fabric.clone();
        Ok(Self {
            links: Links {
                fabric,
                pd,
                cq,
                accepted,
                reconnect: Reconnect::default(),
                by_qp: HashMap::new(),
                by_node: HashMap::new(),
                node_turns: HashMap::new(),
                completions: Vec::with_capacity(64),
            },
            pods: Pods {
                port,
                dpu,
                known: Vec::new(),
                known_at: Instant::now() - Duration::from_secs(1),
                regions: HashMap::new(),
                node_regions,
                turns: HashMap::new(),
                deferred: VecDeque::new(),
            },
            filters: Filters {
                policy,
                chains,
                generation,
                plugin_tick: None,
                queue_ready,
                inbox,
                inbox_tx,
                callouts: None,
                start_callouts: Box::new(move || Callouts::start(callout_fabric.clone())),
            },
            table: ExchangeTable::default(),
            streams: stream::Streams::default(),
            uploads: upload::Uploads::default(),
            call_streams: call_stream::CallStreams::default(),
            pod_uploads: pod_upload::PodUploads::default(),
            topology,
            self_addr,
            waits,
            bell,
            stop,
            spin: Spin::new(polling),
            meter: Meter {
                stats,
                shard_requests,
                response_metrics: response_metrics::ResponseMetrics::with_budget(labels),
                in_flight_reported: 0,
            },
        })
    }
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

/// How long the accept thread waits for a queue pair before it looks at its stop flag
/// (links are set up once; an idle node should not wake for them often).
const ACCEPT_LOOK: Duration = Duration::from_millis(250);

/// Largest local reply body sent inline to the fabric (a frame holds 64 KiB).
const MAX_LOCAL_BODY: usize = dpumesh_config::CacheConfig::MAX_OBJECT;

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
    use super::*;

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

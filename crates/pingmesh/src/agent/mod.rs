//! The agent every node runs: it registers its RNIC with the
//! controller, probes what its pinglists (and the mesh's own connections) name,
//! answers other agents' probes, and uploads results to the analyzer in batches.
//!
//! Two threads: `pingmesh-probe` owns the UD queue pair (prober and responder, see
//! [`io`]); `pingmesh-control` talks gRPC (registration, pinglists, uploads) on a
//! current-thread runtime. They share targets and results through [`Shared`].

mod io;
pub mod prober;
pub mod tracer;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use dpumesh_clock::SharedClock;
use dpumesh_dpa::fabric::QpCaps;
use dpumesh_dpa::fabric::ud::{DatagramFabric, Gid, UdQueuePair};
use dpumesh_dpa::shm::SharedRegion;
use dpumesh_supervise::{RestartPolicy, Supervisor};
use parking_lot::Mutex;

use crate::convert;
use crate::pinglist::{ListKind, Target, flow_label};
use crate::proto;
use prober::{ProbeTarget, Prober};

/// The Q_Key every agent's responder uses.
pub const QKEY: u32 = 0x5052_4d31;
/// Results kept while the analyzer cannot be reached (oldest dropped past it).
const MAX_BACKLOG: usize = 100_000;

/// A live connection of the mesh, to probe along (service tracing).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Connection {
    /// The peer node's RNIC address.
    pub peer_ip: IpAddr,
    /// The connection's queue pair numbers (its 5-tuple's entropy).
    pub local_qpn: u32,
    pub remote_qpn: u32,
    /// The services whose requests it carries.
    pub services: Vec<String>,
}

/// Where the node's live connections come from (the fabric's connection table).
pub type Connections = Arc<dyn Fn() -> Vec<Connection> + Send + Sync>;

/// How an agent runs.
#[derive(Clone)]
pub struct AgentConfig {
    /// The node's name.
    pub agent_id: String,
    /// The ToR switch its RNIC hangs off.
    pub tor_id: String,
    /// The RNIC's address: its IP is the GID; the UDP port is the software fabric's.
    pub bind: SocketAddr,
    /// The management address the controller records.
    pub agent_ip: String,
    /// `http://HOST:PORT` of the controller and the analyzer (`https://`: mutual
    /// TLS with `tls`).
    pub controller: String,
    pub analyzer: String,
    /// The node's certificates, for `https://` controllers.
    pub tls: Option<Arc<dpumesh_identity::MeshTls>>,
    /// Re-fetch pinglists (and connections) this often.
    pub refresh_every: Duration,
    /// Upload results this often.
    pub upload_every: Duration,
    /// The node's live connections, if it traces services.
    pub connections: Option<Connections>,
    /// Trace the paths to its targets this often (None: no path tracing).
    pub trace_every: Option<Duration>,
    /// Whether it probes (false: it only answers — a target that is never a
    /// prober, e.g. to measure the responder's cost alone).
    pub probe: bool,
    /// Answer with the paper's two ACKs even where the fabric stamps sends as they
    /// are posted and one ACK would carry the delay (what a NIC's fabric always
    /// does; to compare the two).
    pub two_acks: bool,
    pub clock: SharedClock,
}

impl std::fmt::Debug for AgentConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentConfig")
            .field("agent_id", &self.agent_id)
            .field("tor_id", &self.tor_id)
            .field("bind", &self.bind)
            .field("controller", &self.controller)
            .field("analyzer", &self.analyzer)
            .finish_non_exhaustive()
    }
}

/// Counters an agent keeps.
#[derive(Debug, Default)]
pub struct Stats {
    /// Probes finished (answered, timed out or failed).
    pub probes: AtomicU64,
    /// Results the analyzer accepted.
    pub uploaded: AtomicU64,
    /// Uploads that failed (retried).
    pub upload_errors: AtomicU64,
    /// Registrations that failed (retried).
    pub register_errors: AtomicU64,
    /// Datagrams that were not probe messages.
    pub malformed: AtomicU64,
    /// Probes for the queue pair this responder had before a restart.
    pub wrong_qpn: AtomicU64,
}

/// What the two threads share.
#[derive(Debug)]
pub(crate) struct Shared {
    stop: Stop,
    /// New targets for the prober (targets, interval ns, timeout ns).
    targets: Mutex<Option<(Vec<ProbeTarget>, u64, u64)>>,
    results: Mutex<Vec<proto::ProbeResult>>,
    /// The RNICs the tracer traces (the targets' GIDs, once each).
    trace_targets: Mutex<Vec<Gid>>,
    /// Traced paths waiting for the next upload.
    paths: Mutex<Vec<proto::PathInfo>>,
    pub(crate) stats: Stats,
    clock: SharedClock,
}

impl Shared {
    fn wall_ms(&self) -> u64 {
        self.clock.wall_ns() / 1_000_000
    }

    fn push_paths(&self, mut more: Vec<proto::PathInfo>) {
        let mut p = self.paths.lock();
        p.append(&mut more);
        // Only the latest trace of a pair matters; a long outage keeps the newest.
        keep_newest(&mut p, 1024);
    }

    fn push_results(&self, mut more: Vec<proto::ProbeResult>) {
        let mut r = self.results.lock();
        r.append(&mut more);
        keep_newest(&mut r, MAX_BACKLOG);
    }
}

/// Drops the oldest entries of `v` beyond `max` (a backlog kept while the analyzer
/// is away stays bounded and keeps the newest).
/// The agent's stop, which its threads sleep on: a long sleep ends as soon as the
/// agent stops.
#[derive(Debug, Default)]
pub(crate) struct Stop {
    flag: AtomicBool,
    lock: Mutex<()>,
    woken: parking_lot::Condvar,
}

impl Stop {
    pub(crate) fn is_set(&self) -> bool {
        self.flag.load(Ordering::SeqCst)
    }

    fn set(&self) {
        let _held = self.lock.lock();
        self.flag.store(true, Ordering::SeqCst);
        self.woken.notify_all();
    }

    /// Sleeps until `deadline` or the stop; whether the agent stopped.
    pub(crate) fn sleep_until(&self, deadline: Instant) -> bool {
        let mut held = self.lock.lock();
        while !self.is_set() {
            if self.woken.wait_until(&mut held, deadline).timed_out() {
                break;
            }
        }
        self.is_set()
    }
}

fn keep_newest<T>(v: &mut Vec<T>, max: usize) {
    if v.len() > max {
        let extra = v.len() - max;
        v.drain(..extra);
    }
}

/// A running agent; stops when dropped.
#[derive(Debug)]
pub struct Agent {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    rnic: proto::RnicInfo,
}

impl Agent {
    /// Creates the UD queue pair on `fabric` and starts both threads.
    pub fn start<F: DatagramFabric + Clone>(
        fabric: F,
        config: AgentConfig,
    ) -> Result<Self, AgentError> {
        let pd = fabric.alloc_pd()?;
        let qp = fabric.create_ud_qp(
            &pd,
            config.bind,
            QKEY,
            QpCaps {
                max_send_wr: io::SEND_SLOTS as u32,
                max_recv_wr: io::RECV_SLOTS as u32,
            },
        )?;
        let local = qp.local();
        let region = Arc::new(
            SharedRegion::create_unique("dpumesh-pingmesh", io::REGION_LEN)
                .map_err(|e| AgentError::Setup(format!("probe buffers: {e}")))?,
        );
        let rnic = proto::RnicInfo {
            gid: local.gid.to_string(),
            qpn: qp.qp_num(),
            qkey: QKEY,
            agent_id: config.agent_id.clone(),
            agent_ip: config.agent_ip.clone(),
            rnic_ip: local.gid.ip().to_string(),
            tor_id: config.tor_id.clone(),
            udp_port: u32::from(local.udp_port),
            last_updated_ms: 0,
        };
        let mut session = [0u8; 8];
        getrandom::fill(&mut session)
            .map_err(|e| AgentError::Setup(format!("random session: {e}")))?;
        let prober = Prober::new(local.gid, qp.qp_num(), u64::from_le_bytes(session));
        let shared = Arc::new(Shared {
            stop: Stop::default(),
            targets: Mutex::new(None),
            results: Mutex::new(Vec::new()),
            trace_targets: Mutex::new(Vec::new()),
            paths: Mutex::new(Vec::new()),
            stats: Stats::default(),
            clock: config.clock.clone(),
        });
        let one_ack = qp.stamps_sends_when_posted() && !config.two_acks;
        let io = io::setup(fabric, pd, qp, region, shared.clone(), prober, one_ack)?;
        // The agent's threads are supervised: a panic is caught, logged and counted
        // (`dpumesh_thread_panics_total`) and the loop runs again; one that keeps
        // panicking is left down. (Monitoring is not part of the node's readiness:
        // the data plane serves without it.)
        let supervisor = Supervisor::new();
        let probe = supervisor
            .spawn(
                "pingmesh-probe",
                RestartPolicy::default(),
                io,
                |io| io.run(),
                |_| {},
            )
            .map_err(|e| AgentError::Setup(format!("probe thread: {e}")))?;
        let mut threads = vec![probe];
        if let (Some(every), true) = (config.trace_every, config.probe) {
            let (shared, gid) = (shared.clone(), local.gid);
            threads.push(
                supervisor
                    .spawn(
                        "pingmesh-trace",
                        RestartPolicy::default(),
                        shared,
                        move |shared| tracer::run(shared.clone(), gid, every),
                        |_| {},
                    )
                    .map_err(|e| AgentError::Setup(format!("trace thread: {e}")))?,
            );
        }
        let control = Control {
            config,
            shared: shared.clone(),
            rnic: rnic.clone(),
            gid: local.gid,
        };
        let control = supervisor
            .spawn(
                "pingmesh-control",
                RestartPolicy::default(),
                control,
                |control| control.run(),
                |_| {},
            )
            .map_err(|e| AgentError::Setup(format!("control thread: {e}")))?;
        threads.push(control);
        Ok(Self {
            shared,
            threads,
            rnic,
        })
    }

    /// What it registered.
    pub fn rnic(&self) -> &proto::RnicInfo {
        &self.rnic
    }

    pub fn stats(&self) -> &Stats {
        &self.shared.stats
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.shared.stop.set();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Why an agent could not start.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("pingmesh agent: {0}")]
    Fabric(#[from] dpumesh_dpa::fabric::FabricError),
    #[error("pingmesh agent: {0}")]
    Setup(String),
}

/// The control thread: registration, pinglists, uploads.
#[derive(Clone)]
struct Control {
    config: AgentConfig,
    shared: Arc<Shared>,
    rnic: proto::RnicInfo,
    gid: Gid,
}

type ControllerClient =
    proto::controller_service_client::ControllerServiceClient<tonic::transport::Channel>;
type AnalyzerClient =
    proto::analyzer_service_client::AnalyzerServiceClient<tonic::transport::Channel>;

impl Control {
    fn run(&self) {
        let rt = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(rt) => rt,
            Err(e) => {
                tracing::error!(error = %e, "pingmesh agent: no runtime");
                return;
            }
        };
        // A run after a panic starts over: registration, pinglist, uploads.
        rt.block_on(self.clone().serve());
    }

    fn stopped(&self) -> bool {
        self.shared.stop.is_set()
    }

    async fn serve(self) {
        let channel =
            |url: &str| {
                let endpoint = tonic::transport::Endpoint::from_shared(url.to_owned())
                    .map_err(|e| format!("{url}: {e}"))?
                    .connect_timeout(Duration::from_secs(2))
                    .timeout(Duration::from_secs(5));
                match (url.starts_with("https://"), &self.config.tls) {
                    (false, _) => Ok(endpoint.connect_lazy()),
                    (true, Some(tls)) => Ok(endpoint
                        .connect_with_connector_lazy(crate::tls::Connector::new(tls.clone()))),
                    (true, None) => Err(format!("{url}: https needs the node's certificates")),
                }
            };
        let (controller, analyzer) = match (
            channel(&self.config.controller),
            channel(&self.config.analyzer),
        ) {
            (Ok(c), Ok(a)) => (ControllerClient::new(c), AnalyzerClient::new(a)),
            (Err(e), _) | (_, Err(e)) => {
                tracing::error!(error = %e, "pingmesh agent: bad controller or analyzer address");
                return;
            }
        };
        let mut controller = controller;
        let mut analyzer = analyzer;
        let mut registered = false;
        let mut next_register = Instant::now();
        // Said once per outage, not on every retry.
        let (mut register_failing, mut upload_failing) = (false, false);
        let mut refreshed_at: Option<Instant> = None;
        let mut uploaded_at = Instant::now();
        let mut current: Option<Vec<ProbeTarget>> = None;
        let mut pending: Vec<proto::ProbeResult> = Vec::new();
        while !self.stopped() {
            let due =
                |at: Option<Instant>, every: Duration| at.is_none_or(|t| t.elapsed() >= every);
            if Instant::now() >= next_register {
                match controller
                    .register_agent(proto::AgentRegistrationRequest {
                        agent_id: self.config.agent_id.clone(),
                        rnics: vec![self.rnic.clone()],
                    })
                    .await
                {
                    Ok(r) => {
                        let ttl = Duration::from_millis(u64::from(r.get_ref().ttl_ms).max(300));
                        // A first registration refreshes the lists at once.
                        if !registered {
                            refreshed_at = None;
                        }
                        if register_failing {
                            tracing::info!("pingmesh agent: registered again");
                        }
                        (registered, register_failing) = (true, false);
                        next_register = Instant::now() + ttl / 3;
                    }
                    Err(e) => {
                        self.shared
                            .stats
                            .register_errors
                            .fetch_add(1, Ordering::Relaxed);
                        if !register_failing {
                            tracing::warn!(error = %e, "pingmesh agent: registration failed; retrying every 500 ms");
                            register_failing = true;
                        }
                        next_register = Instant::now() + Duration::from_millis(500);
                    }
                }
            }
            if self.config.probe && registered && due(refreshed_at, self.config.refresh_every) {
                refreshed_at = Some(Instant::now());
                if let Some((targets, interval, timeout)) =
                    self.fetch_targets(&mut controller).await
                {
                    // Only a changed list resets the prober's schedule.
                    if current.as_ref() != Some(&targets) {
                        let mut gids: Vec<Gid> =
                            targets.iter().map(|t| t.target.rnic.gid).collect();
                        gids.sort();
                        gids.dedup();
                        *self.shared.trace_targets.lock() = gids;
                        current = Some(targets.clone());
                        *self.shared.targets.lock() = Some((targets, interval, timeout));
                    }
                }
            }
            if uploaded_at.elapsed() >= self.config.upload_every {
                uploaded_at = Instant::now();
                pending.append(&mut self.shared.results.lock());
                let paths = std::mem::take(&mut *self.shared.paths.lock());
                if !pending.is_empty() || !paths.is_empty() {
                    let batch = proto::UploadDataRequest {
                        agent_id: self.config.agent_id.clone(),
                        results: std::mem::take(&mut pending),
                        paths,
                        flows: Vec::new(),
                    };
                    match analyzer.upload_data(batch.clone()).await {
                        Ok(r) => {
                            self.shared
                                .stats
                                .uploaded
                                .fetch_add(u64::from(r.get_ref().accepted), Ordering::Relaxed);
                            upload_failing = false;
                        }
                        Err(e) => {
                            self.shared
                                .stats
                                .upload_errors
                                .fetch_add(1, Ordering::Relaxed);
                            if !upload_failing {
                                tracing::warn!(error = %e, "pingmesh agent: upload failed; results kept for the next one");
                                upload_failing = true;
                            }
                            pending = batch.results;
                            keep_newest(&mut pending, MAX_BACKLOG);
                        }
                    }
                }
            }
            // Until the next thing to do (a registration, a pinglist refresh, an
            // upload), at most 250 ms so a stop is seen soon: a few wake-ups a second
            // on an idle node instead of twenty.
            let now = Instant::now();
            let mut next = next_register.min(uploaded_at + self.config.upload_every);
            if self.config.probe && registered {
                next = next.min(refreshed_at.map_or(now, |t| t + self.config.refresh_every));
            }
            let nap = next
                .saturating_duration_since(now)
                .clamp(Duration::from_millis(1), Duration::from_millis(250));
            tokio::time::sleep(nap).await;
        }
    }

    /// Both pinglists and the service targets; `(targets, interval ns, timeout ns)`.
    async fn fetch_targets(
        &self,
        controller: &mut ControllerClient,
    ) -> Option<(Vec<ProbeTarget>, u64, u64)> {
        let mut targets = Vec::new();
        let (mut interval, mut timeout) = (100_000_000u64, 500_000_000u64);
        for kind in [proto::PinglistKind::TorMesh, proto::PinglistKind::InterTor] {
            let list = match controller
                .get_pinglist(proto::PinglistRequest {
                    gid: self.gid.to_string(),
                    kind: kind as i32,
                })
                .await
            {
                Ok(l) => l.into_inner(),
                Err(e) => {
                    tracing::warn!(error = %e, "pingmesh agent: no pinglist");
                    return None;
                }
            };
            interval = u64::from(list.interval_ms.max(1)) * 1_000_000;
            timeout = u64::from(list.timeout_ms.max(1)) * 1_000_000;
            for (i, t) in list.targets.iter().enumerate() {
                match convert::target_from(t, &format!("targets[{i}]")) {
                    Ok(mut target) => {
                        // The registry's timestamp changes on every refresh; the
                        // target does not.
                        target.rnic.last_updated_ms = 0;
                        targets.push(ProbeTarget {
                            target,
                            services: Vec::new(),
                        })
                    }
                    Err(e) => tracing::warn!(error = %e, "pingmesh agent: pinglist entry skipped"),
                }
            }
        }
        if let Some(connections) = &self.config.connections {
            for c in connections() {
                let Ok(found) = controller
                    .get_target_rnic_info(proto::TargetRnicInfoRequest {
                        gid: String::new(),
                        ip: c.peer_ip.to_string(),
                    })
                    .await
                else {
                    continue;
                };
                let Some(info) = found.into_inner().rnic else {
                    continue;
                };
                let Ok(rnic) = convert::rnic_from(&info, "rnic", 0) else {
                    continue;
                };
                // The NIC hashes a connection's queue pair numbers into its UDP
                // source port; a probe with the same entropy takes the same path.
                let entropy = (u64::from(c.local_qpn) << 32) | u64::from(c.remote_qpn);
                targets.push(ProbeTarget {
                    target: Target {
                        flow_label: flow_label(&self.gid, &rnic.gid, entropy, 0),
                        rnic,
                        kind: ListKind::TorMesh,
                    },
                    services: c.services,
                });
            }
        }
        Some((targets, interval, timeout))
    }
}

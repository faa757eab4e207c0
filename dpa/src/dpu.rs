//! A node's DPU side in software: the control-channel server where host pods register,
//! and the [`DpuShard`]s — the DMA work each proxy shard runs for its pods, on the
//! shard's own thread. Registering a pod creates its pools and one ring pair (a lane)
//! per shard, gives each shard its lane and exports everything, the shards' bells
//! included (their eventfds ride with the answer); a pod whose connection closes (it
//! exited or crashed) is removed from every shard and everything it held is
//! reclaimed.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use crossbeam_channel::Sender;
use parking_lot::Mutex;

use crate::bell::{BELL_LEN, Bell, BellError};
use crate::control::transport::{ControlServer, Endpoint, Handler, Peer, StoreReply};
use crate::control::{
    ErrorCode, LaneExport, PodExports, RegionExport, RegionKind, Request, Response, Role,
};
use crate::descriptor::{Buffer, Descriptor};
use crate::dma::manager::{Command, DmaManager, DmaStats, PodPort};
use crate::dma::{DmaEngine, SoftwareDma};
use crate::pool::{BufferPool, OwnerId, PoolError, PoolLayout};
use crate::ring::{Ring, RingError, ring_len};
use crate::shm::ShmError;

/// Sizes of what each registered pod gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PodSizing {
    /// Bytes per header slot (largest head).
    pub header_slot: u32,
    /// Header slots per direction.
    pub header_slots: u32,
    /// Bytes per body slot (largest body carried whole).
    pub body_slot: u32,
    /// Body slots per direction.
    pub body_slots: u32,
    /// Entries of the host TX and RX SQs.
    pub ring_capacity: u32,
}

impl Default for PodSizing {
    fn default() -> Self {
        Self {
            header_slot: 16 << 10,
            header_slots: 256,
            // 8 MiB bodies whole; tmpfs backs only the pages that are touched.
            body_slot: 8 << 20,
            body_slots: 32,
            ring_capacity: 256,
        }
    }
}

/// How a node is set up.
#[derive(Debug, Clone)]
pub struct DpuConfig {
    /// The node's name (in region names and Hello answers).
    pub name: String,
    /// What each pod gets.
    pub pod: PodSizing,
    /// Slots of each shard's DPU header pools (slot size = `pod.header_slot`).
    pub dpu_header_slots: u32,
    /// Proxy shards (threads) the node's pods are spread over.
    pub shards: usize,
    /// Most pods at once.
    pub max_pods: u32,
    /// Services that run on other nodes, with the fabric address of one of them (what
    /// `Locate` answers when no pod here serves the service).
    pub remote_services: std::collections::BTreeMap<String, std::net::SocketAddr>,
    /// The mesh's registration key: a pod registers only with its service's token
    /// (`None`: anyone who reaches the control socket registers as anything).
    pub registration: Option<dpumesh_identity::registration::RegistrationKey>,
    /// The BlueCache agent store messages go to (`None`: they are refused).
    pub store: Option<Arc<dyn crate::control::transport::StoreService>>,
    /// The node's certificates for a control channel on TCP (mutual TLS: there is no
    /// TCP without it); a Unix socket needs none.
    pub control_tls: Option<Arc<dpumesh_identity::MeshTls>>,
    /// What a service's name is appended to for its workload's SPIFFE ID: a peer that
    /// proved an identity (over TCP) acts only for the service of that identity.
    pub workload_prefix: Option<String>,
}

impl DpuConfig {
    /// Defaults for node `name`.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            pod: PodSizing::default(),
            dpu_header_slots: 1024,
            shards: 1,
            max_pods: 64,
            remote_services: std::collections::BTreeMap::new(),
            registration: None,
            store: None,
            control_tls: None,
            workload_prefix: None,
        }
    }
}

/// Why the node could not start or register a pod.
#[derive(Debug, thiserror::Error)]
pub enum DpuError {
    /// Shared memory.
    #[error(transparent)]
    Shm(#[from] ShmError),
    #[error(transparent)]
    Pool(#[from] PoolError),
    #[error(transparent)]
    Ring(#[from] RingError),
    /// A shard's bell.
    #[error(transparent)]
    Bell(#[from] BellError),
    /// The control channel.
    #[error(transparent)]
    Control(#[from] crate::control::ControlError),
    /// The node's limits.
    #[error("{0}")]
    Limit(String),
    /// The operating system.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// A registered pod, as the node's table knows it.
#[derive(Debug, Clone)]
pub struct PodInfo {
    pub id: u32,
    pub name: String,
    pub service: String,
    /// Its process.
    pub pid: u32,
    /// Its RX body pool (where a remote peer writes bodies for it).
    pub rx_body: BufferPool,
    /// Its TX body pool (what the proxy reads when a body leaves the node).
    pub tx_body: BufferPool,
    /// The control connection that registered it.
    peer: u64,
    /// Its four pools' region ids (recycled when it leaves).
    regions: [u16; 4],
    /// Its control connection closed: it is being let go (the shards may still hold
    /// bodies it sent), and its name is free for the process that replaces it.
    leaving: bool,
}

impl PodInfo {
    /// Its control connection closed and the node is letting go of it.
    pub fn is_leaving(&self) -> bool {
        self.leaving
    }
}

/// What the node keeps of a shard it handed out.
struct ShardHandle {
    commands: Sender<Command>,
    bell: Bell,
    dpu_tx_header: BufferPool,
    dpu_rx_header: BufferPool,
    stats: Arc<DmaStats>,
}

struct Shared {
    config: DpuConfig,
    prefix: String,
    next_pod: AtomicU32,
    next_region: AtomicU32,
    /// Region ids of pods that left, for reuse.
    free_regions: Mutex<Vec<u16>>,
    /// Registrations run one at a time, so the name and capacity checks hold until
    /// the pod is in the table.
    registering: Mutex<()>,
    pods: Mutex<HashMap<u32, PodInfo>>,
    shards: Vec<ShardHandle>,
}

/// A region's name as exports show it: it is passed as a descriptor, so the name is
/// only for messages.
fn shown(region: &crate::shm::SharedRegion) -> std::path::PathBuf {
    std::path::PathBuf::from(format!("memfd:{}", region.name()))
}

impl Shared {
    /// A region id: one freed by a departed pod, else a new one.
    fn region_id(&self) -> Result<u16, DpuError> {
        if let Some(id) = self.free_regions.lock().pop() {
            return Ok(id);
        }
        let id = self.next_region.fetch_add(1, Ordering::Relaxed);
        u16::try_from(id).map_err(|_| DpuError::Limit("the node ran out of region ids".to_owned()))
    }

    fn pool(&self, what: &str, size: u32, count: u32) -> Result<BufferPool, DpuError> {
        Ok(BufferPool::create_sealed(
            &format!("{}-{what}", self.prefix),
            self.region_id()?,
            PoolLayout::new(size, count),
        )?)
    }

    /// Makes pod `name`'s regions and takes it in: what it maps, and the regions'
    /// descriptors in the order [`PodExports`] gives (the bells' eventfds aside).
    fn register(
        &self,
        peer: &Peer,
        name: String,
        service: String,
        pid: u32,
    ) -> Result<(PodExports, Vec<OwnedFd>), DpuError> {
        let _one_at_a_time = self.registering.lock();
        {
            let pods = self.pods.lock();
            // A pod that is leaving holds its name no longer: its restarted process
            // registers while the shards still let go of the old one (up to
            // `LEAVE_GRACE`), and a refusal then would make it exit and crash-loop.
            if pods.values().any(|p| p.name == name && !p.leaving) {
                return Err(DpuError::Limit(format!(
                    "a pod named {name:?} is registered already"
                )));
            }
            if pods.len() as u32 >= self.config.max_pods {
                return Err(DpuError::Limit(format!(
                    "the node serves at most {} pods",
                    self.config.max_pods
                )));
            }
        }
        let id = self.next_pod.fetch_add(1, Ordering::Relaxed);
        let s = self.config.pod;
        let tag = format!("pod{id}");
        let tx_header = self.pool(&format!("{tag}-txh"), s.header_slot, s.header_slots)?;
        let tx_body = self.pool(&format!("{tag}-txb"), s.body_slot, s.body_slots)?;
        let rx_header = self.pool(&format!("{tag}-rxh"), s.header_slot, s.header_slots)?;
        let rx_body = self.pool(&format!("{tag}-rxb"), s.body_slot, s.body_slots)?;
        // A ring pair per shard (its lane): whichever shard takes a request for this
        // pod delivers it and gets the answer back itself.
        let mut lanes = Vec::with_capacity(self.shards.len());
        for k in 0..self.shards.len() {
            let tx =
                Ring::create_sealed(&format!("{}-{tag}-l{k}-txsq", self.prefix), s.ring_capacity)?;
            let rx =
                Ring::create_sealed(&format!("{}-{tag}-l{k}-rxsq", self.prefix), s.ring_capacity)?;
            lanes.push((tx, rx));
        }
        let pool_export = |p: &BufferPool| RegionExport {
            id: p.id(),
            path: shown(p.region()),
            len: p.region().len() as u64,
            kind: RegionKind::Pool {
                slot_size: p.layout().slot_size,
                slot_count: p.layout().slot_count,
            },
            hw_export: Vec::new(),
        };
        let ring_export = |r: &Ring| RegionExport {
            id: 0,
            path: shown(r.region()),
            len: ring_len(r.capacity()) as u64,
            kind: RegionKind::Ring {
                capacity: r.capacity(),
            },
            hw_export: Vec::new(),
        };
        let exports = PodExports {
            pod_id: id,
            tx_header: pool_export(&tx_header),
            tx_body: pool_export(&tx_body),
            rx_header: pool_export(&rx_header),
            rx_body: pool_export(&rx_body),
            lanes: lanes
                .iter()
                .zip(&self.shards)
                .map(|((tx, rx), shard)| LaneExport {
                    tx_sq: ring_export(tx),
                    rx_sq: ring_export(rx),
                    bell: RegionExport {
                        id: 0,
                        path: shown(shard.bell.region()),
                        len: BELL_LEN as u64,
                        kind: RegionKind::Bell,
                        hw_export: Vec::new(),
                    },
                })
                .collect(),
        };
        // What the pod maps, as descriptors: its regions are anonymous (no other pod
        // can open them by a name) and sealed (no one can truncate them).
        let dup = |region: &crate::shm::SharedRegion| {
            rustix::io::fcntl_dupfd_cloexec(region.fd(), 0).map_err(std::io::Error::from)
        };
        let mut fds = Vec::with_capacity(4 + 3 * lanes.len());
        for shard in &self.shards {
            fds.push(dup(shard.bell.region())?);
        }
        for pool in [&tx_header, &tx_body, &rx_header, &rx_body] {
            fds.push(dup(pool.region())?);
        }
        for (tx, rx) in &lanes {
            fds.push(dup(tx.region())?);
            fds.push(dup(rx.region())?);
        }
        // Every shard's DMA manager knows the pod before the proxy can see it in the
        // table: a proxy that routed to a pod its manager did not know yet had the
        // delivery refused (unknown pod) with the body slot it had reserved in the
        // pod's pool, which the manager could not give back (it has no port for the
        // pod), so the slot leaked. Commands come before descriptors in a pass.
        // The pod sleeps on its first RX lane's futex for all of them.
        let wake = lanes[0].1.clone();
        for (k, ((tx, rx), handle)) in lanes.iter().zip(&self.shards).enumerate() {
            let port = PodPort {
                id,
                tx_header: tx_header.clone(),
                tx_body: tx_body.clone(),
                rx_header: rx_header.clone(),
                rx_body: rx_body.clone(),
                tx_sq: tx.consumer(),
                rx_sq: rx.producer().wakes_through(wake.clone()),
                lane: k as u8,
            };
            let _ = handle.commands.send(Command::AddPod(Box::new(port)));
            handle.bell.ring();
        }
        self.pods.lock().insert(
            id,
            PodInfo {
                id,
                name,
                service,
                pid,
                rx_body: rx_body.clone(),
                tx_body: tx_body.clone(),
                peer: peer.id,
                regions: [tx_header.id(), tx_body.id(), rx_header.id(), rx_body.id()],
                leaving: false,
            },
        );
        Ok((exports, fds))
    }

    /// Removes a pod: the manager stops polling it and drops its port (its regions are
    /// unlinked once nothing maps them), and DPU slots held for it are freed.
    fn remove(&self, id: u32) -> bool {
        let Some(name) = self.pods.lock().get_mut(&id).map(|p| {
            p.leaving = true;
            p.name.clone()
        }) else {
            return false;
        };
        // Every shard holds a lane into the pod: each lets go of it (all at once, so
        // the grace periods overlap).
        let mut waits = Vec::with_capacity(self.shards.len());
        for handle in &self.shards {
            let (done, wait) = crossbeam_channel::bounded(1);
            if handle.commands.send(Command::RemovePod(id, done)).is_ok() {
                handle.bell.interrupt();
                waits.push(wait);
            }
        }
        // A shard answers once nothing it claimed from the pod is still on its way;
        // a shard that stopped answers never (its pods went with it).
        let deadline =
            std::time::Instant::now() + crate::dma::manager::LEAVE_GRACE + Duration::from_secs(1);
        for wait in waits {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let _ = wait.recv_timeout(left);
        }
        // Out of the table only once the manager has let go of the pod's port, so a
        // pod missing from the table is gone from the data path too; then its region
        // ids can name a new pod's pools.
        if let Some(info) = self.pods.lock().remove(&id) {
            self.free_regions.lock().extend(info.regions);
        }
        tracing::info!(pod = id, %name, "pod removed");
        true
    }
}

struct ControlHandler(Arc<Shared>);

impl Handler for ControlHandler {
    fn node_name(&self) -> String {
        self.0.config.name.clone()
    }

    fn handle(&self, peer: &Peer, request: Request) -> Response {
        self.answer(peer, request).0
    }

    fn handle_with_fds(&self, peer: &Peer, request: Request) -> (Response, Vec<OwnedFd>) {
        self.answer(peer, request)
    }

    fn handle_store(&self, peer: &Peer, message: Vec<u8>, fds: Vec<OwnedFd>, reply: StoreReply) {
        let Some(store) = &self.0.config.store else {
            return reply.refuse(
                ErrorCode::BadRequest,
                "this node runs no BlueCache store (no `store:` in the mesh file)",
            );
        };
        // A service's keys are its own: a client acts for the service it proved.
        match &peer.service {
            Some(service) => store.handle(peer.id, service, message, fds, reply),
            None => reply.refuse(
                ErrorCode::Unauthorized,
                "a store client proves its service first (Authenticate, with the token a pod registers with: DPUMESH_SERVICE, DPUMESH_TOKEN)",
            ),
        }
    }

    fn authenticate(
        &self,
        peer: &Peer,
        service: &str,
        token: Option<&str>,
    ) -> Result<(), Response> {
        self.check_token(peer, "authenticate", service, token)
    }

    fn disconnected(&self, peer: &Peer) {
        if let Some(store) = &self.0.config.store {
            store.disconnected(peer.id);
        }
        let ids: Vec<u32> = self
            .0
            .pods
            .lock()
            .values()
            .filter(|p| p.peer == peer.id)
            .map(|p| p.id)
            .collect();
        for id in ids {
            tracing::info!(pod = id, peer = %peer.name, "control connection closed: reclaiming the pod");
            self.0.remove(id);
        }
    }
}

impl ControlHandler {
    /// Ids of the pods serving `service` here, in order.
    fn pods_of(&self, service: &str) -> Vec<u32> {
        let mut pods: Vec<u32> = self
            .0
            .pods
            .lock()
            .values()
            .filter(|p| p.service == service && !p.leaving)
            .map(|p| p.id)
            .collect();
        pods.sort_unstable();
        pods
    }

    /// Whether `peer` (a host) may act for `service`: with a registration key, only
    /// with `service`'s token. `who` names it in the refusal.
    fn check_token(
        &self,
        peer: &Peer,
        who: &str,
        service: &str,
        token: Option<&str>,
    ) -> Result<(), Response> {
        if peer.role != Role::Host {
            return Err(Response::Error {
                code: ErrorCode::BadRequest,
                message: "only hosts act for services".to_owned(),
            });
        }
        // A peer that proved an identity (TCP's mutual TLS) acts for its workload's
        // service only.
        if let Some(id) = &peer.identity {
            let theirs = self
                .0
                .config
                .workload_prefix
                .as_deref()
                .is_some_and(|prefix| id.to_string() == format!("{prefix}{service}"));
            if !theirs {
                return Err(Response::Error {
                    code: ErrorCode::Unauthorized,
                    message: format!("{who} proved {id}, which is not the workload of {service}"),
                });
            }
        }
        if let Some(key) = &self.0.config.registration
            && !token.is_some_and(|t| key.verify(service, t))
        {
            let why = if token.is_none() {
                "no registration token (DPUMESH_TOKEN)"
            } else {
                "a registration token that does not prove the service"
            };
            return Err(Response::Error {
                code: ErrorCode::Unauthorized,
                message: format!("{who} cannot act as {service}: {why}"),
            });
        }
        Ok(())
    }

    /// The answer, and the serving shard's bell eventfd with a registration.
    fn answer(&self, peer: &Peer, request: Request) -> (Response, Vec<OwnedFd>) {
        if let Request::RegisterPod {
            name,
            service,
            pid,
            token,
        } = request
        {
            if let Err(refusal) = self.check_token(peer, &name, &service, token.as_deref()) {
                tracing::warn!(pod = name, service, pid, "refused a registration");
                return (refusal, Vec::new());
            }
            return match self.0.register(peer, name, service, pid) {
                Ok((exports, regions)) => {
                    // Every shard's bell eventfd, in lane order, then the regions.
                    let bells = self
                        .0
                        .shards
                        .iter()
                        .map(|s| rustix::io::fcntl_dupfd_cloexec(s.bell.fd(), 0))
                        .collect::<Result<Vec<_>, _>>();
                    match bells {
                        Ok(mut fds) => {
                            fds.extend(regions);
                            (Response::PodRegistered(Box::new(exports)), fds)
                        }
                        Err(e) => {
                            self.0.remove(exports.pod_id);
                            (
                                Response::Error {
                                    code: ErrorCode::Internal,
                                    message: format!("cannot pass the pod its bells: {e}"),
                                },
                                Vec::new(),
                            )
                        }
                    }
                }
                Err(DpuError::Limit(message)) => (
                    Response::Error {
                        code: if message.contains("registered already") {
                            ErrorCode::AlreadyRegistered
                        } else {
                            ErrorCode::Exhausted
                        },
                        message,
                    },
                    Vec::new(),
                ),
                Err(e) => (
                    Response::Error {
                        code: ErrorCode::Internal,
                        message: e.to_string(),
                    },
                    Vec::new(),
                ),
            };
        }
        let response = match request {
            Request::Hello { .. } => Response::Ok,
            // Served by `handle_store` and `authenticate`, which the transport calls
            // for them.
            Request::Store(_) | Request::Authenticate { .. } => Response::Error {
                code: ErrorCode::Internal,
                message: "a store message took the wrong path".to_owned(),
            },
            Request::Ping => Response::Pong,
            Request::Resolve { service } => Response::Resolved {
                pods: self.pods_of(&service),
            },
            Request::Locate { service } => {
                let pods = self.pods_of(&service);
                let remote = if pods.is_empty() {
                    self.0
                        .config
                        .remote_services
                        .get(&service)
                        .map(|a| a.to_string())
                } else {
                    None
                };
                Response::Located { pods, remote }
            }
            // Registrations are answered above, with their descriptors.
            Request::RegisterPod { .. } => Response::Error {
                code: ErrorCode::Internal,
                message: "registration took the wrong path".to_owned(),
            },
            Request::UnregisterPod { pod_id } => {
                let owned = self
                    .0
                    .pods
                    .lock()
                    .get(&pod_id)
                    .is_some_and(|p| p.peer == peer.id);
                if owned && self.0.remove(pod_id) {
                    Response::Ok
                } else {
                    Response::Error {
                        code: ErrorCode::UnknownPod,
                        message: format!("pod {pod_id} is not registered by this connection"),
                    }
                }
            }
        };
        (response, Vec::new())
    }
}

/// A running node's DPU side.
pub struct Dpu {
    shared: Arc<Shared>,
    control: Option<ControlServer>,
    /// Shards not taken by a proxy yet.
    shards: Mutex<Vec<DpuShard>>,
}

impl std::fmt::Debug for Dpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dpu")
            .field("name", &self.shared.config.name)
            .finish_non_exhaustive()
    }
}

impl DmaEngine for Box<dyn DmaEngine> {
    fn name(&self) -> &'static str {
        (**self).name()
    }

    fn copy(&mut self, jobs: &[crate::dma::CopyJob<'_>]) -> Result<(), crate::dma::DmaError> {
        (**self).copy(jobs)
    }
}

impl Dpu {
    /// Starts a node with the software DMA engine, listening for pods on `control`.
    pub fn start(config: DpuConfig, control: &Endpoint) -> Result<Self, DpuError> {
        Self::start_with(config, control, || Box::new(SoftwareDma))
    }

    /// Starts a node whose shards get their DMA engines from `engine`.
    pub fn start_with(
        config: DpuConfig,
        control: &Endpoint,
        mut engine: impl FnMut() -> Box<dyn DmaEngine>,
    ) -> Result<Self, DpuError> {
        if config.shards == 0 || config.shards > usize::from(u8::MAX) + 1 {
            return Err(DpuError::Limit(format!(
                "a node runs 1 to 256 shards (a descriptor names its lane in a byte), not {}",
                config.shards
            )));
        }
        let prefix = format!("dpumesh-{}", config.name);
        let next_region = AtomicU32::new(1);
        let header = PoolLayout::new(config.pod.header_slot, config.dpu_header_slots);
        let mut handles = Vec::new();
        let mut shards = Vec::new();
        for i in 0..config.shards {
            // Anonymous and sealed: every request head passes through these pools,
            // and no pod may open them by a name.
            let pool = |what: &str| {
                BufferPool::create_sealed(
                    &format!("{prefix}-s{i}-{what}"),
                    next_region.fetch_add(1, Ordering::Relaxed) as u16,
                    header,
                )
            };
            let dpu_tx_header = pool("dpu-txh")?;
            let dpu_rx_header = pool("dpu-rxh")?;
            let bell = Bell::create_sealed(&format!("{prefix}-s{i}-bell"))?;
            let (commands, receiver) = crossbeam_channel::unbounded();
            let stats = Arc::new(DmaStats::default());
            handles.push(ShardHandle {
                commands,
                bell: bell.clone(),
                dpu_tx_header: dpu_tx_header.clone(),
                dpu_rx_header: dpu_rx_header.clone(),
                stats: stats.clone(),
            });
            shards.push(DpuShard {
                index: i,
                dma: DmaManager::new(
                    engine(),
                    dpu_tx_header.clone(),
                    dpu_rx_header.clone(),
                    receiver,
                    stats,
                ),
                bell,
                dpu_tx_header,
                dpu_rx_header,
                shared: None,
            });
        }
        let shared = Arc::new(Shared {
            prefix,
            next_pod: AtomicU32::new(1),
            next_region,
            free_regions: Mutex::new(Vec::new()),
            registering: Mutex::new(()),
            pods: Mutex::new(HashMap::new()),
            shards: handles,
            config,
        });
        for shard in &mut shards {
            shard.shared = Some(shared.clone());
        }
        let control = ControlServer::start_with_tls(
            control,
            Arc::new(ControlHandler(shared.clone())),
            shared.config.control_tls.clone(),
        )?;
        Ok(Self {
            shared,
            control: Some(control),
            shards: Mutex::new(shards),
        })
    }

    /// Where pods register.
    pub fn control_endpoint(&self) -> &Endpoint {
        self.control.as_ref().expect("running").endpoint()
    }

    /// The node's name.
    pub fn name(&self) -> &str {
        &self.shared.config.name
    }

    /// Takes the shards (once), for the proxy threads that run them.
    pub fn take_shards(&self) -> Vec<DpuShard> {
        std::mem::take(&mut *self.shards.lock())
    }

    /// Registered pods.
    pub fn pods(&self) -> Vec<PodInfo> {
        let mut pods: Vec<_> = self.shared.pods.lock().values().cloned().collect();
        pods.sort_by_key(|p| p.id);
        pods
    }

    /// The shards' DMA counters, summed.
    pub fn stats(&self) -> DmaStats {
        let sum = DmaStats::default();
        for s in &self.shared.shards {
            for (total, part) in [
                (&sum.intake, &s.stats.intake),
                (&sum.delivered, &s.stats.delivered),
                (&sum.completions, &s.stats.completions),
                (&sum.errors, &s.stats.errors),
                (&sum.bytes, &s.stats.bytes),
                (&sum.copies, &s.stats.copies),
                (&sum.held, &s.stats.held),
            ] {
                total.fetch_add(part.load(Ordering::Relaxed), Ordering::Relaxed);
            }
        }
        sum
    }

    /// Slots in use in the shards' DPU header pools (TX, RX).
    pub fn dpu_pool_use(&self) -> (usize, usize) {
        self.shared.shards.iter().fold((0, 0), |(tx, rx), s| {
            (tx + s.dpu_tx_header.in_use(), rx + s.dpu_rx_header.in_use())
        })
    }
}

impl Drop for Dpu {
    fn drop(&mut self) {
        // Pods first hear Teardown; then the shards drop their pods.
        self.control.take();
        for s in &self.shared.shards {
            let _ = s.commands.send(Command::Stop);
            s.bell.interrupt();
        }
    }
}

/// The DMA work of one proxy shard: the pods the node gave it (their rings and pools),
/// run inline on the shard's thread — descriptors from pods come in, decisions go out,
/// and no other thread is involved. Sleep on [`DpuShard::bell`]: pods ring it after
/// they publish.
pub struct DpuShard {
    index: usize,
    dma: DmaManager<Box<dyn DmaEngine>>,
    bell: Bell,
    dpu_tx_header: BufferPool,
    dpu_rx_header: BufferPool,
    shared: Option<Arc<Shared>>,
}

impl std::fmt::Debug for DpuShard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DpuShard")
            .field("index", &self.index)
            .finish_non_exhaustive()
    }
}

impl DpuShard {
    fn shared(&self) -> &Shared {
        self.shared.as_ref().expect("set when the node starts")
    }

    /// The shard's number on its node.
    pub fn index(&self) -> usize {
        self.index
    }

    /// The bell pods ring after publishing (and the node, when pods come and go).
    pub fn bell(&self) -> &Bell {
        &self.bell
    }

    /// One pass of DMA work: pods added or removed, descriptors from the pods' TX
    /// SQs (their heads copied into this shard's DPU pool), held deliveries retried.
    /// Returns how much was done.
    pub fn pass(&mut self) -> usize {
        self.dma.pass()
    }

    /// Wakes the pods given descriptors since their last wake-up: call it at the end
    /// of each batch of work and before sleeping (one wake-up per pod per batch).
    pub fn wake_pods(&mut self) {
        self.dma.wake_pods();
    }

    /// Whether a pass or [`DpuShard::try_recv`] would find something.
    pub fn has_work(&self) -> bool {
        self.dma.has_work()
    }

    /// Whether deliveries wait for room in a pod's ring (retry soon: pods do not say
    /// when they make room).
    pub fn holding(&self) -> bool {
        self.dma.holding()
    }

    /// Whether a descriptor is waiting for the proxy.
    pub fn has_next(&self) -> bool {
        self.dma.has_work()
    }

    /// The next descriptor for the proxy: a pod's request or response (its header in
    /// a DPU pool), or a notice that a delivery failed. Runs a pass when none is
    /// waiting.
    pub fn try_recv(&mut self) -> Result<Option<Descriptor>, RingError> {
        if let Some(d) = self.dma.next_for_proxy() {
            return Ok(Some(d));
        }
        self.dma.pass();
        Ok(self.dma.next_for_proxy())
    }

    /// Waits up to `timeout` (on the bell) for the next descriptor, doing the DMA
    /// work meanwhile: for a thread that serves only this shard (tests, tools).
    pub fn recv(&mut self, timeout: Duration) -> Result<Option<Descriptor>, RingError> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if let Some(d) = self.try_recv()? {
                return Ok(Some(d));
            }
            self.dma.wake_pods();
            let Some(left) = deadline.checked_duration_since(std::time::Instant::now()) else {
                return Ok(None);
            };
            // Held deliveries are retried soon: pods do not ring when they make room.
            let left = if self.holding() {
                left.min(Duration::from_micros(200))
            } else {
                left
            };
            let dma = &self.dma;
            self.bell.wait(Some(left), || dma.has_work());
        }
    }

    /// The header bytes a descriptor names (in a DPU header pool).
    pub fn header(&self, d: &Descriptor) -> Result<Vec<u8>, PoolError> {
        self.dpu_pool(d.header)?.read(d.header)
    }

    fn dpu_pool(&self, b: Buffer) -> Result<&BufferPool, PoolError> {
        if b.addr.region() == self.dpu_tx_header.id() {
            Ok(&self.dpu_tx_header)
        } else {
            Ok(&self.dpu_rx_header)
        }
    }

    /// Writes a new header (a reply, or a head that arrived over the fabric) into the
    /// shard's RX header pool, held by the proxy until it is delivered or released.
    pub fn alloc_header(&self, bytes: &[u8]) -> Result<Buffer, PoolError> {
        let pool = &self.dpu_rx_header;
        let slot = pool.alloc(OwnerId::PROXY)?;
        pool.write(slot, bytes).inspect_err(|_| {
            let _ = pool.release(slot, OwnerId::PROXY);
        })
    }

    /// Frees a header the proxy holds (one it will not forward).
    pub fn release_header(&self, header: Buffer) -> Result<(), PoolError> {
        let pool = self.dpu_pool(header)?;
        let slot = pool.slot_of(header)?;
        pool.release(slot, OwnerId::PROXY)
    }

    /// Hands a decision to the DMA work: a delivery to a pod (done at once, or held
    /// while its ring is full), or a completion.
    pub fn forward(&mut self, d: &Descriptor) -> Result<(), RingError> {
        self.dma.from_proxy(*d);
        Ok(())
    }

    /// A registered pod by id.
    pub fn pod(&self, id: u32) -> Option<PodInfo> {
        self.shared().pods.lock().get(&id).cloned()
    }

    /// Reserves a body slot in pod `pod`'s RX body pool for a body that arrives from
    /// outside the node (the fabric writes it there; case 2). Held by the fabric until
    /// the delivery hands it to the pod.
    pub fn reserve_body(&self, pod: u32, len: u32) -> Result<Buffer, PoolError> {
        let info = self
            .pod(pod)
            .ok_or_else(|| PoolError::Layout(format!("pod {pod} is not registered")))?;
        let slot = info.rx_body.alloc(OwnerId::FABRIC)?;
        info.rx_body.buffer(slot, len).inspect_err(|_| {
            let _ = info.rx_body.release(slot, OwnerId::FABRIC);
        })
    }
}

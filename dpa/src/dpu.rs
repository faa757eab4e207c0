//! A node's DPU side in software: the DPU header pools, the sidecar rings to the proxy
//! workers, the DMA manager thread, and the control-channel server where host pods
//! register. Registering a pod creates its pools and rings and exports them; a pod
//! whose connection closes (it exited or crashed) is removed and everything it held
//! is reclaimed.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::Sender;
use parking_lot::Mutex;

use crate::control::transport::{ControlServer, Endpoint, Handler, Peer};
use crate::control::{ErrorCode, PodExports, RegionExport, RegionKind, Request, Response, Role};
use crate::descriptor::{Buffer, Descriptor};
use crate::dma::manager::{Command, DmaManager, DmaStats, PodPort, SidecarRings};
use crate::dma::{DmaEngine, SoftwareDma};
use crate::doorbell::{DOORBELL_LEN, Doorbell};
use crate::pool::{BufferPool, OwnerId, PoolError, PoolLayout};
use crate::ring::{Consumer, Producer, Ring, RingError, WakeMode, ring_len};
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
    /// Slots of each DPU header pool (slot size = `pod.header_slot`).
    pub dpu_header_slots: u32,
    /// Sidecar ports (one per proxy worker).
    pub sidecar_ports: usize,
    /// Entries of each sidecar ring.
    pub sidecar_ring_capacity: u32,
    /// How the DMA manager waits for work.
    pub wake: WakeMode,
    /// Most pods at once.
    pub max_pods: u32,
    /// Called after the DMA manager publishes to a sidecar TX SQ (a proxy that sleeps
    /// on something else than the ring, e.g. its fabric completion queue).
    pub sidecar_notify: Option<crate::fabric::Interrupter>,
    /// Services that run on other nodes, with the fabric address of one of them (what
    /// `Locate` answers when no pod here serves the service).
    pub remote_services: std::collections::BTreeMap<String, std::net::SocketAddr>,
}

impl DpuConfig {
    /// Defaults for node `name`.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            pod: PodSizing::default(),
            dpu_header_slots: 1024,
            sidecar_ports: 1,
            sidecar_ring_capacity: 1024,
            wake: WakeMode::LOW_CPU,
            max_pods: 64,
            sidecar_notify: None,
            remote_services: std::collections::BTreeMap::new(),
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
    /// The control channel.
    #[error(transparent)]
    Control(#[from] crate::control::ControlError),
    /// The node's limits.
    #[error("{0}")]
    Limit(String),
    #[error("cannot start the DMA manager: {0}")]
    Thread(#[from] std::io::Error),
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
    commands: Sender<Command>,
    doorbell: Doorbell,
    dpu_tx_header: BufferPool,
    dpu_rx_header: BufferPool,
    stats: Arc<DmaStats>,
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
        Ok(BufferPool::create_in_shm(
            &format!("{}-{what}", self.prefix),
            self.region_id()?,
            PoolLayout::new(size, count),
        )?)
    }

    fn register(
        &self,
        peer: &Peer,
        name: String,
        service: String,
        pid: u32,
    ) -> Result<PodExports, DpuError> {
        let _one_at_a_time = self.registering.lock();
        {
            let pods = self.pods.lock();
            if pods.values().any(|p| p.name == name) {
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
        let tx_sq = Ring::create_in_shm(&format!("{}-{tag}-txsq", self.prefix), s.ring_capacity)?;
        let rx_sq = Ring::create_in_shm(&format!("{}-{tag}-rxsq", self.prefix), s.ring_capacity)?;
        let pool_export = |p: &BufferPool| RegionExport {
            id: p.id(),
            path: p.region().path().to_owned(),
            len: p.region().len() as u64,
            kind: RegionKind::Pool {
                slot_size: p.layout().slot_size,
                slot_count: p.layout().slot_count,
            },
            hw_export: Vec::new(),
        };
        let ring_export = |r: &Ring| RegionExport {
            id: 0,
            path: r.region().path().to_owned(),
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
            tx_sq: ring_export(&tx_sq),
            rx_sq: ring_export(&rx_sq),
            doorbell: RegionExport {
                id: 0,
                path: self.doorbell.region().path().to_owned(),
                len: DOORBELL_LEN as u64,
                kind: RegionKind::Doorbell,
                hw_export: Vec::new(),
            },
        };
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
            },
        );
        let port = PodPort {
            id,
            tx_header,
            tx_body,
            rx_header,
            rx_body,
            tx_sq: tx_sq.consumer(),
            rx_sq: rx_sq.producer(),
        };
        let _ = self.commands.send(Command::AddPod(Box::new(port)));
        self.doorbell.ring();
        Ok(exports)
    }

    /// Removes a pod: the manager stops polling it and drops its port (its regions are
    /// unlinked once nothing maps them), and DPU slots held for it are freed.
    fn remove(&self, id: u32) -> bool {
        let Some(name) = self.pods.lock().get(&id).map(|p| p.name.clone()) else {
            return false;
        };
        let (done, wait) = crossbeam_channel::bounded(1);
        if self.commands.send(Command::RemovePod(id, done)).is_ok() {
            self.doorbell.ring();
            let _ = wait.recv_timeout(crate::dma::manager::LEAVE_GRACE + Duration::from_secs(1));
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
        self.answer(peer, request)
    }

    fn disconnected(&self, peer: &Peer) {
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
            .filter(|p| p.service == service)
            .map(|p| p.id)
            .collect();
        pods.sort_unstable();
        pods
    }

    fn answer(&self, peer: &Peer, request: Request) -> Response {
        match request {
            Request::Hello { .. } => Response::Ok,
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
            Request::RegisterPod { .. } if peer.role != Role::Host => Response::Error {
                code: ErrorCode::BadRequest,
                message: "only hosts register pods".to_owned(),
            },
            Request::RegisterPod { name, service, pid } => {
                match self.0.register(peer, name, service, pid) {
                    Ok(exports) => Response::PodRegistered(Box::new(exports)),
                    Err(DpuError::Limit(message)) => Response::Error {
                        code: if message.contains("registered already") {
                            ErrorCode::AlreadyRegistered
                        } else {
                            ErrorCode::Exhausted
                        },
                        message,
                    },
                    Err(e) => Response::Error {
                        code: ErrorCode::Internal,
                        message: e.to_string(),
                    },
                }
            }
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
        }
    }
}

/// A running node.
pub struct Dpu {
    shared: Arc<Shared>,
    control: Option<ControlServer>,
    manager: Option<JoinHandle<()>>,
    sidecars: Mutex<Vec<SidecarPort>>,
}

impl std::fmt::Debug for Dpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dpu")
            .field("name", &self.shared.config.name)
            .finish_non_exhaustive()
    }
}

impl Dpu {
    /// Starts a node with the software DMA engine, listening for pods on `control`.
    pub fn start(config: DpuConfig, control: &Endpoint) -> Result<Self, DpuError> {
        Self::start_with(config, control, SoftwareDma)
    }

    /// Starts a node with a given DMA engine.
    pub fn start_with<E: DmaEngine>(
        config: DpuConfig,
        control: &Endpoint,
        engine: E,
    ) -> Result<Self, DpuError> {
        if config.sidecar_ports == 0 {
            return Err(DpuError::Limit(
                "a node needs at least one sidecar port".to_owned(),
            ));
        }
        let prefix = format!("dpumesh-{}", config.name);
        let doorbell = Doorbell::create_in_shm(&format!("{prefix}-bell"))?;
        let next_region = AtomicU32::new(1);
        let header = PoolLayout::new(config.pod.header_slot, config.dpu_header_slots);
        let dpu_tx_header = BufferPool::create_in_shm(
            &format!("{prefix}-dpu-txh"),
            next_region.fetch_add(1, Ordering::Relaxed) as u16,
            header,
        )?;
        let dpu_rx_header = BufferPool::create_in_shm(
            &format!("{prefix}-dpu-rxh"),
            next_region.fetch_add(1, Ordering::Relaxed) as u16,
            header,
        )?;
        let (commands, receiver) = crossbeam_channel::unbounded();
        let stats = Arc::new(DmaStats::default());
        let shared = Arc::new(Shared {
            prefix: prefix.clone(),
            next_pod: AtomicU32::new(1),
            next_region,
            free_regions: Mutex::new(Vec::new()),
            registering: Mutex::new(()),
            pods: Mutex::new(HashMap::new()),
            commands,
            doorbell: doorbell.clone(),
            dpu_tx_header: dpu_tx_header.clone(),
            dpu_rx_header: dpu_rx_header.clone(),
            stats: stats.clone(),
            config,
        });
        let mut rings = Vec::new();
        let mut ports = Vec::new();
        for i in 0..shared.config.sidecar_ports {
            let to_arm = Ring::create_in_shm(
                &format!("{prefix}-sc{i}-tx"),
                shared.config.sidecar_ring_capacity,
            )?;
            let from_arm = Ring::create_in_shm(
                &format!("{prefix}-sc{i}-rx"),
                shared.config.sidecar_ring_capacity,
            )?;
            let producer = match &shared.config.sidecar_notify {
                Some(notify) => to_arm.producer().with_notify(notify.clone()),
                None => to_arm.producer(),
            };
            rings.push(SidecarRings {
                to_arm: producer,
                from_arm: from_arm.consumer(),
            });
            ports.push(SidecarPort {
                index: i,
                from_dma: to_arm.consumer(),
                to_dma: from_arm.producer().with_doorbell(doorbell.clone()),
                shared: shared.clone(),
            });
        }
        let manager = DmaManager::new(
            engine,
            dpu_tx_header,
            dpu_rx_header,
            rings,
            doorbell,
            receiver,
            shared.config.wake,
            stats,
        );
        let manager = std::thread::Builder::new()
            .name(format!("dpumesh-dma-{}", shared.config.name))
            .spawn(move || manager.run())?;
        let control = ControlServer::start(control, Arc::new(ControlHandler(shared.clone())))?;
        Ok(Self {
            shared,
            control: Some(control),
            manager: Some(manager),
            sidecars: Mutex::new(ports),
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

    /// Takes the sidecar ports (once): one per proxy worker.
    pub fn take_sidecar_ports(&self) -> Vec<SidecarPort> {
        std::mem::take(&mut *self.sidecars.lock())
    }

    /// Registered pods.
    pub fn pods(&self) -> Vec<PodInfo> {
        let mut pods: Vec<_> = self.shared.pods.lock().values().cloned().collect();
        pods.sort_by_key(|p| p.id);
        pods
    }

    /// The DMA manager's counters.
    pub fn stats(&self) -> &DmaStats {
        &self.shared.stats
    }

    /// Slots in use in the DPU header pools (TX, RX).
    pub fn dpu_pool_use(&self) -> (usize, usize) {
        (
            self.shared.dpu_tx_header.in_use(),
            self.shared.dpu_rx_header.in_use(),
        )
    }
}

impl Drop for Dpu {
    fn drop(&mut self) {
        // Pods first hear Teardown; then the manager stops and everything unmaps.
        self.control.take();
        let _ = self.shared.commands.send(Command::Stop);
        self.shared.doorbell.ring();
        if let Some(m) = self.manager.take() {
            let _ = m.join();
        }
    }
}

/// The proxy's end of the data path on one node (one per worker): descriptors from
/// pods come in, decisions go out.
pub struct SidecarPort {
    index: usize,
    from_dma: Consumer,
    to_dma: Producer,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for SidecarPort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SidecarPort")
            .field("index", &self.index)
            .finish_non_exhaustive()
    }
}

impl SidecarPort {
    /// Waits up to `timeout` for the next descriptor from the DMA manager: a pod's
    /// request or response (header in a DPU pool), or an error about a delivery.
    pub fn recv(
        &mut self,
        mode: WakeMode,
        timeout: Duration,
    ) -> Result<Option<Descriptor>, RingError> {
        self.from_dma.pop_wait(mode, timeout)
    }

    /// Whether a descriptor is waiting.
    pub fn has_next(&self) -> bool {
        self.from_dma.has_next()
    }

    /// Takes the next descriptor if there is one.
    pub fn try_recv(&mut self) -> Result<Option<Descriptor>, RingError> {
        self.from_dma.try_pop()
    }

    /// The header bytes a descriptor names (in a DPU header pool).
    pub fn header(&self, d: &Descriptor) -> Result<Vec<u8>, PoolError> {
        self.dpu_pool(d.header)?.read(d.header)
    }

    fn dpu_pool(&self, b: Buffer) -> Result<&BufferPool, PoolError> {
        if b.addr.region() == self.shared.dpu_tx_header.id() {
            Ok(&self.shared.dpu_tx_header)
        } else {
            Ok(&self.shared.dpu_rx_header)
        }
    }

    /// Writes a new header (a reply, or a head that arrived over the fabric) into the
    /// DPU's RX header pool, held by the proxy until it is delivered or released.
    pub fn alloc_header(&self, bytes: &[u8]) -> Result<Buffer, PoolError> {
        let pool = &self.shared.dpu_rx_header;
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

    /// Hands a descriptor to the DMA manager: a delivery to a pod, or a completion.
    pub fn forward(&mut self, d: &Descriptor) -> Result<(), RingError> {
        self.to_dma.push(d)
    }

    /// The pod registered on this node under `service` (first by id), if any.
    pub fn pod_for_service(&self, service: &str) -> Option<PodInfo> {
        let pods = self.shared.pods.lock();
        pods.values()
            .filter(|p| p.service == service)
            .min_by_key(|p| p.id)
            .cloned()
    }

    /// A registered pod by id.
    pub fn pod(&self, id: u32) -> Option<PodInfo> {
        self.shared.pods.lock().get(&id).cloned()
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

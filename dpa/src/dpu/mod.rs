//! A node's DPU side in software: the control-channel server where host pods register,
//! and the [`DpuShard`]s — the DMA work each proxy shard runs for its pods, on the
//! shard's own thread. Registering a pod creates its pools and one ring pair (a lane)
//! per shard, gives each shard its lane and exports everything, the shards' bells
//! included (their eventfds ride with the answer); a pod whose connection closes (it
//! exited or crashed) is removed from every shard and everything it held is
//! reclaimed.
//!
//! - `registry`: the pods' table, registering and letting go of a pod, region ids;
//! - `adopt`: pods a host agent registers, their regions across PCIe;
//! - `control`: the control channel's handler over the registry;
//! - `shard`: the façade a proxy shard drives ([`DpuShard`]);
//! - here: the node's configuration and [`Dpu`], which starts them and hands out the
//!   shards.

mod adopt;
#[cfg(feature = "doca")]
pub mod comch;
mod control;
mod registry;
mod shard;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use parking_lot::Mutex;

use crate::bell::{Bell, BellError};
use crate::control::transport::{ControlServer, Endpoint};
use crate::dma::manager::{Command, DmaManager, DmaStats};
use crate::dma::{DmaEngine, SoftwareDma};
use crate::pool::{BufferPool, PoolError, PoolLayout};
use crate::ring::RingError;
use crate::shm::ShmError;

use control::ControlHandler;
pub use registry::PodInfo;
use registry::{ShardHandle, Shared};
pub use shard::DpuShard;

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
    /// Exports each pod's regions for a DMA engine across PCIe (on a BlueField host:
    /// `DocaExporter`); their descriptors go in the pod's `hw_export`s. `None`: the
    /// software path, whose regions both sides map.
    pub exporter: Option<Arc<parking_lot::Mutex<dyn crate::dma::export::RegionExporter>>>,
    /// The shards reach their pods' regions only through their engine, as a DPU reaches
    /// host memory across PCIe: they work on mirrors kept in step by it
    /// (`dma::manager::MirrorPort`), the engine `dma::reach::Loopback`. The software
    /// emulation of the BlueField split, for tests; bodies from the fabric into such a
    /// pod (case 2) are refused (they need the pools' RDMA registration).
    pub across_pcie: bool,
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
            exporter: None,
            across_pcie: false,
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
    /// Exporting a pod's regions for DMA across PCIe.
    #[error(transparent)]
    Export(#[from] crate::dma::DmaError),
    /// A host agent's pod that cannot be taken in (its regions do not match).
    #[error("cannot adopt the host agent's pod: {0}")]
    Adopt(String),
    /// The operating system.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// A running node's DPU side.
pub struct Dpu {
    shared: Arc<Shared>,
    control: Option<ControlServer>,
    /// The control channel on Comch, on a BlueField.
    #[cfg(feature = "doca")]
    comch: Option<comch::ComchThread>,
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

impl Dpu {
    /// Starts a node with the software DMA engine, listening for pods on `control`.
    pub fn start(config: DpuConfig, control: &Endpoint) -> Result<Self, DpuError> {
        if config.across_pcie {
            return Self::start_with(config, control, || {
                Box::new(crate::dma::reach::Loopback::new())
            });
        }
        Self::start_with(config, control, || Box::new(SoftwareDma))
    }

    /// Starts a node whose shards get their DMA engines from `engine`.
    pub fn start_with(
        config: DpuConfig,
        control: &Endpoint,
        engine: impl FnMut() -> Box<dyn DmaEngine>,
    ) -> Result<Self, DpuError> {
        let (shared, shards) = Self::build(config, engine)?;
        let control = ControlServer::start_with_tls(
            control,
            Arc::new(ControlHandler(shared.clone())),
            shared.config.control_tls.clone(),
        )?;
        Ok(Self {
            shared,
            control: Some(control),
            #[cfg(feature = "doca")]
            comch: None,
            shards: Mutex::new(shards),
        })
    }

    /// Starts a node on a BlueField (`doca` feature): its shards' engines are DOCA DMA
    /// on the device at `comch.pci`, it reaches its pods only across PCIe, and host
    /// agents register their pods with it over Comch (server `comch.name`, for the
    /// host function whose representor is `comch.rep_pci`). Written and compiled; it
    /// needs a BlueField to run.
    #[cfg(feature = "doca")]
    pub fn start_on_comch(
        mut config: DpuConfig,
        comch: &comch::ComchAddress,
    ) -> Result<Self, DpuError> {
        config.across_pcie = true;
        let mut engines = (0..config.shards)
            .map(|_| crate::dma::doca::DocaDma::open(&comch.pci))
            .collect::<Result<Vec<_>, _>>()?;
        let (shared, shards) = Self::build(config, move || {
            Box::new(engines.pop().expect("one engine per shard"))
        })?;
        let server = comch::ComchThread::start(comch, Arc::new(ControlHandler(shared.clone())))?;
        Ok(Self {
            shared,
            control: None,
            comch: Some(server),
            shards: Mutex::new(shards),
        })
    }

    /// The shards and what they share.
    fn build(
        config: DpuConfig,
        mut engine: impl FnMut() -> Box<dyn DmaEngine>,
    ) -> Result<(Arc<Shared>, Vec<DpuShard>), DpuError> {
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
        Ok((shared, shards))
    }

    /// Where pods register: the control socket's endpoint, or (on Comch) the Comch
    /// server's name.
    pub fn control_endpoint(&self) -> String {
        match &self.control {
            Some(server) => server.endpoint().to_string(),
            #[cfg(feature = "doca")]
            None => self
                .comch
                .as_ref()
                .map_or_else(String::new, |c| format!("comch:{}", c.name())),
            #[cfg(not(feature = "doca"))]
            None => String::new(),
        }
    }

    /// The control socket's endpoint (`None` on Comch).
    pub fn control_socket(&self) -> Option<&Endpoint> {
        self.control.as_ref().map(ControlServer::endpoint)
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
        #[cfg(feature = "doca")]
        self.comch.take();
        for s in &self.shared.shards {
            let _ = s.commands.send(Command::Stop);
            s.bell.interrupt();
        }
    }
}

//! The node's pod registry: registering a pod (its pools, a lane per shard, the
//! descriptors it maps), letting go of one that left, and region ids.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use crossbeam_channel::Sender;
use parking_lot::Mutex;

use crate::bell::{BELL_LEN, Bell};
use crate::control::transport::Peer;
use crate::control::{LaneExport, PodExports, RegionExport, RegionKind};
use crate::descriptor::Buffer;
use crate::dma::manager::{Command, DmaStats, PodPort};
use crate::pool::{BufferPool, PoolError, PoolLayout, SlotRef};
use crate::ring::{Ring, ring_len};

use super::{DpuConfig, DpuError};

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
    pub(super) peer: u64,
    /// Its four pools' region ids (recycled when it leaves).
    pub(super) regions: [u16; 4],
    /// Its regions' exports for DMA across PCIe (withdrawn when it leaves).
    pub(super) exports: Vec<crate::dma::export::PciExport>,
    /// Its regions are across PCIe from the shards (`DpuConfig::across_pcie`).
    pub across_pcie: bool,
    /// Across PCIe: where the fabric reaches its RX and TX bodies, the staging
    /// copies of its body pools on this side (`dma::manager::Staging`), which the DMA
    /// manager keeps in step with the host. `None` across PCIe: not reachable (a
    /// pod registered without them).
    pub(super) host_bodies: Option<[Arc<crate::shm::SharedRegion>; 2]>,
    /// Its control connection closed: it is being let go (the shards may still hold
    /// bodies it sent), and its name is free for the process that replaces it.
    pub(super) leaving: bool,
}

impl PodInfo {
    /// Its control connection closed and the node is letting go of it.
    pub fn is_leaving(&self) -> bool {
        self.leaving
    }

    /// The memory the fabric writes the pod's RX bodies into: its pool's region, or
    /// across PCIe its staging copy (`None`: not reachable by the fabric).
    pub fn rx_body_memory(&self) -> Option<&Arc<crate::shm::SharedRegion>> {
        if !self.across_pcie {
            return Some(self.rx_body.region());
        }
        self.host_bodies.as_ref().map(|b| &b[0])
    }

    /// The memory the fabric reads the pod's TX bodies from, as
    /// [`Self::rx_body_memory`].
    pub fn tx_body_memory(&self) -> Option<&Arc<crate::shm::SharedRegion>> {
        if !self.across_pcie {
            return Some(self.tx_body.region());
        }
        self.host_bodies.as_ref().map(|b| &b[1])
    }

    /// Writes `bytes` into RX body slot `slot` (across PCIe, into its staging copy,
    /// which the delivery takes on to the host: the mirror holds no bytes).
    pub fn write_rx_body(&self, slot: SlotRef, bytes: &[u8]) -> Result<Buffer, PoolError> {
        let buffer = self
            .rx_body
            .buffer(slot, u32::try_from(bytes.len()).unwrap_or(u32::MAX))?;
        let memory = self
            .rx_body_memory()
            .ok_or_else(|| unreachable_bodies(self.id))?;
        memory.write(self.rx_body.offset_of(buffer)?, bytes)?;
        Ok(buffer)
    }

    /// Reads a TX body the pod sent (across PCIe, from its staging copy, where the
    /// DMA manager put it at intake).
    pub fn read_tx_body(&self, buffer: Buffer) -> Result<Vec<u8>, PoolError> {
        let memory = self
            .tx_body_memory()
            .ok_or_else(|| unreachable_bodies(self.id))?;
        Ok(memory.read_vec(self.tx_body.offset_of(buffer)?, buffer.len as usize)?)
    }
}

fn unreachable_bodies(pod: u32) -> PoolError {
    PoolError::Layout(format!(
        "pod {pod} is across PCIe and its body pools have no staging copy on this side"
    ))
}

/// What the node keeps of a shard it handed out.
pub(super) struct ShardHandle {
    pub(super) commands: Sender<Command>,
    pub(super) bell: Bell,
    pub(super) dpu_tx_header: BufferPool,
    pub(super) dpu_rx_header: BufferPool,
    pub(super) stats: Arc<DmaStats>,
}

pub(super) struct Shared {
    pub(super) config: DpuConfig,
    pub(super) prefix: String,
    pub(super) next_pod: AtomicU32,
    pub(super) next_region: AtomicU32,
    /// Region ids of pods that left, for reuse.
    pub(super) free_regions: Mutex<Vec<u16>>,
    /// Registrations run one at a time, so the name and capacity checks hold until
    /// the pod is in the table.
    pub(super) registering: Mutex<()>,
    pub(super) pods: Mutex<HashMap<u32, PodInfo>>,
    pub(super) shards: Vec<ShardHandle>,
}

/// A region's name as exports show it: it is passed as a descriptor, so the name is
/// only for messages.
pub(super) fn shown(region: &crate::shm::SharedRegion) -> std::path::PathBuf {
    std::path::PathBuf::from(format!("memfd:{}", region.name()))
}

impl Shared {
    /// A region id: one freed by a departed pod, else a new one.
    pub(super) fn region_id(&self) -> Result<u16, DpuError> {
        if let Some(id) = self.free_regions.lock().pop() {
            return Ok(id);
        }
        let id = self.next_region.fetch_add(1, Ordering::Relaxed);
        u16::try_from(id).map_err(|_| DpuError::Limit("the node ran out of region ids".to_owned()))
    }

    pub(super) fn pool(&self, what: &str, size: u32, count: u32) -> Result<BufferPool, DpuError> {
        Ok(BufferPool::create_sealed(
            &format!("{}-{what}", self.prefix),
            self.region_id()?,
            PoolLayout::new(size, count),
        )?)
    }

    /// Whether pod `name` may come in (with `registering` held, so the answer holds
    /// until it is in the table).
    pub(super) fn admit(&self, name: &str) -> Result<(), DpuError> {
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
        Ok(())
    }

    /// Makes pod `name`'s regions and takes it in: what it maps, and the regions'
    /// descriptors in the order [`PodExports`] gives (the bells' eventfds aside).
    pub(super) fn register(
        &self,
        peer: &Peer,
        name: String,
        service: String,
        pid: u32,
    ) -> Result<(PodExports, Vec<OwnedFd>), DpuError> {
        let _one_at_a_time = self.registering.lock();
        self.admit(&name)?;
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
        let bell = Bell::create_sealed(&format!("{}-{tag}-bell", self.prefix))?;
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
        let mut exports = PodExports {
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
            bell: RegionExport {
                id: 0,
                path: shown(bell.region()),
                len: BELL_LEN as u64,
                kind: RegionKind::Bell,
                hw_export: Vec::new(),
            },
        };
        let hw = self
            .export(
                &mut exports,
                [&tx_header, &tx_body, &rx_header, &rx_body],
                &lanes,
                &bell,
            )
            .inspect_err(|_| {
                // The pools go with this error: their region ids can name others'.
                self.free_regions.lock().extend([
                    tx_header.id(),
                    tx_body.id(),
                    rx_header.id(),
                    rx_body.id(),
                ]);
            })?;
        // What the pod maps, as descriptors: its regions are anonymous (no other pod
        // can open them by a name) and sealed (no one can truncate them).
        let dup = |region: &crate::shm::SharedRegion| {
            rustix::io::fcntl_dupfd_cloexec(region.fd(), 0).map_err(std::io::Error::from)
        };
        let mut fds = Vec::with_capacity(exports.descriptors());
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
        fds.push(dup(bell.region())?);
        fds.push(bell.fd().try_clone_to_owned()?);
        // Every shard's DMA manager knows the pod before the proxy can see it in the
        // table: a proxy that routed to a pod its manager did not know yet had the
        // delivery refused (unknown pod) with the body slot it had reserved in the
        // pod's pool, which the manager could not give back (it has no port for the
        // pod), so the slot leaked. Commands come before descriptors in a pass.
        // The pod sleeps on its first RX lane's futex for all of them, or on its bell
        // (whichever it announced sleeping on: the other costs the push nothing).
        let wake = lanes[0].1.clone();
        let pools = [&tx_header, &tx_body, &rx_header, &rx_body];
        let mirrors = if self.config.across_pcie {
            Some(self.mirror_pools(pools)?)
        } else {
            None
        };
        // Across PCIe the fabric reaches the pod's bodies on this side only.
        let staging = match &mirrors {
            Some((m, _)) => Some(self.staging(id, &m[3], &m[1])?),
            None => None,
        };
        for (k, ((tx, rx), handle)) in lanes.iter().zip(&self.shards).enumerate() {
            let port = match &mirrors {
                None => PodPort {
                    id,
                    tx_header: tx_header.clone(),
                    tx_body: tx_body.clone(),
                    rx_header: rx_header.clone(),
                    rx_body: rx_body.clone(),
                    tx_sq: tx.consumer(),
                    rx_sq: rx
                        .producer()
                        .wakes_through(wake.clone())
                        .with_bell(bell.clone()),
                    lane: k as u8,
                    mirror: None,
                    staging: None,
                },
                Some((mirror, known)) => self.mirrored_port(
                    id,
                    k,
                    pools,
                    (mirror, known),
                    staging.clone().expect("made with the mirrors"),
                    (tx, rx),
                    (&wake, &bell),
                )?,
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
                // Across PCIe the ownership words the proxy would use are the mirrors'.
                rx_body: mirrors.as_ref().map_or(&rx_body, |(m, _)| &m[3]).clone(),
                tx_body: mirrors.as_ref().map_or(&tx_body, |(m, _)| &m[1]).clone(),
                peer: peer.id,
                regions: [tx_header.id(), tx_body.id(), rx_header.id(), rx_body.id()],
                exports: hw,
                across_pcie: self.config.across_pcie,
                host_bodies: staging.map(|s| [s.rx, s.tx]),
                leaving: false,
            },
        );
        Ok((exports, fds))
    }

    /// Mirrors of a pod's four pools (same layout and ids), and the host words each
    /// shard's port agrees on.
    #[allow(clippy::type_complexity)]
    fn mirror_pools(
        &self,
        pools: [&BufferPool; 4],
    ) -> Result<([BufferPool; 4], [Arc<crate::dma::manager::Known>; 4]), DpuError> {
        let mirror = |p: &BufferPool| {
            BufferPool::create_sealed(&format!("{}-mirror", self.prefix), p.id(), p.layout())
        };
        let known = |p: &BufferPool| crate::dma::manager::Known::new(p.layout().slot_count);
        Ok((
            [
                mirror(pools[0])?,
                mirror(pools[1])?,
                mirror(pools[2])?,
                mirror(pools[3])?,
            ],
            [
                known(pools[0]),
                known(pools[1]),
                known(pools[2]),
                known(pools[3]),
            ],
        ))
    }

    /// Lane `k`'s port of a pod across PCIe: mirror rings and pools, the host's
    /// regions as the other side, and how the host wakes the pod (what a host agent
    /// does when the DPU asks).
    #[allow(clippy::too_many_arguments)]
    fn mirrored_port(
        &self,
        id: u32,
        k: usize,
        host_pools: [&BufferPool; 4],
        (mirrors, known): (&[BufferPool; 4], &[Arc<crate::dma::manager::Known>; 4]),
        staging: crate::dma::manager::Staging,
        (tx, rx): (&Ring, &Ring),
        (wake, bell): (&Ring, &Bell),
    ) -> Result<PodPort, DpuError> {
        use crate::dma::manager::MirrorSides;
        use crate::dma::reach::RemoteSide;
        let side = |r: &Arc<crate::shm::SharedRegion>| RemoteSide::Loopback(r.clone());
        let host_wake = parking_lot::Mutex::new(
            rx.producer()
                .wakes_through(wake.clone())
                .with_bell(bell.clone()),
        );
        let sides = MirrorSides {
            pools: host_pools.map(|p| side(p.region())),
            tx_sq: side(tx.region()),
            rx_sq: side(rx.region()),
            bell: side(bell.region()),
            host_wake: Some(Arc::new(move || host_wake.lock().wake())),
        };
        self.lane_port(id, k, (mirrors, known), staging, sides)
    }

    /// The staging copies of a pod's RX and TX body pools across PCIe (regions of
    /// this side's memory with the pools' layout: `dma::manager::Staging`).
    pub(super) fn staging(
        &self,
        id: u32,
        rx: &BufferPool,
        tx: &BufferPool,
    ) -> Result<crate::dma::manager::Staging, DpuError> {
        let region = |pool: &BufferPool, what: &str| {
            crate::shm::SharedRegion::create_sealed(
                &format!("{}-pod{id}-{what}-staging", self.prefix),
                pool.region().len(),
            )
            .map(Arc::new)
        };
        Ok(crate::dma::manager::Staging {
            rx: region(rx, "rx")?,
            tx: region(tx, "tx")?,
        })
    }

    /// Lane `k`'s port of pod `id` across PCIe, over `sides`: mirror rings of the
    /// node's capacity, the pod's mirror pools, and a `MirrorPort` keeping them in step.
    pub(super) fn lane_port(
        &self,
        id: u32,
        k: usize,
        (mirrors, known): (&[BufferPool; 4], &[Arc<crate::dma::manager::Known>; 4]),
        staging: crate::dma::manager::Staging,
        sides: crate::dma::manager::MirrorSides,
    ) -> Result<PodPort, DpuError> {
        let capacity = self.config.pod.ring_capacity;
        let tag = format!("{}-pod{id}-l{k}-mirror", self.prefix);
        let mirror_tx = Ring::create_sealed(&format!("{tag}-txsq"), capacity)?;
        let mirror_rx = Ring::create_sealed(&format!("{tag}-rxsq"), capacity)?;
        let port = crate::dma::manager::MirrorPort::new(sides, mirrors.each_ref(), known.clone())?;
        Ok(PodPort {
            id,
            tx_header: mirrors[0].clone(),
            tx_body: mirrors[1].clone(),
            rx_header: mirrors[2].clone(),
            rx_body: mirrors[3].clone(),
            tx_sq: mirror_tx.consumer(),
            rx_sq: mirror_rx.producer(),
            lane: k as u8,
            mirror: Some(Box::new(port)),
            staging: Some(staging),
        })
    }

    /// With an exporter, exports the pod's pools, rings and bell (the shards' bells
    /// are the node's own, not the pod's) and writes each descriptor into its
    /// `hw_export`; all of them or none (the error names the region that failed).
    fn export(
        &self,
        exports: &mut PodExports,
        pools: [&BufferPool; 4],
        lanes: &[(Ring, Ring)],
        bell: &Bell,
    ) -> Result<Vec<crate::dma::export::PciExport>, DpuError> {
        let Some(exporter) = &self.config.exporter else {
            return Ok(Vec::new());
        };
        let mut regions: Vec<&crate::shm::SharedRegion> =
            pools.iter().map(|p| &**p.region()).collect();
        for (tx, rx) in lanes {
            regions.extend([&**tx.region(), &**rx.region()]);
        }
        regions.push(&**bell.region());
        let done = crate::dma::export::export_all(&mut *exporter.lock(), &regions)?;
        let mut slots: Vec<&mut RegionExport> = vec![
            &mut exports.tx_header,
            &mut exports.tx_body,
            &mut exports.rx_header,
            &mut exports.rx_body,
        ];
        for lane in &mut exports.lanes {
            slots.extend([&mut lane.tx_sq, &mut lane.rx_sq]);
        }
        slots.push(&mut exports.bell);
        for (slot, export) in slots.into_iter().zip(&done) {
            slot.hw_export = export.encode();
        }
        Ok(done)
    }

    /// Removes a pod: the manager stops polling it and drops its port (its regions are
    /// unlinked once nothing maps them), and DPU slots held for it are freed.
    pub(super) fn remove(&self, id: u32) -> bool {
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
            if let Some(exporter) = &self.config.exporter {
                let mut exporter = exporter.lock();
                for export in &info.exports {
                    exporter.unexport(export);
                }
            }
        }
        tracing::info!(pod = id, %name, "pod removed");
        true
    }
}

//! Pods a host agent registers (the BlueField split, docs/data-path.md layer 3): the
//! agent made their regions in host memory and the node reaches them only through its
//! engine, across PCIe: on a BlueField by their exports (`hw_export`,
//! `doca_mmap_create_from_export`), in software by the regions themselves passed as
//! descriptors (the engine `Loopback`). The agent is on the host, the less trusted
//! side: every region is checked against the node's [`PodShape`] before a shard
//! touches it.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use crate::bell::BELL_LEN;
use crate::control::transport::Peer;
use crate::control::{AgentRegions, PodShape, RegionExport, RegionKind, Response};
use crate::dma::export::PciExport;
use crate::dma::manager::{Command, Known, MirrorSides, PodPort};
use crate::dma::reach::RemoteSide;
use crate::pool::{BufferPool, PoolLayout};
use crate::ring::ring_len;
use crate::shm::SharedRegion;

use super::DpuError;
use super::registry::{PodInfo, Shared};

/// What an agent's pod was registered with, checked.
pub(super) struct Adoption {
    pub(super) name: String,
    pub(super) service: String,
    pub(super) pid: u32,
    pub(super) regions: AgentRegions,
}

fn refused(why: String) -> DpuError {
    DpuError::Adopt(why)
}

impl Shared {
    /// How this node lays out a pod.
    pub(super) fn shape(&self) -> PodShape {
        let s = self.config.pod;
        PodShape {
            lanes: self.shards.len() as u32,
            header_slot: s.header_slot,
            header_slots: s.header_slots,
            body_slot: s.body_slot,
            body_slots: s.body_slots,
            ring_capacity: s.ring_capacity,
        }
    }

    /// Takes in a pod whose regions a host agent made: checks them, gives its pools
    /// region ids, and gives every shard a mirrored port onto them. Wake-ups go to
    /// the agent (`Response::Wake` on its connection), which rings the pod's bell.
    pub(super) fn adopt(
        &self,
        peer: &Peer,
        pod: Adoption,
        fds: Vec<OwnedFd>,
    ) -> Result<(u32, [u16; 4]), DpuError> {
        if !self.config.across_pcie {
            return Err(refused(
                "this node maps its pods' memory itself and takes no host agent's pods (start it with the data path that reaches across PCIe)".to_owned(),
            ));
        }
        let sides = self.sides(&pod.regions, fds)?;
        let _one_at_a_time = self.registering.lock();
        self.admit(&pod.name)?;
        let id = self
            .next_pod
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let layouts = self.pool_layouts();
        let mut ids = [0u16; 4];
        for slot in &mut ids {
            match self.region_id() {
                Ok(region) => *slot = region,
                Err(e) => {
                    self.free_regions
                        .lock()
                        .extend(ids.iter().copied().filter(|&r| r != 0));
                    return Err(e);
                }
            }
        }
        let built = self.adopted_ports(id, &ids, &layouts, &sides, peer);
        let (mirrors, staging, ports) = match built {
            Ok(done) => done,
            Err(e) => {
                self.free_regions.lock().extend(ids);
                return Err(e);
            }
        };
        for (port, handle) in ports.into_iter().zip(&self.shards) {
            let _ = handle.commands.send(Command::AddPod(Box::new(port)));
            handle.bell.ring();
        }
        self.pods.lock().insert(
            id,
            PodInfo {
                id,
                name: pod.name,
                service: pod.service,
                pid: pod.pid,
                rx_body: mirrors[3].clone(),
                tx_body: mirrors[1].clone(),
                peer: peer.id,
                regions: ids,
                exports: Vec::new(),
                across_pcie: true,
                // The fabric reaches its bodies in their staging copies here (the
                // DPU's RDMA device does not reach the host's memory through them).
                host_bodies: Some([staging.rx, staging.tx]),
                leaving: false,
            },
        );
        Ok((id, ids))
    }

    /// The four pools' layouts: TX header, TX body, RX header, RX body.
    fn pool_layouts(&self) -> [PoolLayout; 4] {
        let s = self.config.pod;
        let header = PoolLayout::new(s.header_slot, s.header_slots);
        let body = PoolLayout::new(s.body_slot, s.body_slots);
        [header, body, header, body]
    }

    /// Each region checked against the shape, as the engine will take it: the
    /// region itself (software, its descriptor) or its PCI export.
    fn sides(&self, regions: &AgentRegions, fds: Vec<OwnedFd>) -> Result<Sides, DpuError> {
        let shape = self.shape();
        if regions.lanes.len() != self.shards.len() {
            return Err(refused(format!(
                "the agent laid out {} lanes; this node has {} shards",
                regions.lanes.len(),
                self.shards.len()
            )));
        }
        let layouts = self.pool_layouts();
        let mut expected: Vec<(&RegionExport, RegionKind, u64)> = Vec::new();
        for (export, layout) in regions.pools.iter().zip(layouts) {
            expected.push((
                export,
                RegionKind::Pool {
                    slot_size: layout.slot_size,
                    slot_count: layout.slot_count,
                },
                layout.region_len(),
            ));
        }
        let ring = RegionKind::Ring {
            capacity: shape.ring_capacity,
        };
        let ring_bytes = ring_len(shape.ring_capacity) as u64;
        for (tx, rx) in &regions.lanes {
            expected.push((tx, ring, ring_bytes));
            expected.push((rx, ring, ring_bytes));
        }
        expected.push((&regions.bell, RegionKind::Bell, BELL_LEN as u64));
        for (export, kind, len) in &expected {
            if export.kind != *kind || export.len < *len {
                return Err(refused(format!(
                    "region {} is {:?} of {} bytes; this node's pods have {kind:?} of at least {len} bytes",
                    export.path.display(),
                    export.kind,
                    export.len
                )));
            }
        }
        let side = |i: usize, side: RemoteSide| (i, side);
        let mut out = Vec::with_capacity(expected.len());
        if fds.is_empty() {
            // Across PCIe: each region's export, every length checked on decoding.
            for (i, (export, _, len)) in expected.iter().enumerate() {
                if export.hw_export.is_empty() {
                    return Err(refused(format!(
                        "region {} came with neither its memory nor a PCI export",
                        export.path.display()
                    )));
                }
                let pci = PciExport::decode(&export.hw_export, *len)
                    .map_err(|e| refused(format!("region {}: {e}", export.path.display())))?;
                out.push(side(i, RemoteSide::Pci(pci)));
            }
        } else {
            if fds.len() != expected.len() {
                return Err(refused(format!(
                    "{} region descriptors came for {} regions",
                    fds.len(),
                    expected.len()
                )));
            }
            for (i, ((export, _, len), fd)) in expected.iter().zip(fds).enumerate() {
                let name = export.path.display().to_string();
                // Sealed against shrinking (checked here), so the length holds.
                let region = SharedRegion::from_fd(fd, &name)?;
                if (region.len() as u64) < *len {
                    return Err(refused(format!(
                        "region {name} has {} bytes; it needs {len}",
                        region.len()
                    )));
                }
                out.push(side(i, RemoteSide::Loopback(Arc::new(region))));
            }
        }
        let mut sides = out.into_iter().map(|(_, s)| s);
        let mut next = || sides.next().expect("one side per expected region");
        let pools = [next(), next(), next(), next()];
        let lanes = (0..regions.lanes.len()).map(|_| (next(), next())).collect();
        let bell = next();
        Ok(Sides { pools, lanes, bell })
    }

    /// The mirrors of the pod's pools and each shard's port onto its regions.
    fn adopted_ports(
        &self,
        id: u32,
        ids: &[u16; 4],
        layouts: &[PoolLayout; 4],
        sides: &Sides,
        peer: &Peer,
    ) -> Result<([BufferPool; 4], crate::dma::manager::Staging, Vec<PodPort>), DpuError> {
        let mirror = |k: usize| {
            BufferPool::create_sealed(&format!("{}-mirror", self.prefix), ids[k], layouts[k])
        };
        let mirrors = [mirror(0)?, mirror(1)?, mirror(2)?, mirror(3)?];
        let known = layouts.map(|l| Known::new(l.slot_count));
        let staging = self.staging(id, &mirrors[3], &mirrors[1])?;
        // The DPU cannot write a host eventfd: the agent rings the pod's bell when
        // told. One frame per batch delivered to a pod that sleeps.
        let push = peer.push.clone();
        let wake: Arc<dyn Fn() + Send + Sync> = Arc::new(move || {
            push.push(Response::Wake { pod: id });
        });
        let mut ports = Vec::with_capacity(sides.lanes.len());
        for (k, (tx, rx)) in sides.lanes.iter().enumerate() {
            let port_sides = MirrorSides {
                pools: sides.pools.clone(),
                tx_sq: tx.clone(),
                rx_sq: rx.clone(),
                bell: sides.bell.clone(),
                host_wake: Some(wake.clone()),
            };
            ports.push(self.lane_port(id, k, (&mirrors, &known), staging.clone(), port_sides)?);
        }
        Ok((mirrors, staging, ports))
    }
}

/// A pod's regions as the engine takes them.
struct Sides {
    pools: [RemoteSide; 4],
    lanes: Vec<(RemoteSide, RemoteSide)>,
    bell: RemoteSide,
}

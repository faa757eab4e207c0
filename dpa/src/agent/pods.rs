//! A pod's regions as the host agent makes them: laid out as the DPU's shape says,
//! exported (or passed as descriptors), registered with the DPU, and what the pod
//! maps handed back in the order the host library reads.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::bell::{BELL_LEN, Bell};
use crate::control::{
    AgentRegions, ControlError, ErrorCode, LaneExport, PodExports, RegionExport, RegionKind,
    Request, Response,
};
use crate::dma::export::{PciExport, export_all};
use crate::pool::{BufferPool, PoolLayout};
use crate::ring::{Producer, Ring, ring_len};
use crate::shm::SharedRegion;

use super::{State, dup};

/// A pod the agent registered.
pub(super) struct AgentPod {
    /// Its id at the DPU.
    pub(super) id: u32,
    /// Wakes it (its first RX lane's futex and its bell) when the DPU asks.
    pub(super) waker: Arc<Mutex<Producer>>,
    /// Its regions' exports, withdrawn when it leaves.
    exports: Vec<PciExport>,
}

fn internal(e: impl std::fmt::Display) -> Response {
    Response::Error {
        code: ErrorCode::Internal,
        message: format!("the host agent could not lay out the pod: {e}"),
    }
}

fn export(path: &str, len: u64, kind: RegionKind) -> RegionExport {
    RegionExport {
        id: 0,
        path: PathBuf::from(format!("memfd:{path}")),
        len,
        kind,
        hw_export: Vec::new(),
    }
}

/// Registers pod `name`: makes its regions, has the DPU adopt them, lays its pools out
/// with the region ids the DPU gave, and returns what the pod maps. A refusal is the
/// answer the pod gets (the DPU's, when it refused).
pub(super) fn register(
    state: &State,
    name: &str,
    service: &str,
    pid: u32,
    token: Option<String>,
) -> Result<(AgentPod, PodExports, Vec<OwnedFd>), Response> {
    let shape = state.shape;
    let tag = format!("dpumesh-{}-pid{pid}", state.name);
    let header = PoolLayout::new(shape.header_slot, shape.header_slots);
    let body = PoolLayout::new(shape.body_slot, shape.body_slots);
    let layouts = [header, body, header, body];
    let mut pools = Vec::with_capacity(4);
    for (what, layout) in ["txh", "txb", "rxh", "rxb"].iter().zip(layouts) {
        let region =
            SharedRegion::create_sealed(&format!("{tag}-{what}"), layout.region_len() as usize)
                .map_err(internal)?;
        pools.push(Arc::new(region));
    }
    let mut lanes = Vec::with_capacity(shape.lanes as usize);
    for k in 0..shape.lanes {
        let tx = Ring::create_sealed(&format!("{tag}-l{k}-txsq"), shape.ring_capacity)
            .map_err(internal)?;
        let rx = Ring::create_sealed(&format!("{tag}-l{k}-rxsq"), shape.ring_capacity)
            .map_err(internal)?;
        lanes.push((tx, rx));
    }
    let bell = Bell::create_sealed(&format!("{tag}-bell")).map_err(internal)?;

    let pool_export = |k: usize| {
        export(
            pools[k].name(),
            pools[k].len() as u64,
            RegionKind::Pool {
                slot_size: layouts[k].slot_size,
                slot_count: layouts[k].slot_count,
            },
        )
    };
    let ring_export = |r: &Ring| {
        export(
            r.region().name(),
            ring_len(r.capacity()) as u64,
            RegionKind::Ring {
                capacity: r.capacity(),
            },
        )
    };
    let mut regions = AgentRegions {
        pools: [
            pool_export(0),
            pool_export(1),
            pool_export(2),
            pool_export(3),
        ],
        lanes: lanes
            .iter()
            .map(|(tx, rx)| (ring_export(tx), ring_export(rx)))
            .collect(),
        bell: export(bell.region().name(), BELL_LEN as u64, RegionKind::Bell),
    };
    let mut all: Vec<&SharedRegion> = pools.iter().map(|p| &**p).collect();
    for (tx, rx) in &lanes {
        all.extend([&**tx.region(), &**rx.region()]);
    }
    all.push(&**bell.region());

    // Exported for DMA across PCIe, or (software) passed as they are.
    let (exports, fds): (Vec<PciExport>, Vec<BorrowedFd<'_>>) = match &state.exporter {
        Some(exporter) => {
            let done = export_all(&mut *exporter.lock(), &all).map_err(internal)?;
            let mut slots: Vec<&mut RegionExport> = regions.pools.iter_mut().collect();
            for (tx, rx) in &mut regions.lanes {
                slots.extend([tx, rx]);
            }
            slots.push(&mut regions.bell);
            for (slot, e) in slots.into_iter().zip(&done) {
                slot.hw_export = e.encode();
            }
            (done, Vec::new())
        }
        None if state.link.carries_descriptors() => {
            (Vec::new(), all.iter().map(|r| r.fd()).collect())
        }
        None => {
            return Err(internal(
                "the link to the DPU carries no descriptors and the agent has no exporter",
            ));
        }
    };
    let withdraw = |exports: &[PciExport]| {
        if let Some(exporter) = &state.exporter {
            let mut exporter = exporter.lock();
            for e in exports {
                exporter.unexport(e);
            }
        }
    };
    let adopted = state.link.request(
        Request::AdoptPod {
            name: name.to_owned(),
            service: service.to_owned(),
            pid,
            token,
            regions: Box::new(regions.clone()),
        },
        &fds,
    );
    let (pod_id, ids) = match adopted {
        Ok((Response::PodAdopted { pod_id, pools }, _)) => (pod_id, pools),
        Ok((other, _)) => {
            withdraw(&exports);
            return Err(internal(format!("the DPU answered {other:?}")));
        }
        Err(ControlError::Refused { code, message }) => {
            withdraw(&exports);
            return Err(Response::Error { code, message });
        }
        Err(e) => {
            withdraw(&exports);
            return Err(internal(e));
        }
    };
    // The pools get the region ids the DPU named them by (its descriptors carry
    // them); the DPU reads only their ownership words, which laying out leaves zero.
    let laid = (0..4)
        .map(|k| BufferPool::create(pools[k].clone(), ids[k], layouts[k]))
        .collect::<Result<Vec<_>, _>>();
    let undo = |why: String| {
        let _ = state.link.request(Request::UnregisterPod { pod_id }, &[]);
        withdraw(&exports);
        internal(why)
    };
    if let Err(e) = laid {
        return Err(undo(e.to_string()));
    }
    let mut exports_for_pod = PodExports {
        pod_id,
        tx_header: regions.pools[0].clone(),
        tx_body: regions.pools[1].clone(),
        rx_header: regions.pools[2].clone(),
        rx_body: regions.pools[3].clone(),
        lanes: regions
            .lanes
            .iter()
            .zip(&state.lane_bells)
            .map(|((tx, rx), lane_bell)| LaneExport {
                tx_sq: tx.clone(),
                rx_sq: rx.clone(),
                bell: export(lane_bell.region().name(), BELL_LEN as u64, RegionKind::Bell),
            })
            .collect(),
        bell: regions.bell.clone(),
    };
    for (export, id) in [
        &mut exports_for_pod.tx_header,
        &mut exports_for_pod.tx_body,
        &mut exports_for_pod.rx_header,
        &mut exports_for_pod.rx_body,
    ]
    .into_iter()
    .zip(ids)
    {
        export.id = id;
    }
    // What the pod maps, in the order the host library reads: each lane bell's
    // eventfd, then its region, the four pools, each lane's TX and RX SQ, the pod's
    // bell region and its eventfd.
    let handed = (|| -> std::io::Result<Vec<OwnedFd>> {
        let mut out = Vec::with_capacity(exports_for_pod.descriptors());
        for b in &state.lane_bells {
            out.push(dup(b.fd())?);
        }
        for b in &state.lane_bells {
            out.push(dup(b.region().fd())?);
        }
        for p in &pools {
            out.push(dup(p.fd())?);
        }
        for (tx, rx) in &lanes {
            out.push(dup(tx.region().fd())?);
            out.push(dup(rx.region().fd())?);
        }
        out.push(dup(bell.region().fd())?);
        out.push(dup(bell.fd().as_fd())?);
        Ok(out)
    })();
    let handed = match handed {
        Ok(fds) => fds,
        Err(e) => return Err(undo(e.to_string())),
    };
    let waker = lanes[0]
        .1
        .producer()
        .wakes_through(lanes[0].1.clone())
        .with_bell(bell.clone());
    Ok((
        AgentPod {
            id: pod_id,
            waker: Arc::new(Mutex::new(waker)),
            exports,
        },
        exports_for_pod,
        handed,
    ))
}

/// A pod that left: its exports withdrawn (the DPU let go of it first).
pub(super) fn withdraw(state: &State, pod: AgentPod) {
    if let Some(exporter) = &state.exporter {
        let mut exporter = exporter.lock();
        for e in &pod.exports {
            exporter.unexport(e);
        }
    }
}

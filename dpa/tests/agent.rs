//! The host agent's boundary with the DPU (docs/data-path.md, layer 3): the DPU
//! believes nothing of an agent's pod it has not checked (shape, sizes, seals, how
//! many regions came), and an agent that exports its pods' regions (a fake exporter
//! at the `RegionExporter` seam; DOCA's needs a BlueField) withdraws every export when
//! the pod leaves. The data path through an agent runs in `cases.rs`
//! (`through_a_host_agent_…`), with the agent as its own process.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use dpumesh_dpa::agent::{AgentConfig, HostAgent, PushSink};
use dpumesh_dpa::control::transport::{ControlClient, Endpoint, MuxClient};
use dpumesh_dpa::control::{
    AgentRegions, ControlError, ErrorCode, PodShape, RegionExport, RegionKind, Request, Response,
    Role,
};
use dpumesh_dpa::dma::DmaError;
use dpumesh_dpa::dma::export::{PciExport, RegionExporter};
use dpumesh_dpa::shm::SharedRegion;
use dpumesh_dpa::{Dpu, DpuConfig, HostPort, PoolLayout};
use parking_lot::Mutex;

fn node(dir: &std::path::Path, across_pcie: bool) -> Dpu {
    let mut config = DpuConfig::new("n1");
    config.pod.body_slots = 4;
    config.pod.body_slot = 64 << 10;
    config.across_pcie = across_pcie;
    Dpu::start(config, &Endpoint::Unix(dir.join("node.sock"))).unwrap()
}

fn link(dir: &std::path::Path) -> MuxClient {
    MuxClient::connect(&dir.join("node.sock"), "host-0", |_| {}).unwrap()
}

fn shape(link: &MuxClient) -> PodShape {
    match link.request(Request::PodShape).unwrap() {
        Response::PodShape(shape) => shape,
        other => panic!("{other:?}"),
    }
}

/// A pod's regions made as an agent makes them (sealed memfds of the shape's sizes).
fn regions(shape: &PodShape) -> (AgentRegions, Vec<SharedRegion>) {
    let header = PoolLayout::new(shape.header_slot, shape.header_slots);
    let body = PoolLayout::new(shape.body_slot, shape.body_slots);
    let mut made = Vec::new();
    let mut export = |name: &str, len: u64, kind: RegionKind| {
        made.push(SharedRegion::create_sealed(name, len as usize).unwrap());
        RegionExport {
            id: 0,
            path: PathBuf::from(format!("memfd:{name}")),
            len,
            kind,
            hw_export: Vec::new(),
        }
    };
    let pool = |l: PoolLayout| RegionKind::Pool {
        slot_size: l.slot_size,
        slot_count: l.slot_count,
    };
    let pools = [
        export("t-txh", header.region_len(), pool(header)),
        export("t-txb", body.region_len(), pool(body)),
        export("t-rxh", header.region_len(), pool(header)),
        export("t-rxb", body.region_len(), pool(body)),
    ];
    let ring = RegionKind::Ring {
        capacity: shape.ring_capacity,
    };
    let ring_len = dpumesh_dpa::ring::ring_len(shape.ring_capacity) as u64;
    let lanes = (0..shape.lanes)
        .map(|_| {
            (
                export("t-tx", ring_len, ring),
                export("t-rx", ring_len, ring),
            )
        })
        .collect();
    let bell = export(
        "t-bell",
        dpumesh_dpa::bell::BELL_LEN as u64,
        RegionKind::Bell,
    );
    (AgentRegions { pools, lanes, bell }, made)
}

fn adopt(
    link: &MuxClient,
    regions: AgentRegions,
    fds: &[std::os::fd::BorrowedFd<'_>],
) -> Result<Response, ControlError> {
    link.request_with_fds(
        Request::AdoptPod {
            name: "p".into(),
            service: "svc".into(),
            pid: 1,
            token: None,
            regions: Box::new(regions),
        },
        fds,
    )
    .map(|(r, _)| r)
}

fn refused(result: Result<Response, ControlError>) -> String {
    match result {
        Err(ControlError::Refused {
            code: ErrorCode::BadRequest,
            message,
        }) => message,
        other => panic!("expected a BadRequest refusal, got {other:?}"),
    }
}

#[test]
fn the_dpu_adopts_only_regions_that_match_its_shape_and_came_whole() {
    let dir = tempfile::tempdir().unwrap();
    let node = node(dir.path(), true);
    let link = link(dir.path());
    let shape = shape(&link);
    assert_eq!(shape.lanes, 1);
    assert_eq!(shape.body_slot, 64 << 10);

    // Whole and matching: adopted, with four region ids for the pools.
    let (good, made) = regions(&shape);
    let fds: Vec<_> = made.iter().map(|r| r.fd()).collect();
    match adopt(&link, good.clone(), &fds).unwrap() {
        Response::PodAdopted { pod_id, pools } => {
            assert!(pod_id > 0);
            assert!(pools.iter().all(|&id| id > 0));
            assert_eq!(node.pods().len(), 1);
        }
        other => panic!("{other:?}"),
    }

    // A body pool that claims its size but whose memory is a page short.
    let (mut short, mut made) = regions(&shape);
    made[1] = SharedRegion::create_sealed("t-short", short.pools[1].len as usize - 4096).unwrap();
    let fds: Vec<_> = made.iter().map(|r| r.fd()).collect();
    let why = refused(adopt(&link, short.clone(), &fds));
    assert!(why.contains("t-txb") && why.contains("it needs"), "{why}");

    // A pool laid out with other slots than the node's.
    short.pools[1].kind = RegionKind::Pool {
        slot_size: 1 << 30,
        slot_count: 1,
    };
    let why = refused(adopt(&link, short, &fds));
    assert!(why.contains("t-txb"), "{why}");

    // Lanes for shards the node does not have.
    let (mut lanes, made) = regions(&shape);
    lanes.lanes.push(lanes.lanes[0].clone());
    let fds: Vec<_> = made.iter().map(|r| r.fd()).collect();
    let why = refused(adopt(&link, lanes, &fds));
    assert!(why.contains("2 lanes") && why.contains("1 shards"), "{why}");

    // One descriptor missing.
    let (good, made) = regions(&shape);
    let fds: Vec<_> = made.iter().skip(1).map(|r| r.fd()).collect();
    let why = refused(adopt(&link, good, &fds));
    assert!(why.contains("6 region descriptors came for 7"), "{why}");

    // A region that is not sealed (its owner could shrink it under the DPU).
    let (good, mut made) = regions(&shape);
    let open = SharedRegion::create_unique("dpumesh-test-unsealed", 8).unwrap();
    made[6] = open;
    let fds: Vec<_> = made.iter().map(|r| r.fd()).collect();
    let why = refused(adopt(&link, good, &fds));
    assert!(why.contains("seal"), "{why}");

    // Neither the memory nor an export.
    let (good, _) = regions(&shape);
    let why = refused(adopt(&link, good, &[]));
    assert!(why.contains("neither its memory nor a PCI export"), "{why}");

    // An export whose length disagrees with the region it names.
    let (mut lying, _) = regions(&shape);
    let pci = |len: u64| PciExport {
        addr: 4096,
        len,
        descriptor: b"d".to_vec(),
    };
    for e in lying.pools.iter_mut() {
        e.hw_export = pci(e.len).encode();
    }
    for (tx, rx) in lying.lanes.iter_mut() {
        tx.hw_export = pci(tx.len).encode();
        rx.hw_export = pci(rx.len).encode();
    }
    lying.bell.hw_export = pci(lying.bell.len).encode();
    lying.pools[3].hw_export = pci(16).encode();
    let why = refused(adopt(&link, lying, &[]));
    assert!(why.contains("t-rxb"), "{why}");

    // Nothing refused was taken in; the node still serves.
    assert_eq!(node.pods().len(), 1);
    assert!(matches!(link.request(Request::Ping), Ok(Response::Pong)));
}

#[test]
fn an_agents_pod_needs_its_services_token_as_a_registration_does() {
    let dir = tempfile::tempdir().unwrap();
    let key = dpumesh_identity::registration::RegistrationKey::load_or_create(dir.path()).unwrap();
    let mut config = DpuConfig::new("n1");
    config.pod.body_slots = 4;
    config.pod.body_slot = 64 << 10;
    config.across_pcie = true;
    config.registration = Some(key.clone());
    let _node = Dpu::start(config, &Endpoint::Unix(dir.path().join("node.sock"))).unwrap();
    let link = link(dir.path());
    let (good, made) = regions(&shape(&link));
    let fds: Vec<_> = made.iter().map(|r| r.fd()).collect();
    let ask = |token: Option<String>| {
        link.request_with_fds(
            Request::AdoptPod {
                name: "p".into(),
                service: "svc".into(),
                pid: 1,
                token,
                regions: Box::new(good.clone()),
            },
            &fds,
        )
    };
    for token in [None, Some(key.token("other"))] {
        match ask(token) {
            Err(ControlError::Refused {
                code: ErrorCode::Unauthorized,
                ..
            }) => {}
            other => panic!("adopted without svc's token: {other:?}"),
        }
    }
    assert!(matches!(
        ask(Some(key.token("svc"))),
        Ok((Response::PodAdopted { .. }, _))
    ));
}

#[test]
fn a_node_that_maps_its_pods_itself_adopts_none() {
    let dir = tempfile::tempdir().unwrap();
    let _node = node(dir.path(), false);
    let link = link(dir.path());
    let (good, made) = regions(&shape(&link));
    let fds: Vec<_> = made.iter().map(|r| r.fd()).collect();
    let why = refused(adopt(&link, good, &fds));
    assert!(why.contains("takes no host agent's pods"), "{why}");
}

#[test]
fn pods_cannot_speak_the_agents_part_to_the_agent() {
    let dir = tempfile::tempdir().unwrap();
    let node = node(dir.path(), true);
    let sink = PushSink::default();
    let agent = HostAgent::start(
        AgentConfig {
            name: "host-0".into(),
            listen: dir.path().join("agent.sock"),
            exporter: None,
        },
        Arc::new(link(dir.path())),
        &sink,
        node.name().to_owned(),
    )
    .unwrap();
    let mut pod = ControlClient::connect(
        &Endpoint::Unix(dir.path().join("agent.sock")),
        Role::Host,
        "rogue",
    )
    .unwrap();
    for request in [Request::PodShape, Request::UnregisterPod { pod_id: 1 }] {
        let answer = pod.request(request.clone());
        assert!(
            matches!(answer, Err(ControlError::Refused { .. })),
            "{request:?} answered {answer:?}"
        );
    }
    // What anyone may ask is relayed.
    assert!(matches!(pod.request(Request::Ping), Ok(Response::Pong)));
    assert_eq!(agent.pods(), 0);
}

/// Exports by recording what is live.
#[derive(Debug, Default)]
struct Fake {
    live: Vec<PciExport>,
}

impl RegionExporter for Fake {
    fn name(&self) -> &'static str {
        "fake"
    }
    fn export(&mut self, region: &SharedRegion) -> Result<PciExport, DmaError> {
        let export = PciExport {
            addr: region.base_addr(),
            len: region.len() as u64,
            descriptor: format!("export of {}", region.name()).into_bytes(),
        };
        self.live.push(export.clone());
        Ok(export)
    }
    fn unexport(&mut self, export: &PciExport) {
        self.live.retain(|e| e != export);
    }
}

#[test]
fn an_agent_with_an_exporter_sends_exports_not_memory_and_withdraws_them_when_the_pod_leaves() {
    let dir = tempfile::tempdir().unwrap();
    let node = node(dir.path(), true);
    // The shard runs (it takes and lets go of pods) until the test ends.
    let mut shard = node.take_shards().remove(0);
    let stop = Arc::new(AtomicBool::new(false));
    let runner = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let _ = shard.recv(Duration::from_millis(5));
            }
        })
    };
    let fake = Arc::new(Mutex::new(Fake::default()));
    let sink = PushSink::default();
    let agent = HostAgent::start(
        AgentConfig {
            name: "host-0".into(),
            listen: dir.path().join("agent.sock"),
            exporter: Some(fake.clone()),
        },
        Arc::new(link(dir.path())),
        &sink,
        node.name().to_owned(),
    )
    .unwrap();
    let pod =
        HostPort::connect(&Endpoint::Unix(dir.path().join("agent.sock")), "p", "svc").unwrap();
    // Four pools, one lane's two rings, the bell: exported, and the pod got them.
    assert_eq!(fake.lock().live.len(), 7);
    assert_eq!(agent.pods(), 1);
    let listed = node.pods();
    assert_eq!(listed.len(), 1);
    assert!(listed[0].across_pcie);
    drop(pod);
    let deadline = Instant::now() + Duration::from_secs(15);
    while (agent.pods() > 0 || !fake.lock().live.is_empty()) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(agent.pods(), 0);
    assert!(fake.lock().live.is_empty(), "every export withdrawn");
    assert!(node.pods().is_empty(), "the DPU let go of the pod first");
    stop.store(true, Ordering::Relaxed);
    runner.join().unwrap();
}

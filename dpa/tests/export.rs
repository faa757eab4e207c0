//! The host side's export path (docs/data-path.md, "On a BlueField", layer 1): a node
//! with an exporter exports each registering pod's pools, rings and bell for a DMA
//! engine across PCIe, hands the descriptors to the pod in its `hw_export`s, withdraws
//! them when the pod leaves, and registers no pod whose regions could not all be
//! exported. The exporter is a fake at the `RegionExporter` seam (DOCA's needs a
//! BlueField).

use std::sync::Arc;
use std::time::{Duration, Instant};

use dpumesh_dpa::control::transport::Endpoint;
use dpumesh_dpa::dma::DmaError;
use dpumesh_dpa::dma::export::{PciExport, RegionExporter};
use dpumesh_dpa::shm::SharedRegion;
use dpumesh_dpa::{Dpu, DpuConfig, HostPort};
use parking_lot::Mutex;

/// Exports by recording what is live; fails every export once `fail` is set.
#[derive(Debug, Default)]
struct Fake {
    live: Vec<PciExport>,
    fail: bool,
}

impl RegionExporter for Fake {
    fn name(&self) -> &'static str {
        "fake"
    }
    fn export(&mut self, region: &SharedRegion) -> Result<PciExport, DmaError> {
        if self.fail && !self.live.is_empty() {
            return Err(DmaError::Engine {
                engine: "fake",
                detail: "no more memory keys".into(),
            });
        }
        let export = PciExport {
            addr: region.base_addr(),
            len: region.len() as u64,
            descriptor: format!("export of {}", region.name()).into_bytes(),
        };
        self.live.push(export.clone());
        Ok(export)
    }
    fn unexport(&mut self, export: &PciExport) {
        let before = self.live.len();
        self.live.retain(|e| e != export);
        assert_eq!(self.live.len() + 1, before, "unexported once: {export:?}");
    }
}

fn node(dir: &std::path::Path, fake: &Arc<Mutex<Fake>>, shards: usize) -> Dpu {
    let mut config = DpuConfig::new(format!("export-{}", std::process::id()));
    config.pod.body_slots = 8;
    config.shards = shards;
    config.exporter = Some(fake.clone() as Arc<Mutex<dyn RegionExporter>>);
    Dpu::start(config, &Endpoint::Unix(dir.join("control.sock"))).unwrap()
}

/// A port's four pool region ids, sorted.
fn pool_ids(port: &HostPort) -> Vec<u16> {
    let e = port.exports();
    let mut ids = vec![e.tx_header.id, e.tx_body.id, e.rx_header.id, e.rx_body.id];
    ids.sort();
    ids
}

fn eventually(what: &str, check: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !check() {
        assert!(Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_pods_regions_are_exported_while_it_is_registered() {
    let dir = tempfile::tempdir().unwrap();
    let fake = Arc::new(Mutex::new(Fake::default()));
    let node = node(dir.path(), &fake, 2);
    let endpoint = Endpoint::Unix(dir.path().join("control.sock"));
    let port = HostPort::connect(&endpoint, "exported-0", "svc").unwrap();
    let exports = port.exports();
    // Four pools, a TX and an RX ring per lane (two shards), the pod's bell.
    let mut carried = vec![
        &exports.tx_header,
        &exports.tx_body,
        &exports.rx_header,
        &exports.rx_body,
    ];
    for lane in &exports.lanes {
        carried.extend([&lane.tx_sq, &lane.rx_sq]);
        // The shard's bell is the node's own, not the pod's: not exported per pod.
        assert!(lane.bell.hw_export.is_empty());
    }
    carried.push(&exports.bell);
    assert_eq!(carried.len(), 4 + 2 * 2 + 1);
    let decoded: Vec<PciExport> = carried
        .iter()
        .map(|r| PciExport::decode(&r.hw_export, r.len).unwrap())
        .collect();
    assert_eq!(
        decoded,
        fake.lock().live,
        "what the pod was told is what is exported"
    );
    let mut ranges: Vec<(u64, u64)> = decoded.iter().map(|e| (e.addr, e.len)).collect();
    ranges.sort();
    assert!(
        ranges.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0),
        "distinct regions: {ranges:?}"
    );
    // The pod leaves: its exports are withdrawn with it.
    drop(port);
    eventually("the pod's exports withdrawn", || {
        fake.lock().live.is_empty()
    });
    eventually("the pod gone", || node.pods().is_empty());
}

#[test]
fn a_pod_whose_regions_cannot_all_be_exported_is_not_registered() {
    let dir = tempfile::tempdir().unwrap();
    let fake = Arc::new(Mutex::new(Fake {
        fail: true,
        ..Fake::default()
    }));
    let dpu = node(dir.path(), &fake, 1);
    let endpoint = Endpoint::Unix(dir.path().join("control.sock"));
    let e = HostPort::connect(&endpoint, "unexported-0", "svc").unwrap_err();
    assert!(e.to_string().contains("no more memory keys"), "{e}");
    assert!(
        fake.lock().live.is_empty(),
        "the region exported first was withdrawn"
    );
    assert!(dpu.pods().is_empty());
    // The failed pod's region ids name the next pod's pools, as on a node that
    // never failed.
    fake.lock().fail = false;
    let port = HostPort::connect(&endpoint, "exported-1", "svc").unwrap();
    let fresh = tempfile::tempdir().unwrap();
    let _fresh_node = node(fresh.path(), &Arc::new(Mutex::new(Fake::default())), 1);
    let first = HostPort::connect(
        &Endpoint::Unix(fresh.path().join("control.sock")),
        "p-0",
        "svc",
    )
    .unwrap();
    assert_eq!(pool_ids(&port), pool_ids(&first));
    drop((port, first));
    // The software path (no exporter) carries no hardware exports.
    let plain = tempfile::tempdir().unwrap();
    let mut config = DpuConfig::new(format!("plain-{}", std::process::id()));
    config.pod.body_slots = 8;
    let _node = Dpu::start(config, &Endpoint::Unix(plain.path().join("control.sock"))).unwrap();
    let port = HostPort::connect(
        &Endpoint::Unix(plain.path().join("control.sock")),
        "p-0",
        "svc",
    )
    .unwrap();
    assert!(port.exports().tx_header.hw_export.is_empty());
}

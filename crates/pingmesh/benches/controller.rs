//! The controller at scale (issue 20's goal): 10 000 simulated RNICs (100 ToRs × 100
//! hosts) registered, then per-request latency of a registration refresh, a
//! ToR-mesh pinglist and an inter-ToR pinglist, on the SQLite registry (the default,
//! a file) and the in-memory one; the registry's memory is printed once per store.
//!
//! `cargo bench -p dpumesh-pingmesh --bench controller`

use std::hint::black_box;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use dpumesh_clock::ManualClock;
use dpumesh_dpa::fabric::ud::Gid;
use dpumesh_pingmesh::controller::Controller;
use dpumesh_pingmesh::pinglist::{ListKind, PinglistPolicy};
use dpumesh_pingmesh::proto;
use dpumesh_pingmesh::registry::RnicStore;
use dpumesh_pingmesh::registry::memory::MemoryStore;
use dpumesh_pingmesh::registry::sqlite::SqliteStore;

const TORS: u32 = 100;
const PER_TOR: u32 = 100;

fn info(tor: u32, host: u32) -> proto::RnicInfo {
    let ip: IpAddr = format!("10.{}.{}.{}", tor / 250, tor % 250, host + 1)
        .parse()
        .unwrap();
    proto::RnicInfo {
        gid: Gid::from_ip(ip).to_string(),
        qpn: 1000 + host,
        qkey: 1,
        agent_id: format!("node-{tor}-{host}"),
        agent_ip: ip.to_string(),
        rnic_ip: ip.to_string(),
        tor_id: format!("tor-{tor}"),
        udp_port: 4791,
        last_updated_ms: 0,
    }
}

fn register(c: &Controller, i: &proto::RnicInfo) {
    c.register(&proto::AgentRegistrationRequest {
        agent_id: i.agent_id.clone(),
        rnics: vec![i.clone()],
    })
    .unwrap();
}

/// Resident memory of this process, bytes.
fn rss() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split(' ')
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

fn bench(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    // Memory first: its RSS growth is measured before SQLite's pages are in.
    let stores: Vec<(&str, Arc<dyn RnicStore>)> = vec![
        ("memory", Arc::new(MemoryStore::new())),
        (
            "sqlite",
            Arc::new(SqliteStore::open(&dir.path().join("registry.db")).unwrap()),
        ),
    ];
    let mut group = c.benchmark_group("controller_10k_rnics");
    group.measurement_time(Duration::from_secs(5));
    for (name, store) in stores {
        let clock = ManualClock::at_unix_secs(1_700_000_000);
        let controller = Controller::new(
            store.clone(),
            clock.clone(),
            PinglistPolicy::default(),
            Duration::from_secs(3600),
        );
        let before = rss();
        let started = std::time::Instant::now();
        for tor in 0..TORS {
            for host in 0..PER_TOR {
                register(&controller, &info(tor, host));
            }
        }
        let took = started.elapsed();
        eprintln!(
            "{name}: {} RNICs registered in {took:.2?} ({:.1} µs each); RSS +{:.1} MiB",
            store.len().unwrap(),
            took.as_secs_f64() * 1e6 / f64::from(TORS * PER_TOR),
            (rss().saturating_sub(before)) as f64 / (1 << 20) as f64
        );
        let me = info(42, 7);
        let gid = me.gid.clone();
        let mut n = 0u32;
        group.bench_function(format!("{name}/register_refresh"), |b| {
            b.iter(|| {
                n = n.wrapping_add(1);
                register(&controller, black_box(&info(n % TORS, n % PER_TOR)));
            })
        });
        group.bench_function(format!("{name}/pinglist_tor_mesh"), |b| {
            b.iter(|| black_box(controller.pinglist(&gid, ListKind::TorMesh).unwrap()))
        });
        group.bench_function(format!("{name}/pinglist_inter_tor"), |b| {
            b.iter(|| black_box(controller.pinglist(&gid, ListKind::InterTor).unwrap()))
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);

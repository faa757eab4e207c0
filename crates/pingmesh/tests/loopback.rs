//! Agents, controller and analyzer as they run in a mesh, on loopback addresses
//! (127.0.0.x: one "RNIC" each, UDP in the software fabric): registration,
//! pinglists, probes answered with both ACKs, uploads, and the analyzer's view — then
//! one agent stops and is reported as a host fault.

use std::sync::Arc;
use std::time::{Duration, Instant};

use dpumesh_clock::SystemClock;
use dpumesh_dpa::fabric::soft::SoftFabric;
use dpumesh_pingmesh::agent::{Agent, AgentConfig};
use dpumesh_pingmesh::analyzer::{AnalyzerPolicy, ProblemKind, Report};
use dpumesh_pingmesh::pinglist::PinglistPolicy;
use dpumesh_pingmesh::server::{Server, ServerConfig};

fn server(dir: &std::path::Path) -> Server {
    Server::start(ServerConfig {
        grpc: "127.0.0.1:0".parse().unwrap(),
        http: "127.0.0.1:0".parse().unwrap(),
        registry: Some(dir.join("registry.db")),
        pinglist: PinglistPolicy {
            interval: Duration::from_millis(20),
            timeout: Duration::from_millis(300),
            inter_tor_targets: 2,
            ecmp_paths: 2,
            coverage: 0.9,
            rotate_every: Duration::from_secs(60),
            ..PinglistPolicy::default()
        },
        ttl: Duration::from_secs(3),
        analyzer: AnalyzerPolicy {
            window: Duration::from_secs(10),
            silence: Duration::from_millis(1500),
            ..AnalyzerPolicy::default()
        },
        nodes: Vec::new(),
        admin_token: None,
        tls: None,
        known: Default::default(),
        clock: Arc::new(SystemClock::new()),
    })
    .unwrap()
}

fn agent(server: &Server, n: u8, tor: &str) -> Agent {
    Agent::start(
        SoftFabric::new(),
        AgentConfig {
            agent_id: format!("node-{n}"),
            tor_id: tor.into(),
            bind: format!("127.0.0.{n}:0").parse().unwrap(),
            agent_ip: "127.0.0.1".into(),
            controller: server.grpc_url(),
            analyzer: server.grpc_url(),
            tls: None,
            refresh_every: Duration::from_millis(500),
            upload_every: Duration::from_millis(200),
            connections: None,
            trace_every: None,
            probe: true,
            // node-4 answers with the paper's two ACKs (what a NIC's fabric does),
            // the others with one that carries the delay: both kinds are measured.
            two_acks: n == 4,
            clock: Arc::new(SystemClock::new()),
        },
    )
    .unwrap()
}

fn wait_for(server: &Server, what: &str, ok: impl Fn(&Report) -> bool) -> Report {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let r = server.analyzer().report();
        if ok(&r) {
            return r;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: {}",
            serde_json::to_string_pretty(&r).unwrap()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn agents_probe_each_other_and_a_stopped_one_is_a_host_fault() {
    let dir = tempfile::tempdir().unwrap();
    let server = server(dir.path());
    let mut agents: Vec<Agent> = [(1, "tor-a"), (2, "tor-a"), (3, "tor-b"), (4, "tor-b")]
        .iter()
        .map(|(n, tor)| agent(&server, *n, tor))
        .collect();

    // Every node probes every other: ToR-mesh within a ToR, inter-ToR across.
    let r = wait_for(&server, "a full heatmap", |r| {
        r.heatmap.nodes.len() == 4
            && (0..4).all(|i| {
                (0..4).all(|j| {
                    i == j
                        || r.heatmap.cells[i][j]
                            .as_ref()
                            .is_some_and(|c| c.probes >= 10)
                })
            })
    });
    assert!(r.problems.is_empty(), "healthy: {:?}", r.problems);
    assert_eq!(r.cluster.drop_rate, 0.0);
    assert!(
        r.cluster.rtt_p50_us > 0.0 && r.cluster.rtt_p50_us < 5_000.0,
        "{:?}",
        r.cluster
    );
    // Host delays are measured apart from the network's.
    assert!(r.host_delays["node-1"].prober_p50_us > 0.0);
    for node in ["node-1", "node-4"] {
        assert!(
            r.host_delays[node].responder_p50_us > 0.0,
            "{node}'s ACK carries T4 − T3"
        );
    }
    for a in &agents {
        assert!(
            a.stats()
                .uploaded
                .load(std::sync::atomic::Ordering::Relaxed)
                > 0
        );
    }

    // node-4's agent stops: no answers, no uploads.
    agents.pop();
    let r = wait_for(&server, "node-4 down", |r| {
        r.problems
            .iter()
            .any(|p| p.kind == ProblemKind::HostDown && p.nodes == ["node-4"])
    });
    assert!(
        r.problems.iter().all(|p| !p.network),
        "a stopped host is not the network's fault: {:?}",
        r.problems
    );
    assert_eq!(r.unreachable, vec!["node-4"]);
}

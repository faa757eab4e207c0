//! Mutual TLS on the gRPC APIs: agents with their nodes' certificates register,
//! probe and upload; a node cannot act as another agent; a client without a node's
//! certificate is refused; an agent refuses a server that is not the Pingmesh one.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use dpumesh_clock::SystemClock;
use dpumesh_dpa::fabric::soft::SoftFabric;
use dpumesh_dpa::fabric::ud::Gid;
use dpumesh_identity::{MeshTls, SpiffeId, TlsFiles, ca};
use dpumesh_pingmesh::agent::{Agent, AgentConfig};
use dpumesh_pingmesh::analyzer::AnalyzerPolicy;
use dpumesh_pingmesh::controller::KnownRnic;
use dpumesh_pingmesh::pinglist::PinglistPolicy;
use dpumesh_pingmesh::proto;
use dpumesh_pingmesh::proto::analyzer_service_client::AnalyzerServiceClient;
use dpumesh_pingmesh::proto::controller_service_client::ControllerServiceClient;
use dpumesh_pingmesh::server::{Server, ServerConfig};

const TD: &str = "pm.test";

fn issue(dir: &Path) {
    let ids = [
        SpiffeId::pingmesh(TD).unwrap(),
        SpiffeId::node(TD, "node-1").unwrap(),
        SpiffeId::node(TD, "node-2").unwrap(),
        SpiffeId::ingress(TD).unwrap(),
    ];
    ca::ensure(dir, TD, &ids, ca::LEAF_VALIDITY, false).unwrap();
}

fn tls(dir: &Path, id: SpiffeId) -> Arc<MeshTls> {
    MeshTls::load(TlsFiles::in_dir(dir, &id), TD).unwrap()
}

/// The mesh file's RNICs: node-n has 127.0.0.n under tor-a.
fn known() -> std::collections::BTreeMap<String, KnownRnic> {
    (1..=4)
        .map(|n| {
            (
                format!("node-{n}"),
                KnownRnic {
                    ip: format!("127.0.0.{n}").parse().unwrap(),
                    tor: "tor-a".into(),
                },
            )
        })
        .collect()
}

fn server(dir: &Path, identity: SpiffeId) -> Server {
    Server::start(ServerConfig {
        grpc: "127.0.0.1:0".parse().unwrap(),
        http: "127.0.0.1:0".parse().unwrap(),
        registry: None,
        pinglist: PinglistPolicy {
            interval: Duration::from_millis(20),
            timeout: Duration::from_millis(300),
            ..PinglistPolicy::default()
        },
        ttl: Duration::from_secs(3),
        analyzer: AnalyzerPolicy::default(),
        nodes: Vec::new(),
        admin_token: None,
        tls: Some(tls(dir, identity)),
        known: known(),
        clock: Arc::new(SystemClock::new()),
    })
    .unwrap()
}

fn agent(url: String, n: u8, tls: Option<Arc<MeshTls>>) -> Agent {
    Agent::start(
        SoftFabric::new(),
        AgentConfig {
            agent_id: format!("node-{n}"),
            tor_id: "tor-a".into(),
            bind: format!("127.0.0.{n}:0").parse().unwrap(),
            agent_ip: "127.0.0.1".into(),
            controller: url.clone(),
            analyzer: url,
            tls,
            refresh_every: Duration::from_millis(500),
            upload_every: Duration::from_millis(200),
            connections: None,
            trace_every: None,
            probe: true,
            two_acks: false,
            clock: Arc::new(SystemClock::new()),
        },
    )
    .unwrap()
}

fn eventually(what: &str, ok: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !ok() {
        assert!(Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn agents_with_their_nodes_certificates_probe_and_upload_over_tls() {
    let dir = tempfile::tempdir().unwrap();
    issue(dir.path());
    let server = server(dir.path(), SpiffeId::pingmesh(TD).unwrap());
    let url = server.grpc_url();
    assert!(url.starts_with("https://"), "{url}");
    let agents: Vec<Agent> = (1..=2)
        .map(|n| {
            let id = SpiffeId::node(TD, &format!("node-{n}")).unwrap();
            agent(url.clone(), n, Some(tls(dir.path(), id)))
        })
        .collect();
    eventually("both nodes probe each other over TLS", || {
        let r = server.analyzer().report();
        r.heatmap.nodes.len() == 2
            && r.heatmap.cells[0][1]
                .as_ref()
                .is_some_and(|c| c.probes >= 5)
            && r.heatmap.cells[1][0]
                .as_ref()
                .is_some_and(|c| c.probes >= 5)
    });
    for a in &agents {
        assert_eq!(a.stats().register_errors.load(Ordering::Relaxed), 0);
        assert!(a.stats().uploaded.load(Ordering::Relaxed) > 0);
    }

    // Without a certificate, or with the ingress's, nothing is registered.
    let plain = agent(url.replacen("https://", "http://", 1), 3, None);
    let ingress = agent(
        url.clone(),
        4,
        Some(tls(dir.path(), SpiffeId::ingress(TD).unwrap())),
    );
    eventually("the plain and the ingress clients are refused", || {
        plain.stats().register_errors.load(Ordering::Relaxed) > 0
            && ingress.stats().register_errors.load(Ordering::Relaxed) > 0
    });
    let agents_seen = server.analyzer().report().agents;
    assert!(
        agents_seen
            .iter()
            .all(|a| a.agent == "node-1" || a.agent == "node-2"),
        "{agents_seen:?}"
    );
    assert_eq!(plain.stats().uploaded.load(Ordering::Relaxed), 0);
    assert_eq!(ingress.stats().uploaded.load(Ordering::Relaxed), 0);
}

#[test]
fn a_node_registers_and_uploads_as_itself_only() {
    let dir = tempfile::tempdir().unwrap();
    issue(dir.path());
    let server = server(dir.path(), SpiffeId::pingmesh(TD).unwrap());
    let node1 = tls(dir.path(), SpiffeId::node(TD, "node-1").unwrap());
    let ingress = tls(dir.path(), SpiffeId::ingress(TD).unwrap());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let channel = |tls: Arc<MeshTls>| {
            tonic::transport::Endpoint::from_shared(server.grpc_url())
                .unwrap()
                .connect_with_connector_lazy(dpumesh_pingmesh::tls::Connector::new(tls))
        };
        let mut client = ControllerServiceClient::new(channel(node1.clone()));
        let rnic = |agent: &str, ip: &str| proto::RnicInfo {
            gid: Gid::from_ip(ip.parse().unwrap()).to_string(),
            qpn: 7,
            qkey: 0x1111_1111,
            agent_id: agent.into(),
            agent_ip: "127.0.0.1".into(),
            rnic_ip: ip.into(),
            tor_id: "tor-a".into(),
            udp_port: 4791,
            ..Default::default()
        };
        let register = |agent: &str, ip: &str| proto::AgentRegistrationRequest {
            agent_id: agent.into(),
            rnics: vec![rnic(agent, ip)],
        };
        // Another node's name.
        let err = client
            .register_agent(register("node-2", "127.0.0.2"))
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::PermissionDenied);
        assert!(
            err.message().contains("node/node-1") && err.message().contains("\"node-2\""),
            "{}",
            err.message()
        );
        // Its own name, another node's RNIC.
        let err = client
            .register_agent(register("node-1", "127.0.0.2"))
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::PermissionDenied);
        assert!(
            err.message().contains("has RNIC 127.0.0.1"),
            "{}",
            err.message()
        );
        let ok = client
            .register_agent(register("node-1", "127.0.0.1"))
            .await
            .unwrap();
        assert_eq!(ok.get_ref().registered, 1);

        // Uploads under another agent's name are refused too.
        let mut analyzer = AnalyzerServiceClient::new(channel(node1));
        let err = analyzer
            .upload_data(proto::UploadDataRequest {
                agent_id: "node-2".into(),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::PermissionDenied);

        // The ingress's certificate is of the mesh, but not a node's: refused in the
        // handshake, before any service sees a request.
        let err = ControllerServiceClient::new(channel(ingress.clone()))
            .register_agent(register("node-1", "127.0.0.1"))
            .await
            .unwrap_err();
        assert_ne!(err.code(), tonic::Code::PermissionDenied, "{err}");
        assert_ne!(err.code(), tonic::Code::Ok);
    });
}

#[test]
fn an_agent_refuses_a_server_without_the_pingmesh_identity() {
    let dir = tempfile::tempdir().unwrap();
    issue(dir.path());
    // A node's certificate is of the mesh CA, but not the controller's.
    let impostor = server(dir.path(), SpiffeId::node(TD, "node-2").unwrap());
    let node1 = tls(dir.path(), SpiffeId::node(TD, "node-1").unwrap());
    let a = agent(impostor.grpc_url(), 1, Some(node1.clone()));
    eventually("the agent refuses the impostor", || {
        a.stats().register_errors.load(Ordering::Relaxed) > 0
    });
    assert!(node1.stats.refused.load(Ordering::Relaxed) > 0);
    assert!(impostor.analyzer().report().agents.is_empty());
}

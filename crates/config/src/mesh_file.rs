//! The mesh file: which nodes exist, where each service runs, the ingress, and the
//! policy file every node's proxy loads (and hot-reloads).
//!
//! ```yaml
//! policy: policy.yaml              # filters, chains, services' chains, routes
//! transport: shm                   # shm (one host) or tcp (across hosts, namespaces)
//! polling: {mode: hybrid, min: 0us, max: 50us}  # how shards and pods wait (or mode: poll)
//! ingress:
//!   listen: 127.0.0.1:8000
//!   max_head: 32KiB                # larger heads: 431
//!   max_body: 8MiB                 # larger bodies: 413
//!   body_timeout: 10s              # a body not received in time: 408
//!   header_timeout: 10s            # a head not received in time: connection closed
//!   idle_timeout: 60s              # a connection with no request open: closed
//!   park_after: 250ms              # an idle HTTP/1 connection gives its buffers back
//!   max_headers: 100               # more header fields: 431
//!   request_timeout: 30s           # no answer in time: 504
//!   slots: 128                     # requests in flight
//!   slots_per_client: 32           # of them, one client address's (429 past it)
//!   threads: 2                     # shards (default: the machine's cores)
//!   path: {normalize: true, merge_slashes: true, escaped_slashes: reject}  # the defaults
//!   tls: {certificates: [{cert: tls/www.pem, key: tls/www.key}]}  # HTTPS (see ingress_tls)
//! nodes:
//!   node1: {fabric: 127.0.0.1:7101, admin: 127.0.0.1:9101}  # netns: n1 (optional)
//!   # cores: 2                     # proxy shards (default: the machine's cores, shared
//!                                  # among the nodes `dpumesh up` runs on it)
//! services:
//!   frontend: {nodes: [node1], replicas: 1, command: [hotel, frontend]}
//! ```

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::error::{ConfigError, parse_yaml};
use crate::units::{ByteSize, Span};

/// The ingress.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IngressConfig {
    /// Where clients connect.
    pub listen: SocketAddr,
    /// Largest request head (default 32 KiB).
    pub max_head: Option<ByteSize>,
    /// Largest request or response body (default 8 MiB).
    pub max_body: Option<ByteSize>,
    /// Time to receive a body (default 10 s).
    pub body_timeout: Option<Span>,
    /// Time to receive a head once it started (default 10 s): slow clients
    /// (slowloris) are cut off.
    pub header_timeout: Option<Span>,
    /// How long a client connection with no request open is kept (default 60 s):
    /// HTTP/1 between requests, HTTP/2 with no stream.
    pub idle_timeout: Option<Span>,
    /// How long an HTTP/1 connection with no request open keeps its reader's and
    /// writer's buffers (default 250 ms): past it the connection is parked, holding
    /// its socket and clocks only, and taken up again when the client sends. A
    /// connection busy with requests never waits that long.
    pub park_after: Option<Span>,
    /// Most header fields in a head (default 100; more: 431).
    pub max_headers: Option<usize>,
    /// Time to get an answer (default 30 s).
    pub request_timeout: Option<Span>,
    /// Requests in flight at once (default 128).
    pub slots: Option<u32>,
    /// Of those, how many one client address may hold at once (default a quarter of
    /// `slots`, at least 8): a client's slow uploads cannot hold every slot; past its
    /// share it gets 429.
    pub slots_per_client: Option<u32>,
    /// Threads, each with its own listener, connections and links to every node
    /// (default: the machine's cores).
    pub threads: Option<usize>,
    /// Where the ingress's admin API listens (`/healthz`, `/readyz`, `/nodes`,
    /// `/metrics`); none when absent.
    pub admin: Option<SocketAddr>,
    /// How request paths are normalized before routing and filters (default: all
    /// normalization on, escaped slashes refused).
    #[serde(default)]
    pub path: PathConfig,
    /// HTTPS for clients (none: plaintext HTTP/1.1 and h2c); see [`IngressTls`].
    pub tls: Option<IngressTls>,
}

pub use crate::ingress_tls::IngressTls;

pub use dpumesh_head::path::{Backslashes, DoubleEscapes, EscapedSlashes, PathConfig, Semicolons};

impl IngressConfig {
    pub fn max_head(&self) -> usize {
        self.max_head.map_or(32 << 10, |b| b.0)
    }
    pub fn max_body(&self) -> usize {
        self.max_body.map_or(8 << 20, |b| b.0)
    }
    pub fn body_timeout(&self) -> Duration {
        self.body_timeout.map_or(Duration::from_secs(10), |s| s.0)
    }
    pub fn header_timeout(&self) -> Duration {
        self.header_timeout.map_or(Duration::from_secs(10), |s| s.0)
    }
    pub fn idle_timeout(&self) -> Duration {
        self.idle_timeout.map_or(Duration::from_secs(60), |s| s.0)
    }
    pub fn park_after(&self) -> Duration {
        self.park_after.map_or(Duration::from_millis(250), |s| s.0)
    }
    pub fn max_headers(&self) -> usize {
        self.max_headers.unwrap_or(100)
    }
    pub fn request_timeout(&self) -> Duration {
        self.request_timeout
            .map_or(Duration::from_secs(30), |s| s.0)
    }
    pub fn slots_per_client(&self) -> u32 {
        self.slots_per_client
            .unwrap_or((self.slots() / 4).max(8))
            .max(1)
    }
    pub fn slots(&self) -> u32 {
        self.slots.unwrap_or(128)
    }
}

/// A worker node (a DPU proxy and its DMA manager).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeEntry {
    /// The proxy's fabric address (ingress and peers connect here).
    pub fabric: SocketAddr,
    /// The proxy's admin API.
    pub admin: Option<SocketAddr>,
    /// A network namespace (`ip netns`) the node and its pods run in: several "hosts"
    /// on one machine, each with its own address, so the fabric between nodes crosses
    /// a real network boundary.
    pub netns: Option<String>,
    /// The ToR switch the node's RNIC hangs off (Pingmesh's topology; default
    /// `tor-0`).
    pub tor: Option<String>,
    /// The address Pingmesh's UD queue pair binds: its IP is the RNIC's GID (default:
    /// the fabric address's IP, any port).
    pub rnic: Option<SocketAddr>,
    /// The cores given to the node's proxy: one shard thread each, every request run
    /// to completion on the shard that took it (default: the machine's cores, divided
    /// among the nodes that run on it: see [`NodeEntry::shards`]).
    pub cores: Option<u32>,
}

impl NodeEntry {
    /// Most shards a node runs: each pod gets a ring pair (a lane) per shard, and a
    /// descriptor names its lane in one byte.
    pub const MAX_CORES: u32 = 64;

    /// The proxy's shards: `cores`, or this machine's cores divided among the
    /// `colocated` nodes that run on it (this one included; at least one shard).
    /// A node alone on its DPU takes every core; `dpumesh up` runs all its nodes on one
    /// machine, and shards there that outnumber the cores only take turns on them
    /// (measured on 2 cores, two nodes of one shard each against two of two: -2 to +7 %
    /// requests a second, 0.8-3.1 µs less proxy CPU per request, half the pods' bells
    /// rung, a p99 up to 0.9 ms higher; docs/mesh.md).
    pub fn shards(&self, colocated: usize) -> usize {
        match self.cores {
            Some(n) => n as usize,
            None => (std::thread::available_parallelism().map_or(1, usize::from)
                / colocated.max(1))
            .clamp(1, Self::MAX_CORES as usize),
        }
    }

    pub fn tor(&self) -> &str {
        self.tor.as_deref().unwrap_or("tor-0")
    }

    /// Where the node's Pingmesh agent binds.
    pub fn rnic(&self) -> SocketAddr {
        self.rnic
            .unwrap_or_else(|| SocketAddr::new(self.fabric.ip(), 0))
    }
}

/// A service: where it runs and how to start it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceEntry {
    /// Nodes it runs on.
    pub nodes: Vec<String>,
    /// Replicas per node (default 1).
    pub replicas: Option<u32>,
    /// The program and its arguments (`dpumesh up` starts it with `DPUMESH_CONTROL`,
    /// `DPUMESH_SERVICE` and `DPUMESH_POD` set). A bare program name is looked up
    /// beside the `dpumesh` binary first, then on `PATH`.
    #[serde(default)]
    pub command: Vec<String>,
    /// Route around the nodes the Pingmesh analyzer judges unreachable (a stopped
    /// host, a NIC that drops) until it says they are back (default false; needs the
    /// `pingmesh` section).
    #[serde(default)]
    pub eject_unreachable: bool,
    /// A service that was not written for the mesh: its pod is a `dpumesh bridge`
    /// that forwards the mesh's requests to this local server. `command`, if given,
    /// is then the server itself, which `dpumesh up` starts beside its bridge.
    pub bridge: Option<BridgeEntry>,
}

impl ServiceEntry {
    /// Pods it runs (nodes × replicas).
    pub fn pods(&self) -> usize {
        self.nodes.len() * self.replicas.unwrap_or(1) as usize
    }

    /// Whether `dpumesh up` starts pods for it (a command, or a bridge).
    pub fn has_pods(&self) -> bool {
        !self.command.is_empty() || self.bridge.is_some()
    }
}

/// An unmodified server joined through a bridge.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BridgeEntry {
    /// The server's `host:port`.
    pub to: String,
    /// What it speaks (default `http1`).
    #[serde(default)]
    pub protocol: BridgeProtocol,
    /// A local port the bridge listens on for the server's own calls (an HTTP proxy:
    /// `http://<service>/path` goes through the mesh as this service); none by default.
    /// `dpumesh up` gives the server `HTTP_PROXY` and `DPUMESH_EGRESS` pointing at it.
    pub egress: Option<SocketAddr>,
}

/// What a bridged server speaks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BridgeProtocol {
    /// HTTP/1.1.
    #[default]
    Http1,
    /// HTTP/2 without TLS (prior knowledge).
    H2c,
    /// gRPC: HTTP/2 without TLS, trailers kept.
    Grpc,
}

impl BridgeProtocol {
    /// Its name in the mesh file (and `dpumesh bridge --protocol`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Http1 => "http1",
            Self::H2c => "h2c",
            Self::Grpc => "grpc",
        }
    }
}

/// How the ingress and the nodes' proxies reach each other.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    /// The shared-memory fabric: every process on one host (and one network
    /// namespace); no system call per message while both ends are busy.
    #[default]
    Shm,
    /// The software RDMA fabric over TCP: across hosts and namespaces.
    Tcp,
}

/// How a node's shards and its pods wait when they have nothing to do.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PollMode {
    /// Poll a while after the last work (adapting between `min` and `max`), then
    /// sleep until woken.
    #[default]
    Hybrid,
    /// Never sleep: for cores given to the mesh alone (a DPU's Arm cores).
    Poll,
}

/// The `polling` section.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PollingConfig {
    #[serde(default)]
    pub mode: PollMode,
    /// The shortest poll after the last work (hybrid; default 0).
    pub min: Option<Span>,
    /// The longest (hybrid; default 50 µs).
    pub max: Option<Span>,
}

impl PollingConfig {
    /// The hybrid bounds.
    pub fn bounds(&self) -> (Duration, Duration) {
        (
            self.min.map_or(Duration::ZERO, |s| s.0),
            self.max.map_or(Duration::from_micros(50), |s| s.0),
        )
    }
}

/// Whether the links between the mesh's parts run over mutual TLS.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mtls {
    /// Every fabric link proves both ends with certificates of the mesh CA; a node
    /// honours "already policed" only from another node.
    #[default]
    Mutual,
    /// No certificates: any process that reaches a fabric address is trusted (for
    /// measuring what TLS costs; never where the network is shared).
    Off,
}

/// The `identity` section: certificates and SPIFFE IDs.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IdentityConfig {
    #[serde(default)]
    pub mtls: Mtls,
    /// The SPIFFE trust domain (default `dpumesh.local`).
    pub trust_domain: Option<String>,
    /// The certificate folder (relative to the mesh file; default `.dpumesh/certs`).
    /// `dpumesh up` issues what is missing there; on Kubernetes a Secret is mounted
    /// as it.
    pub certs: Option<PathBuf>,
    /// The namespace in the workloads' identities (default `default`).
    pub namespace: Option<String>,
}

impl IdentityConfig {
    /// Where the certificates are when the file names no folder.
    pub const DEFAULT_CERTS: &str = ".dpumesh/certs";

    /// The certificate folder (resolved against the mesh file's folder once read).
    pub fn certs(&self) -> &Path {
        self.certs
            .as_deref()
            .unwrap_or(Path::new(Self::DEFAULT_CERTS))
    }

    pub fn trust_domain(&self) -> &str {
        self.trust_domain.as_deref().unwrap_or("dpumesh.local")
    }
    pub fn namespace(&self) -> &str {
        self.namespace.as_deref().unwrap_or("default")
    }
}

/// The whole file.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MeshConfig {
    /// The policy file (relative to this file).
    pub policy: PathBuf,
    /// The fabric between the ingress and the nodes (default `shm`).
    #[serde(default)]
    pub transport: Transport,
    /// How shards and pods wait (default: hybrid, 0 to 50 µs).
    #[serde(default)]
    pub polling: PollingConfig,
    /// Certificates and identities (default: mutual TLS, certificates issued by
    /// `dpumesh up` into `.dpumesh/certs`).
    #[serde(default)]
    pub identity: IdentityConfig,
    pub ingress: IngressConfig,
    /// Nodes by name.
    pub nodes: BTreeMap<String, NodeEntry>,
    /// Services by name.
    pub services: BTreeMap<String, ServiceEntry>,
    /// Each node's BlueCache object store (none when absent).
    #[serde(default)]
    pub store: Option<crate::store::StoreConfig>,
    /// R-Pingmesh: an agent in every node, the controller and analyzer (none when
    /// absent).
    #[serde(default)]
    pub pingmesh: Option<crate::pingmesh::PingmeshConfig>,
}

/// A checked mesh file.
#[derive(Debug, Clone)]
pub struct MeshFile {
    pub file: PathBuf,
    /// Its content, with `policy` resolved against the file's folder.
    pub config: MeshConfig,
}

impl MeshFile {
    /// Reads and checks `file`.
    pub fn read(file: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(file)
            .map_err(|e| ConfigError::file(file, format!("cannot read: {e}")))?;
        let mut config: MeshConfig = parse_yaml(file, &text)?;
        // Checks name the key and, where it can be found, its line.
        let error = |path: &str, message: String| ConfigError::at(file, &text, path, message);
        let dir = file.parent().unwrap_or(Path::new("."));
        config.policy = dir.join(&config.policy);
        config.identity.certs = Some(
            dir.join(
                config
                    .identity
                    .certs
                    .as_deref()
                    .unwrap_or(Path::new(".dpumesh/certs")),
            ),
        );
        if let Some(tls) = config.ingress.tls.take() {
            if let Err((key, message)) = tls.check() {
                return Err(error(key, message));
            }
            config.ingress.tls = Some(tls.resolved(dir));
        }
        if config.nodes.is_empty() {
            return Err(error("nodes", "a mesh needs at least one node".into()));
        }
        if config.transport == Transport::Shm
            && let Some((name, _)) = config.nodes.iter().find(|(_, n)| n.netns.is_some())
        {
            return Err(error(
                &format!("nodes.{name}.netns"),
                "shared memory does not cross network namespaces: set `transport: tcp`".into(),
            ));
        }
        if let Some((name, node)) = config
            .nodes
            .iter()
            .find(|(_, n)| n.cores.is_some_and(|c| c == 0 || c > NodeEntry::MAX_CORES))
        {
            return Err(error(
                &format!("nodes.{name}.cores"),
                format!(
                    "{} cores: a node's proxy runs on 1 to {} cores",
                    node.cores.unwrap_or(0),
                    NodeEntry::MAX_CORES
                ),
            ));
        }
        let (min, max) = config.polling.bounds();
        match config.polling.mode {
            PollMode::Poll if config.polling.min.is_some() || config.polling.max.is_some() => {
                return Err(error(
                    "polling",
                    "mode poll never sleeps: min and max are for mode hybrid".into(),
                ));
            }
            PollMode::Hybrid if min > max || max > Duration::from_secs(1) => {
                return Err(error(
                    "polling.max",
                    format!("need min ≤ max ≤ 1s (min {min:?}, max {max:?})"),
                ));
            }
            _ => {}
        }
        if let Some(store) = &config.store {
            if let Err((key, message)) = store.check() {
                return Err(error(key, message));
            }
            // Relative to the mesh file, like every other path in it.
            if let Some(d) = &store.dir {
                let resolved = dir.join(d);
                config.store.as_mut().expect("checked above").dir = Some(resolved);
            }
        }
        if let Some(pm) = config.pingmesh.as_mut() {
            let mtls = config.identity.mtls == Mtls::Mutual;
            match pm.tls {
                Some(true) if !mtls => {
                    return Err(error(
                        "pingmesh.tls",
                        "needs the mesh's certificates (identity.mtls is off)".into(),
                    ));
                }
                None => pm.tls = Some(mtls),
                Some(_) => {}
            }
        }
        if let Some(pm) = &config.pingmesh {
            if let Err((key, message)) = pm.check() {
                return Err(error(key, message));
            }
            let registry = dir.join(
                pm.registry
                    .as_deref()
                    .unwrap_or(Path::new(".dpumesh/pingmesh.db")),
            );
            config.pingmesh.as_mut().expect("checked above").registry = Some(registry);
            let mut seen: BTreeMap<std::net::IpAddr, &str> = BTreeMap::new();
            for (name, node) in &config.nodes {
                let ip = node.rnic().ip();
                if ip.is_unspecified() {
                    return Err(error(
                        &format!("nodes.{name}.rnic"),
                        "Pingmesh needs the RNIC's own IP address (its GID), not 0.0.0.0".into(),
                    ));
                }
                if let Some(other) = seen.insert(ip, name) {
                    return Err(error(
                        &format!("nodes.{name}.rnic"),
                        format!(
                            "{ip} is node {other}'s RNIC too: a GID names one RNIC (give each node \
                             its own `rnic` address, e.g. 127.0.0.11 and 127.0.0.12 on one machine)"
                        ),
                    ));
                }
            }
        }
        for (name, service) in &config.services {
            if service.eject_unreachable && config.pingmesh.is_none() {
                return Err(error(
                    &format!("services.{name}.eject_unreachable"),
                    "needs the `pingmesh` section (its analyzer says which nodes are unreachable)"
                        .into(),
                ));
            }
            if service.nodes.is_empty() {
                return Err(error(
                    &format!("services.{name}.nodes"),
                    "a service runs on at least one node".into(),
                ));
            }
            for node in &service.nodes {
                if !config.nodes.contains_key(node) {
                    return Err(error(
                        &format!("services.{name}.nodes"),
                        format!(
                            "unknown node {node:?} (nodes: {:?})",
                            config.nodes.keys().collect::<Vec<_>>()
                        ),
                    ));
                }
            }
            if service.replicas == Some(0) {
                return Err(error(
                    &format!("services.{name}.replicas"),
                    "replicas must be at least 1".into(),
                ));
            }
            if let Some(bridge) = &service.bridge {
                // One server on one port, one egress port: one pod.
                let one_port = !service.command.is_empty() || bridge.egress.is_some();
                if one_port && service.pods() > 1 {
                    return Err(error(
                        &format!("services.{name}.bridge"),
                        "a bridged service whose server `dpumesh up` starts, or with an egress port, runs one pod (one node, one replica): its ports are one".into(),
                    ));
                }
                if bridge
                    .to
                    .rsplit_once(':')
                    .is_none_or(|(_, p)| p.parse::<u16>().is_err())
                {
                    return Err(error(
                        &format!("services.{name}.bridge.to"),
                        format!("{:?} is not host:port", bridge.to),
                    ));
                }
            }
        }
        Ok(Self {
            file: file.to_owned(),
            config,
        })
    }

    /// Nodes running each service.
    pub fn placement(&self) -> BTreeMap<String, Vec<String>> {
        self.config
            .services
            .iter()
            .map(|(name, s)| (name.clone(), s.nodes.clone()))
            .collect()
    }

    /// Fabric addresses of the nodes running each service.
    pub fn service_addrs(&self) -> BTreeMap<String, Vec<SocketAddr>> {
        self.config
            .services
            .iter()
            .map(|(name, s)| {
                let addrs = s
                    .nodes
                    .iter()
                    .filter_map(|n| self.config.nodes.get(n).map(|e| e.fabric))
                    .collect();
                (name.clone(), addrs)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(text: &str) -> Result<MeshFile, ConfigError> {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("mesh.yaml");
        std::fs::write(&file, text).unwrap();
        MeshFile::read(&file)
    }

    #[test]
    fn a_mesh_file_is_read_and_checked() {
        let m = load(
            "policy: p.yaml\ningress: {listen: 127.0.0.1:8000, max_body: 1MiB}\nnodes:\n  n1: {fabric: 127.0.0.1:7101}\n  n2: {fabric: 127.0.0.1:7102}\nservices:\n  a: {nodes: [n1, n2], command: [x]}\n",
        )
        .unwrap();
        assert_eq!(m.config.ingress.max_body(), 1 << 20);
        assert_eq!(m.config.ingress.max_head(), 32 << 10);
        assert_eq!(m.config.ingress.path, PathConfig::default());
        assert!(m.config.policy.ends_with("p.yaml"));
        assert_eq!(m.service_addrs()["a"].len(), 2);
        let e = load("policy: p.yaml\ningress: {listen: 127.0.0.1:8000}\nnodes: {n1: {fabric: 127.0.0.1:1}}\nservices: {a: {nodes: [n9]}}\n").unwrap_err();
        assert_eq!(e.path, "services.a.nodes");
        assert!(e.message.contains("unknown node \"n9\""), "{e}");
        let e = load(
            "policy: p.yaml\ningress: {listen: 127.0.0.1:8000, typo: 1}\nnodes: {}\nservices: {}\n",
        )
        .unwrap_err();
        assert!(e.message.contains("unknown field `typo`"), "{e}");
        let m = load("policy: p.yaml\ningress: {listen: 127.0.0.1:8000, path: {escaped_slashes: unescape}}\nnodes: {n1: {fabric: 127.0.0.1:1}}\nservices: {}\n").unwrap();
        assert_eq!(
            m.config.ingress.path.escaped_slashes,
            EscapedSlashes::Unescape
        );
        assert!(
            m.config.ingress.path.normalize,
            "the other options keep their defaults"
        );
        let e = load("policy: p.yaml\ningress: {listen: 127.0.0.1:8000, path: {escaped_slashes: drop}}\nnodes: {n1: {fabric: 127.0.0.1:1}}\nservices: {}\n").unwrap_err();
        assert!(e.message.contains("unknown variant `drop`"), "{e}");
    }

    const BASE: &str = "policy: p.yaml\ningress: {listen: 127.0.0.1:8000}\nnodes: {n1: {fabric: 127.0.0.1:1}}\nservices: {}\n";

    #[test]
    fn a_bridge_is_one_line_and_its_ports_make_it_one_pod() {
        let with = |service: &str| {
            load(&BASE.replace("services: {}", &format!("services:\n  legacy: {service}")))
        };
        let m = with("{nodes: [n1], bridge: {to: 127.0.0.1:8080}}").unwrap();
        let legacy = &m.config.services["legacy"];
        let bridge = legacy.bridge.as_ref().unwrap();
        assert_eq!(
            (bridge.to.as_str(), bridge.protocol),
            ("127.0.0.1:8080", BridgeProtocol::Http1)
        );
        assert!(legacy.has_pods(), "a bridge is a pod without a command");
        let m = with("{nodes: [n1], replicas: 2, bridge: {to: 'localhost:50051', protocol: grpc}}")
            .unwrap();
        assert_eq!(
            m.config.services["legacy"].pods(),
            2,
            "a server run elsewhere takes several bridges"
        );
        let e = with("{nodes: [n1], replicas: 2, command: [app], bridge: {to: 127.0.0.1:8080}}")
            .unwrap_err();
        assert_eq!(e.path, "services.legacy.bridge");
        assert!(e.message.contains("one pod"), "{e}");
        let e = with(
            "{nodes: [n1], replicas: 2, bridge: {to: 127.0.0.1:8080, egress: 127.0.0.1:15001}}",
        )
        .unwrap_err();
        assert!(e.message.contains("one pod"), "{e}");
        let e = with("{nodes: [n1], bridge: {to: nowhere}}").unwrap_err();
        assert_eq!(e.path, "services.legacy.bridge.to");
        let e = with("{nodes: [n1], bridge: {to: 127.0.0.1:1, protocol: http3}}").unwrap_err();
        assert!(e.message.contains("unknown variant `http3`"), "{e}");
    }

    #[test]
    fn polling_defaults_to_hybrid_and_takes_bounds_or_pure_poll() {
        let m = load(BASE).unwrap();
        assert_eq!(m.config.polling.mode, PollMode::Hybrid);
        assert_eq!(
            m.config.polling.bounds(),
            (Duration::ZERO, Duration::from_micros(50))
        );
        let m = load(&format!("{BASE}polling: {{min: 5us, max: 1ms}}\n")).unwrap();
        assert_eq!(
            m.config.polling.bounds(),
            (Duration::from_micros(5), Duration::from_millis(1))
        );
        let m = load(&format!("{BASE}polling: {{mode: poll}}\n")).unwrap();
        assert_eq!(m.config.polling.mode, PollMode::Poll);
    }

    #[test]
    fn a_node_runs_a_shard_per_core_it_is_given() {
        let cores = |n: &str| {
            format!(
                "policy: p.yaml\ningress: {{listen: 127.0.0.1:8000}}\nnodes: {{n1: {{fabric: 127.0.0.1:1{n}}}}}\nservices: {{}}\n"
            )
        };
        let m = load(&cores(", cores: 3")).unwrap();
        assert_eq!(m.config.nodes["n1"].shards(1), 3);
        assert_eq!(m.config.nodes["n1"].shards(4), 3, "cores given stay given");
        let all = std::thread::available_parallelism().map_or(1, usize::from);
        let m = load(&cores("")).unwrap();
        let n1 = &m.config.nodes["n1"];
        assert_eq!(n1.shards(1), all.min(64), "default: every core");
        assert_eq!(n1.shards(0), all.min(64), "no count is one node");
        assert_eq!(
            n1.shards(2),
            (all / 2).clamp(1, 64),
            "two nodes share the cores"
        );
        assert_eq!(n1.shards(all + 1), 1, "at least one shard");
        for bad in ["0", "65"] {
            let e = load(&cores(&format!(", cores: {bad}"))).unwrap_err();
            assert_eq!(e.path, "nodes.n1.cores");
            assert!(e.message.contains("1 to 64 cores"), "{e}");
        }
    }

    #[test]
    fn polling_bounds_that_cannot_work_are_refused() {
        let e = load(&format!("{BASE}polling: {{mode: poll, max: 5us}}\n")).unwrap_err();
        assert_eq!(e.path, "polling");
        assert!(e.message.contains("never sleeps"), "{e}");
        let e = load(&format!("{BASE}polling: {{min: 50us, max: 5us}}\n")).unwrap_err();
        assert_eq!(e.path, "polling.max");
        let e = load(&format!("{BASE}polling: {{mode: spin}}\n")).unwrap_err();
        assert!(e.message.contains("unknown variant `spin`"), "{e}");
    }

    #[test]
    fn pingmesh_runs_tls_as_the_mesh_does() {
        const NODES: &str = "policy: p.yaml\ningress: {listen: 127.0.0.1:8000}\nservices: {}\nnodes:\n  n1: {fabric: 127.0.0.1:7101, rnic: 127.0.0.11:4791}\n  n2: {fabric: 127.0.0.1:7102, rnic: 127.0.0.12:4791}\n";
        let pm = |extra: &str| {
            format!("{NODES}pingmesh: {{listen: 127.0.0.1:9470, http: 127.0.0.1:9471{extra}}}\n")
        };
        let m = load(&pm("")).unwrap();
        let p = m.config.pingmesh.as_ref().unwrap();
        assert!(p.tls());
        assert_eq!(p.controller_url(), "https://127.0.0.1:9470");
        let m = load(&format!("{}identity: {{mtls: off}}\n", pm(""))).unwrap();
        assert_eq!(
            m.config.pingmesh.unwrap().controller_url(),
            "http://127.0.0.1:9470"
        );
        let m = load(&pm(", tls: false")).unwrap();
        assert!(!m.config.pingmesh.unwrap().tls());
        let e = load(&format!("{}identity: {{mtls: off}}\n", pm(", tls: true"))).unwrap_err();
        assert_eq!(e.path, "pingmesh.tls");
        let e = load(&pm(", controller: \"http://10.0.0.1:9470\"")).unwrap_err();
        assert_eq!(e.path, "pingmesh.controller");
        assert!(e.message.contains("https://"), "{e}");
        // One GID, one RNIC.
        let e = load(&pm("").replace("127.0.0.12:4791", "127.0.0.11:4792")).unwrap_err();
        assert_eq!(e.path, "nodes.n2.rnic");
        // The inter-ToR list's bounds.
        let m = load(&pm("")).unwrap();
        let p = m.config.pingmesh.as_ref().unwrap();
        assert_eq!((p.inter_tor_probers(), p.inter_tor_tors()), (2, 16));
        let m = load(&pm(", inter_tor_probers: 3, inter_tor_tors: 8")).unwrap();
        let p = m.config.pingmesh.as_ref().unwrap();
        assert_eq!((p.inter_tor_probers(), p.inter_tor_tors()), (3, 8));
        let e = load(&pm(", inter_tor_probers: 0")).unwrap_err();
        assert_eq!(e.path, "pingmesh.inter_tor_probers");
        let e = load(&pm(", inter_tor_tors: 0")).unwrap_err();
        assert_eq!(e.path, "pingmesh.inter_tor_tors");
    }
}

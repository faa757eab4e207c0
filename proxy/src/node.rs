//! One worker node of a mesh as a process: the DPU side of the data path (pools,
//! rings, DMA manager, control socket for pods), the filter runtime with hot reload,
//! the data plane on the fabric, and the admin API.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use dpumesh_config::{MeshFile, PollMode, PollingConfig, Transport};
use dpumesh_dpa::control::transport::Endpoint;
use dpumesh_dpa::fabric::Fabric;
use dpumesh_dpa::fabric::shm::ShmFabric;
use dpumesh_dpa::fabric::soft::SoftFabric;
use dpumesh_dpa::{Dpu, DpuConfig, PodSizing, Polling};

use crate::dataplane::{Dataplane, Topology};
use crate::policy::Policy;

/// A running node.
pub struct Node {
    // Field order is drop order: the data plane stops before the DPU side it uses.
    dataplane: Dataplane,
    dpu: Arc<Dpu>,
    /// The node's BlueCache agent (when the mesh file has a `store` section).
    store: Option<Arc<dpumesh_store::Agent>>,
    policy: Arc<Policy>,
    admin: Option<SocketAddr>,
    /// The node's Pingmesh agent (when the mesh file has a `pingmesh` section).
    pingmesh: Option<dpumesh_pingmesh::agent::Agent>,
    _io: tokio::runtime::Runtime,
}

/// Where a node binds and what it runs on, where an orchestrator says otherwise than
/// the mesh file's entry (the `dpumesh node` flags and their environment variables).
/// On Kubernetes the mesh file is one ConfigMap for every node while each DPU binds
/// its own addresses.
#[derive(Debug, Clone, Default)]
pub struct NodeOptions {
    /// Where the control socket goes when `control` is not given.
    pub run_dir: PathBuf,
    /// Where the node's pods register (default: `RUN_DIR/NAME.sock`); a TCP address
    /// when the host's pods reach the DPU over the network.
    pub control: Option<Endpoint>,
    /// The fabric address to bind (default: the entry's `fabric`, which is what peers
    /// and the ingress dial; `0.0.0.0:PORT` binds every interface).
    pub fabric_listen: Option<SocketAddr>,
    /// The admin API's address (default: the entry's `admin`).
    pub admin: Option<SocketAddr>,
    /// The fabric backend (default: the mesh file's `transport`).
    pub transport: Option<Transport>,
    /// Nodes (this one included) that run on this machine and share its cores, for
    /// the default count of shards (0 or 1: the node is alone; `dpumesh up` runs every
    /// node of its mesh file here).
    pub colocated: usize,
    /// The BlueField split in software: the node's shards reach their pods' rings and
    /// pools only through their DMA engine, as a DPU reaches host memory, and it takes
    /// the pods a host agent (`dpumesh host`) registers.
    pub across_pcie: bool,
    /// On a BlueField (`doca` feature): the Comch server host agents register pods
    /// with (`PCI,REP_PCI,NAME`), in place of the control socket; the shards' engines
    /// are then DOCA DMA.
    pub comch: Option<String>,
}

impl NodeOptions {
    /// The mesh file's settings, with the control socket in `run_dir`.
    pub fn in_run_dir(run_dir: &Path) -> Self {
        Self {
            run_dir: run_dir.to_owned(),
            ..Self::default()
        }
    }
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("fabric", &self.dataplane.addr())
            .field("control", &self.dpu.control_endpoint())
            .finish_non_exhaustive()
    }
}

/// Node `name`'s BlueCache agent: its objects in `DIR/NAME` (default
/// `RUN_DIR/bluecache/NAME`), the software DMA engine (DOCA DMA is the `doca`
/// feature's engine, not wired to the agent yet).
fn start_store(
    settings: &dpumesh_config::StoreConfig,
    name: &str,
    run_dir: &Path,
) -> anyhow::Result<dpumesh_store::Agent> {
    let backend: Box<dyn dpumesh_store::Backend> = match settings.backend {
        dpumesh_config::StoreBackend::Memory => Box::new(dpumesh_store::MemoryBackend::new()),
        dpumesh_config::StoreBackend::Posix => {
            let dir = settings
                .dir
                .clone()
                .unwrap_or_else(|| run_dir.join("bluecache"))
                .join(name);
            Box::new(dpumesh_store::PosixBackend::open(
                &dir,
                dpumesh_store::PosixOptions {
                    fsync: settings.fsync(),
                },
            )?)
        }
    };
    let agent = dpumesh_store::Agent::start(
        dpumesh_store::AgentConfig {
            capacity: settings.capacity(),
            queue_depth: settings.queue_depth(),
            slot_size: settings.slot_size(),
            io_threads: settings.io_threads(),
            pipelined: settings.pipelined(),
            verify_reads: settings.verify_reads(),
            memory: settings.memory(),
        },
        backend,
        Box::new(dpumesh_dpa::dma::SoftwareDma),
    )?;
    tracing::info!(stats = ?agent.stats(), "BlueCache store started");
    Ok(agent)
}

/// The data plane on fabric `fabric`, listening at `listen`.
/// The node's Pingmesh agent: its RNIC is a UD queue pair of the software fabric at
/// the entry's `rnic` address (hardware: the verbs backend's, under `verbs`).
///
/// Service tracing follows the node's links to the peers that serve what it
/// forwards (the data plane's connection table is static per mesh file: one link per
/// peer). On hardware the links' queue pair numbers give the probes their entropy;
/// here the two node names do, so each link has its own 5-tuple.
fn start_pingmesh(
    settings: &dpumesh_config::PingmeshConfig,
    mesh: &MeshFile,
    name: &str,
    tls: Option<std::sync::Arc<dpumesh_identity::MeshTls>>,
) -> anyhow::Result<dpumesh_pingmesh::agent::Agent> {
    use dpumesh_pingmesh::agent::{Agent, AgentConfig, Connection};
    let entry = &mesh.config.nodes[name];
    let placement = mesh.placement();
    let mine: std::collections::BTreeSet<&str> = placement
        .iter()
        .filter(|(_, nodes)| nodes.iter().any(|n| n == name))
        .map(|(s, _)| s.as_str())
        .collect();
    let mut connections = Vec::new();
    for (peer, peer_entry) in mesh.config.nodes.iter().filter(|(n, _)| n.as_str() != name) {
        let services: Vec<String> = placement
            .iter()
            .filter(|(s, nodes)| !mine.contains(s.as_str()) && nodes.first() == Some(peer))
            .map(|(s, _)| s.clone())
            .collect();
        if services.is_empty() {
            continue;
        }
        let hash = |s: &str| {
            s.bytes().fold(0x811c_9dc5u32, |h, b| {
                (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
            })
        };
        connections.push(Connection {
            peer_ip: peer_entry.rnic().ip(),
            local_qpn: hash(name) & 0xFF_FFFF,
            remote_qpn: hash(peer) & 0xFF_FFFF,
            services,
        });
    }
    let agent = Agent::start(
        SoftFabric::new(),
        AgentConfig {
            agent_id: name.to_owned(),
            tor_id: entry.tor().to_owned(),
            bind: entry.rnic(),
            agent_ip: entry.fabric.ip().to_string(),
            controller: settings.controller_url(),
            analyzer: settings.controller_url(),
            tls,
            refresh_every: Duration::from_secs(2),
            upload_every: settings.upload_every(),
            connections: (!connections.is_empty()).then(|| {
                std::sync::Arc::new(move || connections.clone())
                    as dpumesh_pingmesh::agent::Connections
            }),
            trace_every: Some(settings.trace_every()),
            probe: true,
            two_acks: false,
            clock: dpumesh_clock::SystemClock::shared(),
        },
    )?;
    tracing::info!(rnic = ?agent.rnic(), "Pingmesh agent started");
    Ok(agent)
}

fn start_dataplane<F: Fabric + Clone>(
    fabric: F,
    listen: SocketAddr,
    dpu: Arc<Dpu>,
    policy: &Arc<Policy>,
    topology: Topology,
    polling: Polling,
) -> anyhow::Result<Dataplane> {
    Dataplane::start(fabric, listen, dpu, policy.clone(), topology, polling)
}

/// The mesh file's `polling` section as the data path's policy (shards and pods).
pub fn polling(config: &PollingConfig) -> Polling {
    match config.mode {
        PollMode::Poll => Polling::Poll,
        PollMode::Hybrid => {
            let (min, max) = config.bounds();
            Polling::Hybrid { min, max }
        }
    }
}

/// The pods the mesh file places on node `name`, by service.
fn expected_pods(mesh: &MeshFile, name: &str) -> BTreeMap<String, usize> {
    mesh.config
        .services
        .iter()
        .filter(|(_, s)| s.nodes.iter().any(|n| n == name))
        .map(|(service, s)| (service.clone(), s.replicas.unwrap_or(1) as usize))
        .collect()
}

/// What `/readyz` says the node waits for: the pods the mesh file places here that
/// have not (all) registered, after a start or while a crashed one comes back. It
/// does not make the node unready ([`crate::admin::Awaited`] says why).
fn pods_registered(expected: BTreeMap<String, usize>, dpu: Arc<Dpu>) -> crate::admin::Awaited {
    Arc::new(move || {
        let pods = dpu.pods();
        let missing: Vec<String> = expected
            .iter()
            .filter_map(|(service, want)| {
                let have = pods.iter().filter(|p| &p.service == service).count();
                (have < *want).then(|| format!("{have} of {want} pods of {service:?} registered"))
            })
            .collect();
        if missing.is_empty() {
            Ok(())
        } else {
            Err(missing.join(", "))
        }
    })
}

/// A node on Comch with DOCA DMA (`doca` feature).
#[cfg(feature = "doca")]
fn start_on_comch(config: DpuConfig, address: &str) -> anyhow::Result<Dpu> {
    let address: dpumesh_dpa::dpu::comch::ComchAddress =
        address.parse().map_err(anyhow::Error::msg)?;
    Ok(Dpu::start_on_comch(config, &address)?)
}

/// Without the `doca` feature there is no Comch.
#[cfg(not(feature = "doca"))]
fn start_on_comch(_config: DpuConfig, address: &str) -> anyhow::Result<Dpu> {
    anyhow::bail!(
        "the control channel on Comch ({address}) needs a build with `--features doca` (BlueField images)"
    )
}

/// Where node `name`'s pods register.
pub fn control_socket(run_dir: &Path, name: &str) -> PathBuf {
    run_dir.join(format!("{name}.sock"))
}

impl Node {
    /// Starts node `name` of `mesh`; its control socket goes in `run_dir`.
    pub fn start(mesh: &MeshFile, name: &str, run_dir: &Path) -> anyhow::Result<Self> {
        Self::start_with(mesh, name, &NodeOptions::in_run_dir(run_dir))
    }

    /// Starts node `name` of `mesh` with `options` over its entry's settings.
    pub fn start_with(mesh: &MeshFile, name: &str, options: &NodeOptions) -> anyhow::Result<Self> {
        let entry =
            mesh.config.nodes.get(name).ok_or_else(|| {
                anyhow::anyhow!("node {name:?} is not in {}", mesh.file.display())
            })?;
        crate::admin::prometheus();
        let policy = Policy::start(&mesh.config.policy)?;
        policy.watch(Duration::from_millis(250))?;
        let max_body = mesh.config.ingress.max_body() as u32;
        // Shared-memory names carry the process id: two meshes on one machine (tests)
        // must not meet.
        let mut config = DpuConfig::new(format!("{name}-{}", std::process::id()));
        config.registration = crate::trust::registration_key(mesh)?;
        config.shards = entry.shards(options.colocated);
        config.across_pcie = options.across_pcie;
        config.pod = PodSizing {
            header_slot: 64 << 10,
            header_slots: 256,
            body_slot: max_body.max(4096),
            body_slots: 64,
            ring_capacity: 256,
        };
        for (service, nodes) in mesh.placement() {
            if nodes.iter().any(|n| n == name) {
                continue;
            }
            if let Some(addr) = nodes
                .first()
                .and_then(|n| mesh.config.nodes.get(n))
                .map(|e| e.fabric)
            {
                config.remote_services.insert(service, addr);
            }
        }
        let store = match &mesh.config.store {
            Some(settings) => Some(Arc::new(start_store(settings, name, &options.run_dir)?)),
            None => None,
        };
        config.store = store
            .clone()
            .map(|a| a as Arc<dyn dpumesh_dpa::control::transport::StoreService>);
        // Routes with `cache` keep their responses in the store.
        let cache = store
            .as_ref()
            .map(|s| Arc::new(crate::http_cache::HttpCache::new(s.clone())));
        if cache.is_none()
            && policy
                .snapshot()
                .config
                .config
                .routes
                .iter()
                .any(|r| r.cache.is_some())
        {
            tracing::warn!(
                "routes ask for a response cache but the mesh file has no `store` section: they are not cached"
            );
        }
        let control = match &options.control {
            Some(endpoint) => endpoint.clone(),
            None => {
                let socket = control_socket(&options.run_dir, name);
                // A socket a killed predecessor left behind.
                let _ = std::fs::remove_file(&socket);
                Endpoint::Unix(socket)
            }
        };
        if let Endpoint::Tcp(addr) = &control {
            // Over TCP the control channel runs mutual TLS with the node's
            // certificate; pods prove their workloads.
            config.control_tls = crate::trust::load(mesh, &crate::trust::node_id(mesh, name)?)?;
            anyhow::ensure!(
                config.control_tls.is_some(),
                "the control channel on tcp:{addr} runs mutual TLS only, and identity.mtls is off: use the Unix socket (no --control), or turn identities on"
            );
        }
        config.workload_prefix = Some(crate::trust::workload_prefix(mesh));
        let dpu = Arc::new(match &options.comch {
            None => Dpu::start(config, &control)?,
            Some(address) => start_on_comch(config, address)?,
        });
        let listen = options.fabric_listen.unwrap_or(entry.fabric);
        let observer = Arc::new(
            crate::observe::Observer::new(name)
                .with_traces(dpumesh_traces::Exporter::from_env("dpumesh-node")),
        );
        observer
            .access_log
            .configure(&policy.snapshot().config, name)
            .map_err(|e| anyhow::anyhow!("access_log: {e}"))?;
        {
            // A reload may turn the access log on, off, or point it elsewhere.
            let (observer, name) = (Arc::downgrade(&observer), name.to_owned());
            policy.on_publish(move |config| {
                if let Some(observer) = observer.upgrade()
                    && let Err(e) = observer.access_log.configure(config, &name)
                {
                    tracing::error!(error = %e, "access_log: not applied");
                }
            });
        }
        let topology = Topology {
            node: name.to_owned(),
            peers: mesh
                .config
                .nodes
                .iter()
                .filter(|(n, _)| n.as_str() != name)
                .map(|(n, e)| (n.clone(), e.fabric))
                .collect(),
            placement: mesh.placement(),
            timeout: mesh.config.ingress.request_timeout(),
            workload_prefix: crate::trust::workload_prefix(mesh),
            require_identity: mesh.config.identity.mtls == dpumesh_config::Mtls::Mutual,
            cache: cache.clone(),
            path: mesh.config.ingress.path,
            observer: observer.clone(),
            labels: Arc::default(),
        };
        let tls = crate::trust::load(mesh, &crate::trust::node_id(mesh, name)?)?;
        // The agent proves the node's identity to the Pingmesh server (`pingmesh.tls`).
        let agent_tls = tls
            .clone()
            .filter(|_| mesh.config.pingmesh.as_ref().is_some_and(|p| p.tls()));
        let dataplane = match options.transport.unwrap_or(mesh.config.transport) {
            Transport::Shm => start_dataplane(
                ShmFabric::new().with_tls(tls),
                listen,
                dpu.clone(),
                &policy,
                topology,
                polling(&mesh.config.polling),
            )?,
            Transport::Tcp => start_dataplane(
                SoftFabric::new().with_tls(tls),
                listen,
                dpu.clone(),
                &policy,
                topology,
                polling(&mesh.config.polling),
            )?,
        };
        // Monitoring must not take the data plane down: a node whose agent cannot
        // start serves without it, and says so.
        let pingmesh = mesh.config.pingmesh.as_ref().and_then(|settings| {
            start_pingmesh(settings, mesh, name, agent_tls)
                .inspect_err(|e| tracing::error!(error = %e, "Pingmesh agent not started"))
                .ok()
        });
        let io = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("dpumesh-admin")
            .enable_all()
            .build()?;
        let admin = match options.admin.or(entry.admin) {
            Some(addr) => {
                let listener = io
                    .block_on(tokio::net::TcpListener::bind(addr))
                    .map_err(|e| anyhow::anyhow!("cannot listen on {addr}: {e}"))?;
                let local = listener.local_addr()?;
                let mesh_token = crate::trust::registration_key(mesh)?
                    .as_ref()
                    .map(dpumesh_identity::admin::admin_token);
                let access =
                    crate::admin::access(&policy.snapshot().config, local.port(), mesh_token)?;
                io.spawn(crate::admin::serve(
                    listener,
                    access,
                    policy.clone(),
                    vec![dataplane.supervisor().clone()],
                    vec![pods_registered(expected_pods(mesh, name), dpu.clone())],
                    store.clone(),
                    cache.clone(),
                    Some(observer.clone()),
                ));
                Some(local)
            }
            None => None,
        };
        Ok(Self {
            dataplane,
            dpu,
            store,
            policy,
            admin,
            pingmesh,
            _io: io,
        })
    }

    /// The fabric address.
    pub fn fabric_addr(&self) -> SocketAddr {
        self.dataplane.addr()
    }

    /// The admin API.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin
    }

    /// Where pods register, for a node on a control socket (tests and tools: a node
    /// on Comch has none, see [`Self::control_name`]).
    pub fn control(&self) -> &Endpoint {
        self.dpu
            .control_socket()
            .expect("a node on Comch has no control socket")
    }

    /// Where pods register (or, on a BlueField, host agents: `comch:NAME`).
    pub fn control_name(&self) -> String {
        self.dpu.control_endpoint()
    }

    /// The node's DPU side.
    pub fn dpu(&self) -> &Arc<Dpu> {
        &self.dpu
    }

    /// The node's BlueCache agent, if it runs one.
    pub fn store(&self) -> Option<&Arc<dpumesh_store::Agent>> {
        self.store.as_ref()
    }

    /// The filter runtime.
    pub fn policy(&self) -> &Arc<Policy> {
        &self.policy
    }

    /// The data plane.
    pub fn dataplane(&self) -> &Dataplane {
        &self.dataplane
    }

    /// The node's Pingmesh agent, if it runs one.
    pub fn pingmesh(&self) -> Option<&dpumesh_pingmesh::agent::Agent> {
        self.pingmesh.as_ref()
    }
}

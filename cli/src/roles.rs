//! `dpumesh node` and `dpumesh ingress`: one role per process (what `dpumesh up`
//! starts and supervises, and what an orchestrator runs).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use dpumesh_config::MeshFile;
use dpumesh_config::Transport;
use dpumesh_dpa::fabric::shm::ShmFabric;
use dpumesh_dpa::fabric::soft::SoftFabric;
use dpumesh_proxy::node::{Node, NodeOptions};

use crate::up::READY;

/// Waits for Ctrl-C or SIGTERM.
pub(crate) fn wait_for_signal() -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            r = tokio::signal::ctrl_c() => r,
            _ = term.recv() => Ok(()),
        }
    })?;
    Ok(())
}

/// `dpumesh node`: one worker node.
pub fn node(mesh: &Path, name: &str, certs: Option<PathBuf>, options: &NodeOptions) -> Result<()> {
    let mut mesh = MeshFile::read(mesh)?;
    if certs.is_some() {
        mesh.config.identity.certs = certs;
    }
    // Said before the policy's components load (seconds on a cold cache).
    tracing::info!(node = name, policy = %mesh.config.policy.display(), "starting");
    if options.control.is_none() {
        std::fs::create_dir_all(&options.run_dir).with_context(|| {
            format!("cannot create the run folder {}", options.run_dir.display())
        })?;
    }
    // What a killed predecessor (or any dead process of ours) left in /dev/shm.
    dpumesh_dpa::shm::sweep_orphans();
    let node = Node::start_with(&mesh, name, options)?;
    say!(
        "{READY} node {name} fabric {} control {} admin {}",
        node.fabric_addr(),
        node.control_name(),
        node.admin_addr().map_or("-".to_owned(), |a| a.to_string())
    );
    wait_for_signal()?;
    drop(node);
    Ok(())
}

/// `dpumesh host`: the host agent of the BlueField split, until a signal or until its
/// node goes (then it fails, for its supervisor to start it again once the node is
/// back: its pods' memory is of no use without one).
pub fn host(node: &str, listen: &Path, name: &str) -> Result<()> {
    use dpumesh_dpa::agent::{AgentConfig, HostAgent, PushSink};
    let sink = PushSink::default();
    let (link, exporter, node_name) = match node.strip_prefix("comch:") {
        Some(address) => comch_link(address, name, &sink)?,
        None => {
            let pushes = sink.clone();
            let path = node.strip_prefix("unix:").unwrap_or(node);
            let link = dpumesh_dpa::control::transport::MuxClient::connect(
                Path::new(path),
                name,
                move |r| pushes.deliver(r),
            )
            .with_context(|| format!("cannot reach the node at {path}"))?;
            let node_name = link.node().to_owned();
            let link: std::sync::Arc<dyn dpumesh_dpa::agent::DpuLink> = std::sync::Arc::new(link);
            (link, None, node_name)
        }
    };
    if let Some(dir) = listen.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    let config = AgentConfig {
        name: name.to_owned(),
        listen: listen.to_owned(),
        exporter,
    };
    let agent = HostAgent::start(config, link, &sink, node_name.clone())
        .context("the host agent cannot start")?;
    say!(
        "{READY} host {name} node {node_name} pods {}",
        listen.display()
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let closed = rt.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        let mut tick = tokio::time::interval(std::time::Duration::from_millis(100));
        loop {
            tokio::select! {
                r = tokio::signal::ctrl_c() => return r.map(|()| None),
                _ = term.recv() => return Ok(None),
                _ = tick.tick() => {
                    if let Some(why) = agent.closed() {
                        return Ok::<_, std::io::Error>(Some(why));
                    }
                }
            }
        }
    })?;
    drop(agent);
    match closed {
        Some(why) => anyhow::bail!("the node went away: {why}"),
        None => Ok(()),
    }
}

/// What a host agent on a BlueField host uses: the link over Comch, and the exporter
/// of its pods' regions (`doca` feature).
type AgentParts = (
    std::sync::Arc<dyn dpumesh_dpa::agent::DpuLink>,
    Option<std::sync::Arc<parking_lot::Mutex<dyn dpumesh_dpa::dma::export::RegionExporter>>>,
    String,
);

#[cfg(feature = "doca")]
fn comch_link(
    address: &str,
    name: &str,
    sink: &dpumesh_dpa::agent::PushSink,
) -> Result<AgentParts> {
    let (pci, server) = address
        .split_once(',')
        .with_context(|| format!("{address:?} is not PCI,SERVER"))?;
    let link = dpumesh_dpa::agent::link::ComchLink::connect(pci, server, name, sink.clone())
        .with_context(|| format!("cannot reach the Comch server {server} through {pci}"))?;
    let exporter = dpumesh_dpa::dma::doca_export::DocaExporter::open(pci)
        .with_context(|| format!("cannot open the DOCA device at {pci} to export memory"))?;
    Ok((
        std::sync::Arc::new(link),
        Some(std::sync::Arc::new(parking_lot::Mutex::new(exporter))),
        server.to_owned(),
    ))
}

#[cfg(not(feature = "doca"))]
fn comch_link(
    address: &str,
    _name: &str,
    _sink: &dpumesh_dpa::agent::PushSink,
) -> Result<AgentParts> {
    anyhow::bail!(
        "the node on Comch ({address}) needs a build with `--features doca` (BlueField hosts)"
    )
}

/// `dpumesh pingmesh`: the controller and the analyzer.
pub fn pingmesh(mesh: &Path, listen: Option<SocketAddr>, http: Option<SocketAddr>) -> Result<()> {
    let mesh = MeshFile::read(mesh)?;
    let Some(pm) = &mesh.config.pingmesh else {
        anyhow::bail!("{}: no `pingmesh` section", mesh.file.display());
    };
    let registry = pm.registry.clone();
    if let Some(dir) = registry.as_deref().and_then(Path::parent) {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    let server = dpumesh_pingmesh::server::Server::start(dpumesh_pingmesh::server::ServerConfig {
        grpc: listen.unwrap_or(pm.listen),
        http: http.unwrap_or(pm.http),
        registry,
        pinglist: dpumesh_pingmesh::pinglist::PinglistPolicy {
            interval: pm.interval(),
            timeout: pm.timeout(),
            inter_tor_targets: pm.inter_tor_targets(),
            inter_tor_probers: pm.inter_tor_probers(),
            inter_tor_tors: pm.inter_tor_tors(),
            ecmp_paths: pm.ecmp_paths(),
            coverage: pm.coverage(),
            rotate_every: pm.rotate_every(),
        },
        ttl: pm.ttl(),
        analyzer: dpumesh_pingmesh::analyzer::AnalyzerPolicy {
            window: pm.window(),
            silence: pm.silence(),
            slow_rtt: pm.slow_rtt(),
            ..Default::default()
        },
        nodes: mesh
            .config
            .nodes
            .iter()
            .filter_map(|(n, e)| e.admin.map(|a| (n.clone(), format!("http://{a}"))))
            .collect(),
        // The dashboard's tap page taps the nodes with the mesh's admin token.
        admin_token: dpumesh_proxy::trust::registration_key(&mesh)?
            .as_ref()
            .map(dpumesh_identity::admin::admin_token),
        known: mesh
            .config
            .nodes
            .iter()
            .map(|(n, e)| {
                let rnic = dpumesh_pingmesh::controller::KnownRnic {
                    ip: e.rnic().ip(),
                    tor: e.tor().to_owned(),
                };
                (n.clone(), rnic)
            })
            .collect(),
        tls: if pm.tls() {
            dpumesh_proxy::trust::load(&mesh, &dpumesh_proxy::trust::pingmesh_id(&mesh)?)?
        } else {
            None
        },
        clock: dpumesh_clock::SystemClock::shared(),
    })?;
    say!(
        "{READY} pingmesh grpc {} http {}",
        server.grpc_addr,
        server.http_addr
    );
    wait_for_signal()?;
    drop(server);
    Ok(())
}

/// `dpumesh pingmesh agent`'s arguments.
#[derive(Debug, clap::Args)]
pub struct AgentArgs {
    /// The controller (and analyzer): `http://HOST:PORT`, or `https://HOST:PORT`
    /// for mutual TLS with `--certs`.
    #[arg(long, env = "DPUMESH_PINGMESH_CONTROLLER")]
    pub controller: String,
    /// The agent's (node's) name.
    #[arg(long)]
    pub name: String,
    /// The ToR its RNIC hangs off.
    #[arg(long)]
    pub tor: String,
    /// The address its UD queue pair binds (the IP is the RNIC's GID).
    #[arg(long)]
    pub rnic: SocketAddr,
    /// Upload results this often (milliseconds).
    #[arg(long, default_value_t = 1000)]
    pub upload_every: u64,
    /// Trace the paths to the targets this often (milliseconds; 0: never).
    #[arg(long, default_value_t = 30_000)]
    pub trace_every: u64,
    /// The mesh's certificate folder: the agent proves node NAME's identity
    /// (`node-NAME.pem`) to an https:// controller.
    #[arg(long)]
    pub certs: Option<PathBuf>,
    /// The trust domain of the certificates.
    #[arg(long, default_value = "dpumesh.local")]
    pub trust_domain: String,
}

/// `dpumesh pingmesh agent`: one agent on the software fabric.
pub fn pingmesh_agent(args: &AgentArgs) -> Result<()> {
    let AgentArgs {
        controller,
        name,
        tor,
        rnic,
        upload_every,
        trace_every,
        certs,
        trust_domain,
    } = args;
    let tls = match certs {
        Some(dir) => {
            let id = dpumesh_identity::SpiffeId::node(trust_domain, name)
                .with_context(|| format!("node {name:?} cannot have a SPIFFE ID"))?;
            Some(
                dpumesh_identity::MeshTls::load(
                    dpumesh_identity::TlsFiles::in_dir(dir, &id),
                    trust_domain,
                )
                .with_context(|| format!("no usable certificate for {id} in {}", dir.display()))?,
            )
        }
        None => None,
    };
    match (controller.starts_with("https://"), tls.is_some()) {
        (false, true) => anyhow::bail!(
            "{controller}: --certs is for an https:// controller (this one would be plaintext)"
        ),
        (true, false) => anyhow::bail!(
            "{controller}: an https:// controller needs --certs (the node's certificates)"
        ),
        _ => {}
    }
    let agent = dpumesh_pingmesh::agent::Agent::start(
        SoftFabric::new(),
        dpumesh_pingmesh::agent::AgentConfig {
            agent_id: name.to_owned(),
            tor_id: tor.to_owned(),
            bind: *rnic,
            agent_ip: rnic.ip().to_string(),
            controller: controller.to_owned(),
            analyzer: controller.to_owned(),
            tls,
            refresh_every: std::time::Duration::from_secs(2),
            upload_every: std::time::Duration::from_millis((*upload_every).max(10)),
            connections: None,
            trace_every: (*trace_every > 0).then(|| std::time::Duration::from_millis(*trace_every)),
            probe: true,
            two_acks: false,
            clock: dpumesh_clock::SystemClock::shared(),
        },
    )?;
    say!(
        "{READY} pingmesh agent {name} gid {} qpn {} port {}",
        agent.rnic().gid,
        agent.rnic().qpn,
        agent.rnic().udp_port
    );
    wait_for_signal()?;
    drop(agent);
    Ok(())
}

/// `dpumesh certs`.
/// A token `dpumesh certs` prints on stdout (alone, for `$(...)`).
#[derive(Debug)]
pub enum PrintToken {
    /// The nodes' admin token.
    Admin,
    /// A service's registration token.
    Service(String),
}

pub fn certs(
    file: &Path,
    rotate: bool,
    secrets: Option<&Path>,
    system_namespace: &str,
    print: Option<PrintToken>,
) -> Result<()> {
    let mesh = MeshFile::read(file)?;
    if mesh.config.identity.mtls == dpumesh_config::Mtls::Off {
        anyhow::bail!(
            "{}: identity.mtls is off: the mesh uses no certificates",
            file.display()
        );
    }
    // With a token to print, stdout holds the token alone (`$(dpumesh certs ...)`).
    let tell = |text: String| {
        if print.is_some() {
            say_err!("{text}");
        } else {
            say!("{text}");
        }
    };
    for id in dpumesh_proxy::trust::issue(&mesh, rotate)? {
        tell(format!("issued {id}"));
    }
    tell(format!(
        "certificates in {}",
        dpumesh_proxy::trust::certs_dir(&mesh).display()
    ));
    if let Some(out) = secrets {
        let written = crate::secrets::write(&mesh, out, system_namespace)?;
        tell(format!(
            "{} Kubernetes Secrets in {} (kubectl apply -k {})",
            written.len() - 1,
            out.display(),
            out.display()
        ));
    }
    if let Some(print) = print {
        let key = dpumesh_proxy::trust::registration_key(&mesh)?
            .context("the mesh has no registration key")?;
        let token = match print {
            PrintToken::Admin => dpumesh_identity::admin::admin_token(&key),
            PrintToken::Service(service) => {
                anyhow::ensure!(
                    mesh.config.services.contains_key(&service),
                    "{}: no service {service:?} in the mesh",
                    file.display()
                );
                key.token(&service)
            }
        };
        say!("{token}");
    }
    Ok(())
}

/// Where the ingress binds and what fabric it uses, where the orchestrator says
/// otherwise than the mesh file.
#[derive(Debug, Default)]
pub struct IngressOptions {
    pub listen: Option<SocketAddr>,
    pub admin: Option<SocketAddr>,
    pub transport: Option<Transport>,
    pub certs: Option<PathBuf>,
}

/// `dpumesh ingress`.
pub fn ingress(mesh: &Path, options: &IngressOptions) -> Result<()> {
    let mut mesh = MeshFile::read(mesh)?;
    if options.certs.is_some() {
        mesh.config.identity.certs = options.certs.clone();
    }
    dpumesh_dpa::shm::sweep_orphans();
    let mut settings = ingress_settings(&mesh);
    settings.listen = options.listen.unwrap_or(settings.listen);
    settings.admin = options.admin.or(settings.admin);
    let tls = dpumesh_proxy::trust::load(&mesh, &dpumesh_proxy::trust::ingress_id(&mesh)?)?;
    let ingress = match options.transport.unwrap_or(mesh.config.transport) {
        Transport::Shm => {
            dpumesh_ingress::Ingress::start(ShmFabric::new().with_tls(tls), settings)?
        }
        Transport::Tcp => {
            dpumesh_ingress::Ingress::start(SoftFabric::new().with_tls(tls), settings)?
        }
    };
    say!("{READY} ingress {}", ingress.addr());
    wait_for_signal()?;
    drop(ingress);
    Ok(())
}
fn ingress_settings(mesh: &MeshFile) -> dpumesh_ingress::Settings {
    let i = &mesh.config.ingress;
    dpumesh_ingress::Settings {
        listen: i.listen,
        max_head: i.max_head(),
        max_body: i.max_body(),
        body_timeout: i.body_timeout(),
        header_timeout: i.header_timeout(),
        idle_timeout: i.idle_timeout(),
        park_after: i.park_after(),
        max_headers: i.max_headers(),
        request_timeout: i.request_timeout(),
        slots: i.slots(),
        slots_per_client: i.slots_per_client(),
        threads: i.threads,
        policy: mesh.config.policy.clone(),
        services: mesh.service_addrs(),
        admin: i.admin,
        path: i.path,
        eject: eject_settings(mesh),
        tls: i
            .tls
            .clone()
            .map(|files| dpumesh_ingress::tls::TlsSettings {
                files,
                trust_domain: mesh.config.identity.trust_domain().to_owned(),
            }),
    }
}

/// What the ingress needs to route around the nodes Pingmesh judges unreachable, if
/// any service asks for it.
fn eject_settings(mesh: &MeshFile) -> Option<dpumesh_ingress::eject::EjectSettings> {
    let pm = mesh.config.pingmesh.as_ref()?;
    let services: std::collections::BTreeSet<String> = mesh
        .config
        .services
        .iter()
        .filter(|(_, s)| s.eject_unreachable)
        .map(|(n, _)| n.clone())
        .collect();
    (!services.is_empty()).then(|| dpumesh_ingress::eject::EjectSettings {
        analyzer: pm.http,
        nodes: mesh
            .config
            .nodes
            .iter()
            .map(|(n, e)| (n.clone(), e.fabric))
            .collect(),
        services,
    })
}

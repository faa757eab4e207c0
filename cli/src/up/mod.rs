//! `dpumesh up`: the whole local mesh (nodes, service pods, ingress) as child processes,
//! each supervised: a process that dies is started again with backoff (see
//! [`restart`]) and the rest of the mesh keeps serving meanwhile; one that keeps dying
//! right after each start is reported with its last lines and left down. Ctrl-C stops
//! everything.

mod process;
mod restart;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use dpumesh_config::MeshFile;
use dpumesh_proxy::node::control_socket;

pub use process::READY;
use process::{Event, Process, Spec, State};
use restart::RestartPolicy;

/// How long a role may take to say it serves when the mesh starts.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// How often the supervisor looks at its processes.
const LOOK: Duration = Duration::from_millis(50);

/// A program named in the mesh file: beside this binary first, then as given.
fn program(name: &str) -> PathBuf {
    if !name.contains('/')
        && let Ok(me) = std::env::current_exe()
        && let Some(dir) = me.parent()
    {
        let beside = dir.join(name);
        if beside.is_file() {
            return beside;
        }
    }
    PathBuf::from(name)
}

/// A running local mesh.
pub struct Up {
    processes: Vec<Process>,
    /// The ingress's URL base (`http://addr` or, with `ingress.tls`, `https://addr`).
    pub ingress: String,
    /// Admin URLs by node.
    pub admins: BTreeMap<String, String>,
    /// The ingress's admin API, if the mesh file gives one.
    pub ingress_admin: Option<std::net::SocketAddr>,
    /// How the mesh proves who is who, for the banner.
    pub identity: String,
    /// The nodes' admin token (none without identities: no admin mutations then).
    pub admin_token: Option<String>,
    /// The Pingmesh dashboard and JSON API, when `dpumesh up` runs the analyzer.
    pub pingmesh: Option<String>,
    /// Nodes that did not come up at the start.
    down: std::collections::BTreeSet<String>,
    // Dropped last: the nodes' control sockets live here.
    run_dir: tempfile::TempDir,
}

impl Up {
    /// Starts every node, every service replica and the ingress of `mesh`.
    pub fn start(file: &Path) -> Result<Self> {
        let mesh = MeshFile::read(file)?;
        // Before any process starts: each loads its certificate.
        let issued = dpumesh_proxy::trust::issue(&mesh, false)?;
        let registration = dpumesh_proxy::trust::registration_key(&mesh)?;
        // The demo's token key too: the policy reads it, so it exists before a node.
        if let Some(demo) = DemoToken::read(file)? {
            demo.ensure_key()?;
        }
        if !issued.is_empty() {
            say_err!(
                "dpumesh up: issued {} certificate(s) into {}",
                issued.len(),
                dpumesh_proxy::trust::certs_dir(&mesh).display()
            );
        }
        let run_dir = tempfile::Builder::new().prefix("dpumesh-up").tempdir()?;
        let me = std::env::current_exe()?;
        let policy = RestartPolicy::default();
        let mut up = Self {
            processes: Vec::new(),
            ingress: String::new(),
            admins: BTreeMap::new(),
            ingress_admin: mesh.config.ingress.admin,
            identity: match mesh.config.identity.mtls {
                dpumesh_config::Mtls::Mutual => format!(
                    "mutual TLS, trust domain {}, certificates in {}",
                    mesh.config.identity.trust_domain(),
                    dpumesh_proxy::trust::certs_dir(&mesh).display()
                ),
                dpumesh_config::Mtls::Off => {
                    "OFF: fabric links are not authenticated (identity.mtls: off)".to_owned()
                }
            },
            pingmesh: None,
            admin_token: registration
                .as_ref()
                .map(dpumesh_identity::admin::admin_token),
            down: Default::default(),
            run_dir,
        };
        let run = up.run_dir.path().to_owned();
        // Pods start in the mesh file's folder, so a command's relative paths (a Python
        // app's module, a config file) mean what they mean beside the mesh file.
        let pods_dir = std::path::absolute(file)?
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("."));
        // `up` labels and interleaves its children's lines for a person to read: they
        // log text (their stderr is a pipe, where they would choose JSON), unless the
        // person asked otherwise.
        let log_format = std::env::var("DPUMESH_LOG_FORMAT").unwrap_or_else(|_| "text".to_owned());
        // A node with a network namespace runs (with its pods) inside it.
        let in_netns = |name: String, node: &str, program: &Path| -> Spec {
            match mesh.config.nodes.get(node).and_then(|e| e.netns.as_deref()) {
                Some(ns) => Spec::new(name, "ip")
                    .args(["netns", "exec", ns])
                    .args([program]),
                None => Spec::new(name, program),
            }
            .env("DPUMESH_LOG_FORMAT", &log_format)
        };
        // The controller first: agents register as their nodes start (they retry if
        // it is late, or restarted).
        if let Some(pm) = mesh
            .config
            .pingmesh
            .as_ref()
            .filter(|p| p.controller.is_none())
        {
            let spec = Spec::new("pingmesh", &me)
                .args(["pingmesh", "server", "--mesh"])
                .args([file])
                .env("DPUMESH_LOG_FORMAT", &log_format);
            let mut server = Process::start(spec, policy)?;
            match server.wait_ready(START_TIMEOUT) {
                Ok(line) => {
                    let http = line.rsplit(' ').next().unwrap_or_default().to_owned();
                    up.pingmesh = Some(format!("http://{http}/"));
                }
                Err(e) => {
                    say_err!("dpumesh up: {e:#}");
                    up.pingmesh = Some(format!("http://{}/", pm.http));
                }
            }
            up.processes.push(server);
        }
        // The BlueField split in software (`DPUMESH_DATA_PATH=split`, which the nodes
        // read too): each node listens beside its pods' socket, and a host agent on
        // that socket makes the pods' memory and registers them with the node.
        let split = std::env::var("DPUMESH_DATA_PATH").is_ok_and(|v| v == "split");
        for (name, entry) in &mesh.config.nodes {
            let mut spec = in_netns(format!("node {name}"), name, &me)
                .args(["node", "--mesh"])
                .args([file])
                .args(["--name", name, "--run-dir"])
                .args([&run])
                // Every node runs on this machine: they share its cores.
                .args(["--colocated", &mesh.config.nodes.len().to_string()]);
            let dpu_socket = run.join(format!("{name}-dpu.sock"));
            if split {
                spec = spec.args([format!("--control=unix:{}", dpu_socket.display())]);
            }
            let mut node = Process::start(spec, policy)?;
            // A node that cannot start is the supervisor's to start again (or give up
            // on): the rest of the mesh comes up without it.
            if let Err(e) = node.wait_ready(START_TIMEOUT) {
                say_err!("dpumesh up: {e:#}");
                up.down.insert(name.clone());
            }
            up.processes.push(node);
            if split {
                let spec = in_netns(format!("host {name}"), name, &me)
                    .args(["host", "--node"])
                    .args([&dpu_socket])
                    .args(["--listen"])
                    .args([control_socket(&run, name)])
                    .args(["--name", name]);
                let mut host = Process::start(spec, policy)?;
                if let Err(e) = host.wait_ready(START_TIMEOUT) {
                    say_err!("dpumesh up: {e:#}");
                }
                up.processes.push(host);
            }
            if let Some(a) = entry.admin {
                up.admins.insert(name.clone(), format!("http://{a}/"));
            }
        }
        for (service, entry) in &mesh.config.services {
            // A bridged service's pod is a bridge; its command (if any) is the
            // unmodified server, started first, once (the config allows one pod).
            let pod_program = match &entry.bridge {
                Some(bridge) => {
                    if let Some((command, args)) = entry.command.split_first() {
                        let node = &entry.nodes[0];
                        let mut spec =
                            in_netns(format!("server {service}"), node, &program(command))
                                .args(args)
                                .current_dir(&pods_dir);
                        if let Some(egress) = bridge.egress {
                            let proxy = format!("http://{egress}");
                            spec = spec
                                .env("DPUMESH_EGRESS", egress.to_string())
                                .env("HTTP_PROXY", &proxy)
                                .env("http_proxy", &proxy);
                        }
                        up.processes.push(Process::start(spec, policy)?);
                    }
                    let mut args = vec![
                        "bridge".to_owned(),
                        "--to".to_owned(),
                        bridge.to.clone(),
                        "--protocol".to_owned(),
                        bridge.protocol.name().to_owned(),
                    ];
                    if let Some(egress) = bridge.egress {
                        args.extend(["--egress".to_owned(), egress.to_string()]);
                    }
                    if !entry.command.is_empty() {
                        // Its server starts beside it: joined once it listens.
                        args.extend(["--wait".to_owned(), START_TIMEOUT.as_secs().to_string()]);
                    }
                    Some((me.clone(), args))
                }
                None => entry
                    .command
                    .split_first()
                    .map(|(command, args)| (program(command), args.to_vec())),
            };
            let Some((pod_program, args)) = pod_program else {
                continue;
            };
            for node in &entry.nodes {
                for replica in 0..entry.replicas.unwrap_or(1) {
                    let pod = format!("{service}-{node}-{replica}");
                    let mut spec = in_netns(format!("pod {pod}"), node, &pod_program)
                        .args(&args)
                        .current_dir(&pods_dir)
                        .env("DPUMESH_CONTROL", control_socket(&run, node))
                        .env("DPUMESH_SERVICE", service)
                        .env("DPUMESH_POD", &pod)
                        .env(
                            dpumesh_dpa::poll::ENV,
                            dpumesh_proxy::node::polling(&mesh.config.polling).to_string(),
                        );
                    if let Some(key) = &registration {
                        spec = spec.env("DPUMESH_TOKEN", key.token(service));
                    }
                    up.processes.push(Process::start(spec, policy)?);
                }
            }
        }
        let spec = Spec::new("ingress", &me)
            .args(["ingress", "--mesh"])
            .args([file])
            .env("DPUMESH_LOG_FORMAT", &log_format);
        let mut ingress = Process::start(spec, policy)?;
        let addr = match ingress.wait_ready(START_TIMEOUT) {
            Ok(line) => line.rsplit(' ').next().unwrap_or_default().to_owned(),
            Err(e) => {
                say_err!("dpumesh up: {e:#}");
                mesh.config.ingress.listen.to_string()
            }
        };
        let scheme = if mesh.config.ingress.tls.is_some() {
            "https"
        } else {
            "http"
        };
        up.ingress = format!("{scheme}://{addr}");
        up.processes.push(ingress);
        up.wait_for_pods(&mesh);
        Ok(up)
    }

    /// Waits until every service's pods registered with the nodes that came up; says
    /// which did not (the mesh serves without them meanwhile).
    fn wait_for_pods(&self, mesh: &MeshFile) {
        use dpumesh_dpa::control::Role;
        use dpumesh_dpa::control::transport::{ControlClient, Endpoint};
        let deadline = Instant::now() + START_TIMEOUT;
        for (service, entry) in &mesh.config.services {
            if !entry.has_pods() {
                continue;
            }
            for node in entry.nodes.iter().filter(|n| !self.down.contains(*n)) {
                let endpoint = Endpoint::Unix(control_socket(self.run_dir.path(), node));
                let want = entry.replicas.unwrap_or(1) as usize;
                let mut have = 0;
                while Instant::now() < deadline {
                    have = ControlClient::connect(&endpoint, Role::Dpu, "dpumesh-up")
                        .and_then(|mut c| c.resolve(service))
                        .map_or(0, |pods| pods.len());
                    if have >= want {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                if have < want {
                    say_err!(
                        "dpumesh up: {service} on {node}: {have} of {want} pods registered \
                         after {} s",
                        START_TIMEOUT.as_secs()
                    );
                }
            }
        }
    }

    /// One look at every process: the dead are started again (or given up on), and
    /// what happened is said on stderr.
    pub fn supervise(&mut self) {
        let now = Instant::now();
        for p in &mut self.processes {
            for event in p.supervise(now) {
                report(p.name(), &event);
                // A process left down has no successor to sweep what it left.
                if matches!(event, Event::GaveUp { .. }) {
                    dpumesh_dpa::shm::sweep_orphans();
                }
            }
        }
    }

    /// What was restarted and what was given up on, for the last words.
    fn summary(&self) -> Vec<String> {
        self.processes
            .iter()
            .filter(|p| p.restarts() > 0 || p.state() == State::GaveUp)
            .map(|p| match p.state() {
                State::GaveUp => {
                    format!("{} (left down after {} restarts)", p.name(), p.restarts())
                }
                _ => format!("{} ({} restarts)", p.name(), p.restarts()),
            })
            .collect()
    }
}

/// Says what happened to a process.
fn report(name: &str, event: &Event) {
    match event {
        Event::Died { status, delay } => {
            say_err!("dpumesh up: {name} exited ({status}); starting it again in {delay:.1?}")
        }
        Event::Restarted { count } => {
            say_err!("dpumesh up: {name} started again (restart {count})")
        }
        Event::Serving { after } => {
            say_err!("dpumesh up: {name} serves again, {after:.1?} after it died")
        }
        Event::SpawnFailed(e) => say_err!("dpumesh up: {e}"),
        Event::GaveUp {
            status,
            quick_deaths,
            tail,
        } => {
            say_err!(
                "dpumesh up: {name} died {quick_deaths} times right after starting (last: \
                 {status}); it is left down and the rest of the mesh keeps serving. Its last \
                 lines:"
            );
            for line in tail {
                say_err!("    {line}");
            }
        }
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        for p in &self.processes {
            p.terminate();
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        for p in &mut self.processes {
            p.reap(deadline);
        }
        // Whatever a child killed at the end (or earlier) left behind.
        dpumesh_dpa::shm::sweep_orphans();
    }
}

/// `dpumesh up`.
pub fn up(file: &Path) -> Result<()> {
    let mut up = Up::start(file)?;
    say!("DPUmesh is up.");
    say!("  ingress   {}/", up.ingress);
    if let Some(a) = up.ingress_admin {
        say!("  ingress admin http://{a}/  (/healthz /readyz /nodes /metrics)");
    }
    say!("  identity  {}", up.identity);
    if let Some(url) = &up.pingmesh {
        say!("  pingmesh  {url}  (dashboard; JSON: /v1/report /v1/problems /v1/heatmap /v1/sla)");
    }
    for (node, url) in &up.admins {
        say!("  admin     {url}  ({node}: /healthz /readyz /metrics /filters, POST /reload)");
    }
    if let Some(token) = &up.admin_token {
        say!(
            "  admin token (POST /reload, DELETE /store, DELETE /cache): authorization: Bearer {token}"
        );
    }
    if let Some(token) = DemoToken::read(file)?.map(|d| d.sign()).transpose()? {
        say!("  try:");
        say!(
            "    curl -s -H 'authorization: Bearer {token}' '{}/hotels?user=7'",
            up.ingress
        );
    }
    say!("A process that dies is started again. Ctrl-C stops everything.");
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    std::thread::spawn(move || {
        let _ = crate::roles::wait_for_signal();
        flag.store(true, Ordering::SeqCst);
    });
    while !stop.load(Ordering::SeqCst) {
        up.supervise();
        std::thread::sleep(LOOK);
    }
    let summary = up.summary();
    if !summary.is_empty() {
        say!("restarted while up: {}", summary.join(", "));
    }
    say!("stopping...");
    drop(up);
    Ok(())
}

/// The README's curl token, when the mesh file's folder has `demo-token.json`:
/// `{"key_file": "...", "claims": {...}}`, signed HS256 for an hour with the key in
/// `key_file` (relative to that folder; the policy's key set reads the same file).
/// The key is made fresh for each mesh, beside its certificates: no key in the
/// repository is one a mesh accepts.
struct DemoToken {
    key: std::path::PathBuf,
    claims: serde_json::Value,
}

impl DemoToken {
    fn read(mesh: &Path) -> Result<Option<Self>> {
        let dir = mesh.parent().unwrap_or(Path::new("."));
        let file = dir.join("demo-token.json");
        let Ok(text) = std::fs::read_to_string(&file) else {
            return Ok(None);
        };
        let v: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("{}", file.display()))?;
        let key = v["key_file"]
            .as_str()
            .with_context(|| format!("{}: no key_file", file.display()))?;
        Ok(Some(Self {
            key: dir.join(key),
            claims: v["claims"].clone(),
        }))
    }

    /// Makes the key if the mesh has none yet.
    fn ensure_key(&self) -> Result<()> {
        if dpumesh_identity::ca::ensure_secret(&self.key)? {
            say_err!("dpumesh up: made the demo token key {}", self.key.display());
        }
        Ok(())
    }

    /// A token with the claims, valid for an hour.
    fn sign(self) -> Result<String> {
        let secret = std::fs::read(&self.key)
            .with_context(|| format!("the demo token key {}", self.key.display()))?;
        let mut claims = self.claims;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_secs();
        claims["iat"] = now.into();
        claims["exp"] = (now + 3600).into();
        Ok(jsonwebtoken::encode(
            &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
            &claims,
            &jsonwebtoken::EncodingKey::from_secret(&secret),
        )?)
    }
}

//! `dpumesh node`, `dpumesh ingress` and `dpumesh up`: one role per process, and the
//! whole local mesh (ingress, nodes, sample services) as child processes of `up`.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use dpumesh_config::MeshFile;
use dpumesh_config::Transport;
use dpumesh_dpa::fabric::shm::ShmFabric;
use dpumesh_dpa::fabric::soft::SoftFabric;
use dpumesh_proxy::node::{Node, control_socket};

/// The line a role prints on stdout once it serves (what `up` waits for).
const READY: &str = "dpumesh-ready";

fn wait_for_signal() -> Result<()> {
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
pub fn node(mesh: &Path, name: &str, run_dir: &Path) -> Result<()> {
    let mesh = MeshFile::read(mesh)?;
    std::fs::create_dir_all(run_dir)?;
    let node = Node::start(&mesh, name, run_dir)?;
    println!(
        "{READY} node {name} fabric {} control {} admin {}",
        node.fabric_addr(),
        node.control_socket().display(),
        node.admin_addr().map_or("-".to_owned(), |a| a.to_string())
    );
    wait_for_signal()?;
    drop(node);
    Ok(())
}

/// `dpumesh ingress`.
pub fn ingress(mesh: &Path) -> Result<()> {
    let mesh = MeshFile::read(mesh)?;
    let settings = ingress_settings(&mesh);
    let ingress = match mesh.config.transport {
        Transport::Shm => dpumesh_ingress::Ingress::start(ShmFabric::new(), settings)?,
        Transport::Tcp => dpumesh_ingress::Ingress::start(SoftFabric::new(), settings)?,
    };
    println!("{READY} ingress {}", ingress.addr());
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
        request_timeout: i.request_timeout(),
        slots: i.slots(),
        threads: i.threads,
        policy: mesh.config.policy.clone(),
        services: mesh.service_addrs(),
    }
}

/// Children that are killed (TERM, then KILL) when dropped.
struct Children(Vec<(String, Child)>);

impl Drop for Children {
    fn drop(&mut self) {
        for (_, child) in &self.0 {
            let _ = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        for (name, child) in &mut self.0 {
            loop {
                match child.try_wait() {
                    Ok(Some(_)) => break,
                    Ok(None) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(20))
                    }
                    _ => {
                        tracing::warn!(name, "did not stop: killed");
                        let _ = child.kill();
                        let _ = child.wait();
                        break;
                    }
                }
            }
        }
    }
}

/// Starts `cmd` and waits for its ready line; its later output is passed through.
fn start_role(name: &str, mut cmd: Command, children: &mut Children) -> Result<String> {
    cmd.stdout(Stdio::piped());
    let mut child = cmd
        .spawn()
        .with_context(|| format!("cannot start {name}"))?;
    let stdout = child.stdout.take().expect("piped");
    children.0.push((name.to_owned(), child));
    let (tx, rx) = std::sync::mpsc::channel();
    let label = name.to_owned();
    std::thread::spawn(move || {
        let mut tx = Some(tx);
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if line.starts_with(READY) {
                if let Some(tx) = tx.take() {
                    let _ = tx.send(line);
                }
            } else {
                println!("[{label}] {line}");
            }
        }
    });
    match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(line) => Ok(line),
        Err(_) => bail!("{name} did not become ready within 60 s (see its output above)"),
    }
}

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

/// How to start a service pod again (a pod that dies is restarted, as a Deployment
/// would).
struct PodSpec {
    name: String,
    program: PathBuf,
    args: Vec<String>,
    env: Vec<(String, PathBuf)>,
}

impl PodSpec {
    fn spawn(&self) -> Result<Child> {
        let mut cmd = Command::new(&self.program);
        cmd.args(&self.args).stdout(Stdio::inherit());
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        cmd.spawn()
            .with_context(|| format!("cannot start {}: {}", self.name, self.program.display()))
    }
}

/// A running local mesh.
pub struct Up {
    children: Children,
    pods: Vec<PodSpec>,
    /// The ingress address.
    pub ingress: String,
    /// Admin URLs by node.
    pub admins: BTreeMap<String, String>,
    _run_dir: tempfile::TempDir,
}

impl Up {
    /// Starts every node, every service replica and the ingress of `mesh`.
    pub fn start(file: &Path) -> Result<Self> {
        let mesh = MeshFile::read(file)?;
        let run_dir = tempfile::Builder::new().prefix("dpumesh-up").tempdir()?;
        let me = std::env::current_exe()?;
        let mut children = Children(Vec::new());
        let mut admins = BTreeMap::new();
        // A node with a network namespace runs (with its pods) inside it.
        let in_netns = |node: &str, program: &Path| -> Command {
            match mesh.config.nodes.get(node).and_then(|e| e.netns.as_deref()) {
                Some(ns) => {
                    let mut cmd = Command::new("ip");
                    cmd.args(["netns", "exec", ns]).arg(program);
                    cmd
                }
                None => Command::new(program),
            }
        };
        for (name, entry) in &mesh.config.nodes {
            let mut cmd = in_netns(name, &me);
            cmd.args(["node", "--mesh"])
                .arg(file)
                .args(["--name", name, "--run-dir"])
                .arg(run_dir.path());
            start_role(&format!("node {name}"), cmd, &mut children)?;
            if let Some(a) = entry.admin {
                admins.insert(name.clone(), format!("http://{a}/"));
            }
        }
        let mut pods = Vec::new();
        for (service, entry) in &mesh.config.services {
            if entry.command.is_empty() {
                continue;
            }
            for node in &entry.nodes {
                for replica in 0..entry.replicas.unwrap_or(1) {
                    let pod = format!("{service}-{node}-{replica}");
                    let (prog, mut args) =
                        (program(&entry.command[0]), entry.command[1..].to_vec());
                    let (prog, args) =
                        match mesh.config.nodes.get(node).and_then(|e| e.netns.clone()) {
                            Some(ns) => {
                                let mut all = vec![
                                    "netns".to_owned(),
                                    "exec".to_owned(),
                                    ns,
                                    prog.display().to_string(),
                                ];
                                all.append(&mut args);
                                (PathBuf::from("ip"), all)
                            }
                            None => (prog, args),
                        };
                    let spec = PodSpec {
                        name: pod.clone(),
                        program: prog,
                        args,
                        env: vec![
                            (
                                "DPUMESH_CONTROL".into(),
                                control_socket(run_dir.path(), node),
                            ),
                            ("DPUMESH_SERVICE".into(), PathBuf::from(service)),
                            ("DPUMESH_POD".into(), PathBuf::from(&pod)),
                            (
                                dpumesh_dpa::poll::ENV.into(),
                                PathBuf::from(
                                    dpumesh_proxy::node::polling(&mesh.config.polling).to_string(),
                                ),
                            ),
                        ],
                    };
                    children.0.push((pod, spec.spawn()?));
                    pods.push(spec);
                }
            }
        }
        let mut cmd = Command::new(&me);
        cmd.args(["ingress", "--mesh"]).arg(file);
        let line = start_role("ingress", cmd, &mut children)?;
        let ingress = line.rsplit(' ').next().unwrap_or_default().to_owned();
        let up = Self {
            children,
            pods,
            ingress,
            admins,
            _run_dir: run_dir,
        };
        up.wait_for_pods(&mesh, up._run_dir.path())?;
        Ok(up)
    }

    /// Waits until every service's pods registered with their nodes.
    fn wait_for_pods(&self, mesh: &MeshFile, run_dir: &Path) -> Result<()> {
        use dpumesh_dpa::control::Role;
        use dpumesh_dpa::control::transport::{ControlClient, Endpoint};
        let deadline = Instant::now() + Duration::from_secs(60);
        for (service, entry) in &mesh.config.services {
            if entry.command.is_empty() {
                continue;
            }
            for node in &entry.nodes {
                let endpoint = Endpoint::Unix(control_socket(run_dir, node));
                let mut client = ControlClient::connect(&endpoint, Role::Dpu, "dpumesh-up")
                    .with_context(|| format!("cannot reach node {node}"))?;
                let want = entry.replicas.unwrap_or(1) as usize;
                loop {
                    let have = client.resolve(service)?.len();
                    if have >= want {
                        break;
                    }
                    if Instant::now() > deadline {
                        bail!("{service} on {node}: {have} of {want} pods registered after 60 s");
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
        Ok(())
    }

    /// Restarts service pods that died; fails if a node or the ingress did.
    pub fn check(&mut self) -> Result<()> {
        for (name, child) in &mut self.children.0 {
            let Some(status) = child.try_wait()? else {
                continue;
            };
            let Some(spec) = self.pods.iter().find(|p| p.name == *name) else {
                bail!("{name} exited: {status}");
            };
            eprintln!("dpumesh up: pod {name} exited ({status}); starting it again");
            *child = spec.spawn()?;
        }
        Ok(())
    }
}

/// `dpumesh up`.
pub fn up(file: &Path) -> Result<()> {
    let mut up = Up::start(file)?;
    println!("DPUmesh is up.");
    println!("  ingress   http://{}/", up.ingress);
    for (node, url) in &up.admins {
        println!("  admin     {url}  ({node}: /healthz /metrics /filters, POST /reload)");
    }
    if let Some(token) = demo_token(file)? {
        println!("  try:");
        println!(
            "    curl -s -H 'authorization: Bearer {token}' 'http://{}/hotels?user=7'",
            up.ingress
        );
    }
    println!("Ctrl-C stops everything.");
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    std::thread::spawn(move || {
        let _ = wait_for_signal();
        flag.store(true, Ordering::SeqCst);
    });
    while !stop.load(Ordering::SeqCst) {
        if let Err(e) = up.check() {
            eprintln!("dpumesh up: {e}; stopping the mesh");
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    println!("stopping...");
    drop(up);
    Ok(())
}

/// A token for the README's curl, when the mesh file's folder has `demo-token.json`
/// (`{"secret": "...", "claims": {...}}`, signed HS256 for an hour).
fn demo_token(mesh: &Path) -> Result<Option<String>> {
    let file = mesh
        .parent()
        .unwrap_or(Path::new("."))
        .join("demo-token.json");
    let Ok(text) = std::fs::read_to_string(&file) else {
        return Ok(None);
    };
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{}", file.display()))?;
    let secret = v["secret"].as_str().context("demo-token.json: no secret")?;
    let mut claims = v["claims"].clone();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs();
    claims["iat"] = now.into();
    claims["exp"] = (now + 3600).into();
    let token = jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &claims,
        &jsonwebtoken::EncodingKey::from_secret(secret.as_bytes()),
    )?;
    Ok(Some(token))
}

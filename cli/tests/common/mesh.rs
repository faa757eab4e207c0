//! The hotel sample under `dpumesh up` as the end-to-end tests drive it: its files with
//! free ports, the running mesh, a plain HTTP/1.1 client, a load generator and the
//! nodes' admin API. Each test binary uses the part it needs.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::free_port;

/// Status, headers (lowercase names), body.
pub type Reply = (u16, Vec<(String, String)>, Vec<u8>);

/// `dpumesh certs --config <mesh> <args>`: what an operator runs to issue the mesh's
/// certificates (and write its Secrets).
pub fn certs(mesh: &Path, args: &[&std::ffi::OsStr]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_dpumesh"))
        .args(["certs".as_ref(), "--config".as_ref(), mesh.as_os_str()])
        .args(args)
        .output()
        .expect("dpumesh runs")
}

/// The sample's files with this build's components and free ports; `edit` may
/// change the mesh file's text last.
pub fn mesh_files(dir: &Path, edit: impl Fn(String) -> String) -> (PathBuf, SocketAddr) {
    mesh_files_with(dir, edit, |p| p)
}

/// [`mesh_files`] with the policy edited by `policy` too.
pub fn mesh_files_with(
    dir: &Path,
    edit: impl Fn(String) -> String,
    policy: impl Fn(String) -> String,
) -> (PathBuf, SocketAddr) {
    let sample = super::sample();
    super::write_policy_with(dir, policy);
    let mut mesh = std::fs::read_to_string(sample.join("mesh.yaml")).unwrap();
    let ingress: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    for (from, to) in [
        ("127.0.0.1:8000".to_owned(), ingress.to_string()),
        (
            "127.0.0.1:7101".to_owned(),
            format!("127.0.0.1:{}", free_port()),
        ),
        (
            "127.0.0.1:7102".to_owned(),
            format!("127.0.0.1:{}", free_port()),
        ),
        (
            "127.0.0.1:9110".to_owned(),
            format!("127.0.0.1:{}", free_port()),
        ),
        (
            "127.0.0.1:9101".to_owned(),
            format!("127.0.0.1:{}", free_port()),
        ),
        (
            "127.0.0.1:9102".to_owned(),
            format!("127.0.0.1:{}", free_port()),
        ),
        (
            "127.0.0.1:9470".to_owned(),
            format!("127.0.0.1:{}", free_port()),
        ),
        (
            "127.0.0.1:9471".to_owned(),
            format!("127.0.0.1:{}", free_port()),
        ),
        // UDP: any free port (agents register the one they got).
        (":4791}".to_owned(), ":0}".to_owned()),
        (
            "request_timeout: 10s".to_owned(),
            "request_timeout: 5s".to_owned(),
        ),
    ] {
        mesh = mesh.replace(&from, &to);
    }
    let file = dir.join("mesh.yaml");
    std::fs::write(&file, edit(mesh)).unwrap();
    std::fs::copy(sample.join("demo-token.json"), dir.join("demo-token.json")).unwrap();
    (file, ingress)
}

pub struct Mesh {
    pub child: Child,
    pub ingress: SocketAddr,
    pub admins: Vec<SocketAddr>,
    /// The ingress's admin API.
    pub ingress_admin: Option<SocketAddr>,
    /// The Pingmesh dashboard and JSON API (`dpumesh up` runs the analyzer).
    pub pingmesh: Option<SocketAddr>,
    /// What `dpumesh up` said on stderr so far (it is passed through too).
    pub log: std::sync::Arc<std::sync::Mutex<String>>,
    /// What it printed when it was ready (addresses, tokens, the curl to try).
    pub banner: String,
    pub _dir: tempfile::TempDir,
}

impl Mesh {
    /// The hotel sample as it is.
    pub fn up() -> Self {
        Self::up_with(|m| m)
    }

    /// The hotel sample with its mesh file edited by `edit`.
    pub fn up_with(edit: impl Fn(String) -> String) -> Self {
        Self::up_edited(edit, |p| p)
    }

    /// The hotel sample with its mesh file edited by `edit` and its policy by `policy`.
    pub fn up_edited(edit: impl Fn(String) -> String, policy: impl Fn(String) -> String) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let (file, ingress) = mesh_files_with(dir.path(), edit, policy);
        Self::start(dir, &file, ingress)
    }

    /// `dpumesh up --config <file>` (a mesh file in `dir`, its ingress on `ingress`),
    /// ready when it says so.
    pub fn start(dir: tempfile::TempDir, file: &Path, ingress: SocketAddr) -> Self {
        Self::start_env(dir, file, ingress, &[])
    }

    /// [`Self::start`] with `env` set for `dpumesh up` (and so for what it starts).
    pub fn start_env(
        dir: tempfile::TempDir,
        file: &Path,
        ingress: SocketAddr,
        env: &[(&str, &str)],
    ) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_dpumesh"))
            .args(["up", "--config"])
            .arg(file)
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let (stderr, kept) = (child.stderr.take().unwrap(), log.clone());
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stderr)
                .lines()
                .map_while(Result::ok)
            {
                eprintln!("{line}");
                let mut kept = kept.lock().unwrap();
                kept.push_str(&line);
                kept.push('\n');
            }
        });
        let mut mesh = Self {
            child,
            ingress,
            admins: Vec::new(),
            ingress_admin: None,
            pingmesh: None,
            log,
            banner: String::new(),
            _dir: dir,
        };
        // Ready when `up` says so.
        let banner = super::banner(mesh.child.stdout.take().unwrap());
        mesh.banner = banner.clone();
        assert!(
            banner.contains(&format!("://{}/", mesh.ingress)),
            "{banner}"
        );
        assert!(banner.contains("curl"), "a ready-to-paste curl: {banner}");
        mesh.admins = banner
            .lines()
            .filter_map(|l| l.trim().strip_prefix("admin"))
            .filter_map(|l| l.trim().strip_prefix("http://"))
            .filter_map(|l| l.split('/').next()?.parse().ok())
            .collect();
        assert_eq!(mesh.admins.len(), 2, "{banner}");
        mesh.ingress_admin = banner
            .lines()
            .filter_map(|l| l.trim().strip_prefix("ingress admin http://"))
            .find_map(|l| l.split('/').next()?.parse().ok());
        mesh.pingmesh = banner
            .lines()
            .filter_map(|l| l.trim().strip_prefix("pingmesh"))
            .filter_map(|l| l.trim().strip_prefix("http://"))
            .find_map(|l| l.split('/').next()?.parse().ok());
        mesh
    }

    pub fn admins(&self) -> Vec<SocketAddr> {
        self.admins.clone()
    }

    /// The nodes' admin token.
    pub fn admin_token(&self) -> String {
        admin_token_of(self._dir.path())
    }

    /// A client of its ingress.
    pub fn client(&self) -> Client {
        Client(self.ingress)
    }

    pub fn raw(&self, request: &[u8]) -> Reply {
        self.client().raw(request)
    }

    pub fn get(&self, path: &str, token: Option<&str>) -> Reply {
        self.client().get(path, token)
    }

    pub fn post(&self, path: &str, token: &str, body: &[u8]) -> Reply {
        self.client().post(path, token, body)
    }
}

/// A plain HTTP/1.1 client of an ingress (one connection per request).
pub struct Client(pub SocketAddr);

impl Client {
    /// The response, or `None` if the connection failed or closed early.
    pub fn try_raw(&self, request: &[u8]) -> Option<Reply> {
        let mut s = TcpStream::connect(self.0).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(30))).ok()?;
        s.write_all(request).ok()?;
        read_response(&mut s)
    }

    pub fn raw(&self, request: &[u8]) -> Reply {
        self.try_raw(request).expect("a response")
    }

    fn get_request(path: &str, token: Option<&str>) -> Vec<u8> {
        let auth = token.map_or(String::new(), |t| format!("authorization: Bearer {t}\r\n"));
        format!("GET {path} HTTP/1.1\r\nhost: hotel\r\n{auth}connection: close\r\n\r\n")
            .into_bytes()
    }

    pub fn get(&self, path: &str, token: Option<&str>) -> Reply {
        self.raw(&Self::get_request(path, token))
    }

    /// The status of a GET, 0 if there was no answer.
    pub fn status(&self, path: &str, token: Option<&str>) -> u16 {
        self.try_raw(&Self::get_request(path, token))
            .map_or(0, |r| r.0)
    }

    pub fn post(&self, path: &str, token: &str, body: &[u8]) -> Reply {
        let mut r = format!(
            "POST {path} HTTP/1.1\r\nhost: hotel\r\nauthorization: Bearer {token}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
            body.len()
        )
        .into_bytes();
        r.extend_from_slice(body);
        self.raw(&r)
    }
}

impl Drop for Mesh {
    fn drop(&mut self) {
        super::stop(&mut self.child);
    }
}

/// Reads one HTTP/1.1 response: content-length framed (a whole answer) or chunked (a
/// streamed one).
pub fn read_response(s: &mut impl Read) -> Option<Reply> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 65536];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = s.read(&mut chunk).ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let status: u16 = lines.next()?.split(' ').nth(1)?.parse().ok()?;
    let headers: Vec<(String, String)> = lines
        .filter(|l| !l.is_empty())
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let mut body = buf[head_end..].to_vec();
    if headers
        .iter()
        .any(|(n, v)| n == "transfer-encoding" && v.eq_ignore_ascii_case("chunked"))
    {
        // A streamed answer: chunks until the last (empty) one.
        loop {
            if let Some(decoded) = dechunk(&body) {
                return Some((status, headers, decoded));
            }
            let n = s.read(&mut chunk).ok()?;
            if n == 0 {
                return None;
            }
            body.extend_from_slice(&chunk[..n]);
        }
    }
    let len: usize = headers
        .iter()
        .find(|(n, _)| n == "content-length")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    while body.len() < len {
        let n = s.read(&mut chunk).ok()?;
        if n == 0 {
            break;
        }
        body.extend_from_slice(&chunk[..n]);
    }
    Some((status, headers, body))
}

/// A chunked body's bytes, once its last chunk (and trailer section) arrived.
pub fn dechunk(mut b: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let line = b.windows(2).position(|w| w == b"\r\n")?;
        let size = std::str::from_utf8(&b[..line]).ok()?;
        let size = usize::from_str_radix(size.split(';').next()?.trim(), 16).ok()?;
        b = &b[line + 2..];
        if size == 0 {
            // Trailer fields, then an empty line.
            return b.windows(2).any(|w| w == b"\r\n").then_some(out);
        }
        if b.len() < size + 2 {
            return None;
        }
        out.extend_from_slice(&b[..size]);
        b = &b[size + 2..];
    }
}

pub fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
}

/// A load client's result: successes, failures (when, status; 0 for none), and the
/// longest any request took.
pub type ClientResult = (usize, Vec<(Instant, u16)>, Duration);

/// One GET of a load client: the status, 0 when any step of the exchange failed
/// (connect, write or read). Tests kill processes under load: a reset between connect
/// and write is what they provoke, so it is a failed request, never a panic.
fn load_request(addr: SocketAddr, request: &[u8]) -> Result<Reply, std::io::Error> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    s.write_all(request)?;
    read_response(&mut s).ok_or_else(|| std::io::ErrorKind::UnexpectedEof.into())
}

/// Runs `threads` clients doing GET `path` until `stop`; each returns its count of
/// successes and its failures (when, status; 0 for no response), and counts its
/// successes in `served` as they happen.
pub fn load(
    mesh: &Mesh,
    path: &str,
    token: &str,
    threads: usize,
    stop: &std::sync::Arc<std::sync::atomic::AtomicBool>,
    served: &std::sync::Arc<std::sync::atomic::AtomicUsize>,
) -> Vec<std::thread::JoinHandle<ClientResult>> {
    let request = format!(
        "GET {path} HTTP/1.1\r\nhost: hotel\r\nauthorization: Bearer {token}\r\nconnection: close\r\n\r\n"
    );
    (0..threads)
        .map(|i| {
            let (addr, request, stop, served) =
                (mesh.ingress, request.clone(), stop.clone(), served.clone());
            std::thread::Builder::new()
                .name(format!("load client {i}"))
                .spawn(move || {
                    let (mut ok, mut failed, mut slowest) = (0, Vec::new(), Duration::ZERO);
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let began = Instant::now();
                        match load_request(addr, request.as_bytes()) {
                            Ok((200, _, _)) => {
                                ok += 1;
                                served.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            }
                            Ok((status, _, body)) => {
                                if failed.len() < 3 {
                                    eprintln!(
                                        "failed with {status}: {}",
                                        String::from_utf8_lossy(&body)
                                    );
                                }
                                failed.push((Instant::now(), status));
                            }
                            Err(e) => {
                                failed.push((Instant::now(), 0));
                                // The ingress is down (a test killed it): not a busy
                                // loop while it is started again.
                                if e.kind() == std::io::ErrorKind::ConnectionRefused {
                                    std::thread::sleep(Duration::from_millis(10));
                                }
                            }
                        }
                        slowest = slowest.max(began.elapsed());
                    }
                    (ok, failed, slowest)
                })
                .expect("a thread for a load client")
        })
        .collect()
}

pub fn pids_of(parent: &str, pattern: &str) -> Vec<u32> {
    let out = Command::new("pgrep")
        .args(["-P", parent, "-f", pattern])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

/// GET `path` on an admin API: status and body.
pub fn admin_get(admin: SocketAddr, path: &str) -> (u16, String) {
    admin_call(admin, "GET", path)
}

/// `DELETE path` on an admin API, with the admin `token`: its status and body.
pub fn admin_delete(admin: SocketAddr, path: &str, token: &str) -> (u16, String) {
    try_admin_request(admin, "DELETE", path, &admin.to_string(), Some(token))
        .unwrap_or_else(|e| panic!("DELETE {path} on the admin API {admin}: {e}"))
}

/// The admin token of the mesh whose file is in `dir` (its certificates in
/// `.dpumesh/certs`), as `dpumesh certs --admin-token` tells it.
pub fn admin_token_of(dir: &Path) -> String {
    let key = dpumesh_identity::registration::RegistrationKey::load(&dir.join(".dpumesh/certs"))
        .expect("the mesh's registration key");
    dpumesh_identity::admin::admin_token(&key)
}

fn admin_call(admin: SocketAddr, method: &str, path: &str) -> (u16, String) {
    try_admin_call(admin, method, path)
        .unwrap_or_else(|e| panic!("{method} {path} on the admin API {admin}: {e}"))
}

/// One call to an admin API, or the I/O error that stopped it (a node being started
/// again is not listening yet: waits on its state treat that as "not yet").
pub fn try_admin_call(
    admin: SocketAddr,
    method: &str,
    path: &str,
) -> Result<(u16, String), std::io::Error> {
    try_admin_request(admin, method, path, &admin.to_string(), None)
}

/// One call to an admin API with the `Host` and bearer `token` given.
pub fn try_admin_request(
    admin: SocketAddr,
    method: &str,
    path: &str,
    host: &str,
    token: Option<&str>,
) -> Result<(u16, String), std::io::Error> {
    let mut s = TcpStream::connect(admin)?;
    // A stopped process would hold the test forever.
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    let auth = token.map_or(String::new(), |t| format!("authorization: Bearer {t}\r\n"));
    s.write_all(
        format!("{method} {path} HTTP/1.1\r\nhost: {host}\r\n{auth}connection: close\r\n\r\n")
            .as_bytes(),
    )?;
    let (status, _, body) =
        read_response(&mut s).ok_or(std::io::Error::from(std::io::ErrorKind::UnexpectedEof))?;
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

/// The value of metric `name` (with its labels, as written) on a node's admin API;
/// NaN when it is not there or the API does not answer (NaN equals nothing, so a
/// wait on a value goes on).
pub fn metric(admin: SocketAddr, name: &str) -> f64 {
    let Ok((_, body)) = try_admin_call(admin, "GET", "/metrics") else {
        return f64::NAN;
    };
    body.lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(f64::NAN)
}

/// The generation a node's admin API says it runs.
pub fn generation(admin: SocketAddr) -> u64 {
    let (status, body) = admin_get(admin, "/filters");
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    v["generation"].as_u64().unwrap_or(0)
}

/// Waits until `done`, failing the test after `within`.
pub fn wait(what: &str, within: Duration, done: &dyn Fn() -> bool) {
    let deadline = Instant::now() + within;
    while !done() {
        assert!(Instant::now() < deadline, "never happened: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The pid of `pattern` among `up`'s children (waiting until there is exactly one).
pub fn the_one(up: &str, pattern: &str) -> u32 {
    wait(
        &format!("one process {pattern:?}"),
        Duration::from_secs(30),
        &|| pids_of(up, pattern).len() == 1,
    );
    pids_of(up, pattern)[0]
}

/// Files in /dev/shm whose names say process `pid` made them.
pub fn regions_of(pid: u32) -> Vec<String> {
    let Ok(dir) = std::fs::read_dir("/dev/shm") else {
        return Vec::new();
    };
    let tag = format!("-{pid}-");
    dir.flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.starts_with("dpumesh-") && n.contains(&tag))
        .collect()
}

/// The sum of every sample of metric `name` (all label sets) on an admin API; NaN
/// when the API does not answer.
pub fn metric_sum(admin: SocketAddr, name: &str) -> f64 {
    let Ok((_, text)) = try_admin_call(admin, "GET", "/metrics") else {
        return f64::NAN;
    };
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Waits until `admin` reports no exchange in flight and no pool slot in use; if it
/// never does, the panic names the process and quotes its nonzero gauges (a leak
/// shows where it is, not only that it is).
pub fn wait_idle(admin: SocketAddr, within: Duration) {
    const GAUGES: [&str; 2] = ["dpumesh_exchanges_in_flight", "dpumesh_pool_slots_in_use"];
    let deadline = Instant::now() + within;
    loop {
        if GAUGES.iter().all(|g| metric_sum(admin, g) == 0.0) {
            return;
        }
        if Instant::now() >= deadline {
            let (_, text) = admin_get(admin, "/metrics");
            let busy: Vec<&str> = text
                .lines()
                .filter(|l| GAUGES.iter().any(|g| l.starts_with(g)))
                .filter(|l| l.rsplit(' ').next() != Some("0"))
                .collect();
            panic!("{admin} is not idle after {within:?}: {busy:#?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The path of the RBAC component in a policy written by [`super::write_policy_with`]
/// (for tests that add RBAC filters of their own).
pub fn rbac_component(policy: &str) -> String {
    policy
        .lines()
        .find(|l| l.contains("dpumesh_filter_rbac"))
        .and_then(|l| l.trim().strip_prefix("component: "))
        .expect("the policy loads the RBAC component")
        .to_owned()
}

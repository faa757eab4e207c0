//! What the mesh tests share: tokens for the sample's policy, and the sample's policy
//! file with this build's filter components. Each test binary uses the part it needs.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

pub mod grpc;
pub mod mesh;

/// The tests' HS256 key: written as each test mesh's demo token key (in its
/// certificate folder) before `dpumesh up`, which keeps a key it finds, so tokens made
/// here are ones the test's mesh accepts. A mesh of the sample's own makes a fresh key.
pub const SECRET: &str = "dpumesh-tests-hs256-secret-0123456789";

/// Writes [`SECRET`] as the demo token key of the mesh whose file is in `dir`.
pub fn write_demo_key(dir: &Path) {
    let certs = dir.join(".dpumesh/certs");
    std::fs::create_dir_all(&certs).unwrap();
    std::fs::write(certs.join("demo-jwt.key"), SECRET).unwrap();
}

/// The sample's folder.
pub fn sample() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../samples/hotel")
}

/// A token the sample's JWT filter accepts, for `sub` with `roles`.
pub fn token(sub: &str, roles: &[&str]) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let claims = serde_json::json!({
        "iss": "dpumesh-demo", "aud": "hotel", "sub": sub, "roles": roles,
        "iat": now, "exp": now + 3600,
    });
    jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &claims,
        &jsonwebtoken::EncodingKey::from_secret(SECRET.as_bytes()),
    )
    .unwrap()
}

/// `policy` with `service` exposed at the ingress as the virtual host of its name (a
/// route on the host, before the others): from outside, only a route reaches a
/// service. Tests that drive an internal service directly add it.
pub fn expose(policy: String, service: &str) -> String {
    assert!(policy.contains("\nroutes:\n"), "the policy has routes");
    policy.replacen(
        "\nroutes:\n",
        &format!("\nroutes:\n  - {{host: {service}, service: {service}}}\n"),
        1,
    )
}

/// Writes the sample's policy into `dir`, pointing at this build's components and
/// edited by `edit` last.
pub fn write_policy_with(dir: &Path, edit: impl Fn(String) -> String) {
    let mut policy = std::fs::read_to_string(sample().join("policy.yaml")).unwrap();
    for (name, path) in [
        ("trace", dpumesh_test_artifacts::FILTER_TRACE),
        ("jwt", dpumesh_test_artifacts::FILTER_JWT),
        ("rbac", dpumesh_test_artifacts::FILTER_RBAC),
        ("ratelimit", dpumesh_test_artifacts::FILTER_RATELIMIT),
        (
            "circuit_breaker",
            dpumesh_test_artifacts::FILTER_CIRCUIT_BREAKER,
        ),
    ] {
        policy = policy.replace(
            &format!(
                "../../target/wasm-artifacts/wasm32-wasip2/release/dpumesh_filter_{name}.wasm"
            ),
            path,
        );
    }
    assert!(!policy.contains("../../target"), "every component replaced");
    // Deadlines are CPU time, but these are debug builds: the host side of a filter
    // call (signature checks, header edits) runs unoptimized, and a node restarted
    // under load once took a JWT call past 5 ms of CPU (a fail-closed 500). 5 ms is a
    // release budget; these tests are about the data path.
    let policy = policy.replace("    component: ", "    deadline: 100ms\n    component: ");
    std::fs::write(dir.join("policy.yaml"), edit(policy)).unwrap();
    write_demo_key(dir);
}

/// A port nobody listens on right now, and that nothing else will take while
/// the test runs.
///
/// Binding port 0 and closing it (the old way) raced: the kernel hands the same
/// ephemeral port to the next outbound connection or `bind(0)` anywhere on the
/// machine, and a node started (or restarted) later on that port failed with
/// "address in use" (a CI failure). So ports come from below the ephemeral range
/// (32768 and up on Linux), from a counter this process owns, starting at a place
/// drawn from the pid so that nodes a previous test binary left behind do not
/// collide; a port still found bound is skipped.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const FIRST: u32 = 20_000;
    const SPAN: u32 = 12_000;
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let start = (std::process::id().wrapping_mul(2_654_435_761) >> 8) % SPAN;
    let _ = NEXT.compare_exchange(u32::MAX, start, Ordering::Relaxed, Ordering::Relaxed);
    for _ in 0..SPAN {
        let port = (FIRST + NEXT.fetch_add(1, Ordering::Relaxed) % SPAN) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port between {FIRST} and {}", FIRST + SPAN);
}

/// Waits (up to 120 s) until `dpumesh up` printed its banner on `out`; returns it.
pub fn banner(mut out: std::process::ChildStdout) -> String {
    use std::io::Read;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut all = String::new();
        let mut buf = [0u8; 4096];
        while let Ok(n) = out.read(&mut buf) {
            if n == 0 {
                break;
            }
            all.push_str(&String::from_utf8_lossy(&buf[..n]));
            if all.contains("Ctrl-C stops everything") {
                let _ = tx.send(all.clone());
            }
        }
    });
    rx.recv_timeout(std::time::Duration::from_secs(120))
        .expect("`dpumesh up` ready within 120 s")
}

/// Stops `dpumesh up` as Ctrl-C would (SIGINT), killing it after 15 s.
pub fn stop(child: &mut std::process::Child) {
    use std::time::{Duration, Instant};
    let _ = std::process::Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status();
    let deadline = Instant::now() + Duration::from_secs(15);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
}

/// GETs `path` from `addr` over HTTP/1.1; status and body.
pub fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connects");
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_owned();
    (status, body)
}

/// The DOM of `url` after its scripts ran (headless Chromium, `budget` of virtual
/// time); `None` where Chromium is not installed (a failure in CI, see
/// [`dpumesh_test_support::cannot_run`]).
pub fn browser_dom(url: &str, budget_ms: u32) -> Option<String> {
    let out = chromium(url, budget_ms, &["--dump-dom"])?;
    Some(String::from_utf8_lossy(&out).into_owned())
}

/// A PNG of `url` after its scripts ran (headless Chromium, a tall window); `None`
/// where Chromium is not installed.
pub fn browser_screenshot(url: &str, budget_ms: u32) -> Option<Vec<u8>> {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("page.png");
    chromium(
        url,
        budget_ms,
        &[
            &format!("--screenshot={}", file.display()),
            "--window-size=1400,2600",
            "--hide-scrollbars",
        ],
    )?;
    Some(std::fs::read(&file).expect("chromium wrote the screenshot"))
}

/// Runs headless Chromium on `url` with `extra` flags; its standard output.
fn chromium(url: &str, budget_ms: u32, extra: &[&str]) -> Option<Vec<u8>> {
    let chromium = ["/usr/bin/chromium", "/usr/bin/chromium-browser"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists());
    let Some(chromium) = chromium else {
        dpumesh_test_support::cannot_run(
            "Chromium for the browser part (/usr/bin/chromium, Debian's package)",
            &"not installed",
        );
        return None;
    };
    let profile = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(chromium)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            &format!("--user-data-dir={}", profile.path().display()),
            &format!("--virtual-time-budget={budget_ms}"),
        ])
        .args(extra)
        .arg(url)
        .output()
        .expect("chromium runs");
    assert!(
        out.status.success(),
        "chromium: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(out.stdout)
}

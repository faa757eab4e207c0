//! The proxy under load: reloads (config changes and component swaps) with zero failed
//! requests, rejected reloads that leave the old behaviour serving, faulty filters
//! isolated from other chains, and admin endpoints that return what they claim.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use dpumesh_proxy::{Options, Proxy};
use dpumesh_test_artifacts as artifacts;

/// Status, headers (lower-cased names), body.
type Reply = (u16, Vec<(String, String)>, String);

/// A minimal HTTP/1.1 exchange.
fn http(addr: SocketAddr, method: &str, path: &str, host: &str) -> Reply {
    try_http(addr, method, path, host).unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

/// [`http`], or why there was no complete response (load clients count that as a
/// failed request rather than panicking).
fn try_http(addr: SocketAddr, method: &str, path: &str, host: &str) -> Result<Reply, String> {
    let exchange = || -> std::io::Result<String> {
        let mut stream = TcpStream::connect(addr)?;
        stream.set_read_timeout(Some(Duration::from_secs(30)))?;
        write!(
            stream,
            "{method} {path} HTTP/1.1\r\nhost: {host}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
        )?;
        let mut raw = String::new();
        stream.read_to_string(&mut raw)?;
        Ok(raw)
    };
    let raw = exchange().map_err(|e| format!("no answer: {e}"))?;
    let (head, body) = raw
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("an incomplete response: {raw:?}"))?;
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1)?.parse().ok())
        .ok_or_else(|| format!("no status line: {raw:?}"))?;
    let headers = lines
        .filter_map(|l| l.split_once(": "))
        .map(|(n, v)| (n.to_ascii_lowercase(), v.to_owned()))
        .collect();
    Ok((status, headers, body.to_owned()))
}

/// The admin token `Setup` configures.
const ADMIN_TOKEN: &str = "test-admin-token-0123456789";

/// A call to the admin API as an operator makes it: to its address, with its token.
fn admin_http(admin: SocketAddr, method: &str, path: &str) -> Reply {
    admin_as(admin, method, path, &admin.to_string(), Some(ADMIN_TOKEN))
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

/// A call to the admin API with `host` and `token` as given.
fn admin_as(
    admin: SocketAddr,
    method: &str,
    path: &str,
    host: &str,
    token: Option<&str>,
) -> Result<Reply, String> {
    let mut stream = TcpStream::connect(admin).map_err(|e| e.to_string())?;
    let auth = token.map_or(String::new(), |t| format!("authorization: Bearer {t}\r\n"));
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nhost: {host}\r\n{auth}content-length: 0\r\nconnection: close\r\n\r\n"
    )
    .map_err(|e| e.to_string())?;
    let mut raw = String::new();
    stream.read_to_string(&mut raw).map_err(|e| e.to_string())?;
    let (head, body) = raw.split_once("\r\n\r\n").ok_or("an incomplete response")?;
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or("no status")?;
    let headers = head
        .lines()
        .skip(1)
        .filter_map(|l| l.split_once(": "))
        .map(|(n, v)| (n.to_ascii_lowercase(), v.to_owned()))
        .collect();
    Ok((status, headers, body.to_owned()))
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
}

struct Setup {
    dir: tempfile::TempDir,
}

impl Setup {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        std::fs::copy(artifacts::TEST_FILTER, dir.path().join("test.wasm")).unwrap();
        std::fs::copy(artifacts::SAMPLE_GUARD, dir.path().join("guard.wasm")).unwrap();
        std::fs::copy(artifacts::FILTER_TRACE, dir.path().join("trace.wasm")).unwrap();
        std::fs::write(dir.path().join("admin.token"), format!("{ADMIN_TOKEN}\n")).unwrap();
        Self { dir }
    }

    fn config(&self) -> PathBuf {
        self.dir.path().join("proxy.yaml")
    }

    /// Writes a config whose `api` chain runs `filter` (test filter tagging responses
    /// with `version`, or the guard) and whose `other` chain runs `other`.
    fn write(&self, api: &str, other: &str) {
        let text = format!(
            r#"admin: 127.0.0.1:0
admin_token_file: admin.token
listener: 127.0.0.1:0
workers: 2
cache_dir: cache
filters:
{api}
{other}
  trace:
    component: trace.wasm
    deadline: {DEADLINE}
chains:
  api: [trace, main]
  other: [side]
services:
  api: {{chain: api}}
  other: {{chain: other}}
routes:
  - {{host: other.test, service: other}}
  - {{service: api}}
"#
        );
        // Write then rename, as editors and config management do.
        let tmp = self.dir.path().join("proxy.yaml.tmp");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, self.config()).unwrap();
    }
}

/// Deadlines are CPU time, so a preempted call no longer fails; still generous, since
/// these tests assert zero failed requests across reloads in a debug build.
const DEADLINE: &str = "250ms";

fn tagged(name: &str, version: usize) -> String {
    format!(
        "  {name}:\n    component: test.wasm\n    deadline: {DEADLINE}\n    config: {{request: [{{set_header: [x-version, \"{version}\"]}}]}}"
    )
}

fn guard(name: &str) -> String {
    format!(
        "  {name}:\n    component: guard.wasm\n    deadline: {DEADLINE}\n    config: {{rules: [{{name: no-delete, methods: [DELETE], action: deny}}], default: allow}}"
    )
}

fn start(setup: &Setup) -> Proxy {
    Proxy::start(&setup.config(), Options { watch: None }).expect("proxy starts")
}

#[test]
fn ten_reloads_under_load_fail_no_request_and_switch_behaviour() {
    let setup = Setup::new();
    setup.write(&tagged("main", 0), &tagged("side", 0));
    let proxy = start(&setup);
    let addr = proxy.listener_addr().unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let served = Arc::new(AtomicUsize::new(0));
    let load: Vec<_> = (0..4)
        .map(|_| {
            let (stop, served) = (stop.clone(), served.clone());
            std::thread::spawn(move || {
                let mut failures = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    match try_http(addr, "GET", "/items", "api.test") {
                        Ok((200, _, _)) => {}
                        Ok((status, _, body)) => failures.push(format!("{status}: {body}")),
                        Err(e) => failures.push(e),
                    }
                    served.fetch_add(1, Ordering::Relaxed);
                }
                failures
            })
        })
        .collect();

    for round in 1..=10 {
        // Odd rounds change the config of the test filter, even rounds swap in the
        // guard component.
        let main = if round % 2 == 1 {
            tagged("main", round)
        } else {
            guard("main")
        };
        setup.write(&main, &tagged("side", 0));
        let done = proxy.policy().reload().expect("reload succeeds");
        assert_eq!(done.generation, round as u64 + 1);
        let deadline = Instant::now() + Duration::from_secs(30);
        while !proxy.policy().settled() {
            assert!(Instant::now() < deadline, "workers did not switch");
            std::thread::sleep(Duration::from_millis(1));
        }
        let (status, headers, body) = http(addr, "GET", "/items", "api.test");
        assert_eq!(status, 200, "{body}");
        assert_eq!(
            header(&headers, "x-dpumesh-generation"),
            Some((round + 1).to_string().as_str())
        );
        if round % 2 == 1 {
            assert!(
                body.contains(&format!("[\"x-version\",\"{round}\"]")),
                "round {round}: {body}"
            );
        } else {
            assert!(!body.contains("x-version"), "round {round}: {body}");
            let (status, _, _) = http(addr, "DELETE", "/items/1", "api.test");
            assert_eq!(status, 403, "round {round}: the guard runs");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    stop.store(true, Ordering::Relaxed);
    let failures: Vec<String> = load
        .into_iter()
        .flat_map(dpumesh_test_support::joined)
        .collect();
    assert!(failures.is_empty(), "failed requests: {failures:?}");
    assert!(served.load(Ordering::Relaxed) > 20, "the load kept flowing");
}

#[test]
fn a_broken_reload_is_rejected_and_the_old_behaviour_continues() {
    let setup = Setup::new();
    setup.write(&tagged("main", 1), &tagged("side", 0));
    let proxy = start(&setup);
    let (addr, admin) = (proxy.listener_addr().unwrap(), proxy.admin_addr().unwrap());

    // A configure() error, a component that is not Wasm, bad YAML, a bad reference.
    std::fs::write(setup.dir.path().join("junk.wasm"), b"not wasm").unwrap();
    let broken = [
        (
            "config",
            tagged("main", 2).replace("request:", "reject: nope, request:"),
        ),
        (
            "component",
            tagged("main", 2).replace("test.wasm", "junk.wasm"),
        ),
        ("yaml", "  main: [unclosed".to_owned()),
    ];
    for (what, main) in broken {
        setup.write(&main, &tagged("side", 0));
        let (status, _, body) = admin_http(admin, "POST", "/reload");
        assert_eq!(status, 422, "{what}: {body}");
        assert!(
            body.contains("proxy.yaml"),
            "{what}: the error names the file: {body}"
        );
        let (status, headers, body) = http(addr, "GET", "/", "api.test");
        assert_eq!(status, 200);
        assert_eq!(
            header(&headers, "x-dpumesh-generation"),
            Some("1"),
            "{what}"
        );
        assert!(body.contains("[\"x-version\",\"1\"]"), "{what}: {body}");
    }
    let (_, _, filters) = admin_http(admin, "GET", "/filters");
    let filters: serde_json::Value = serde_json::from_str(&filters).unwrap();
    assert_eq!(filters["generation"], 1);
    assert!(filters["last_reload_error"].as_str().is_some());

    // Fixed: the next reload goes through.
    setup.write(&tagged("main", 3), &tagged("side", 0));
    let (status, _, body) = admin_http(admin, "POST", "/reload");
    assert_eq!(status, 200, "{body}");
    let (_, _, body) = http(addr, "GET", "/", "api.test");
    assert!(body.contains("[\"x-version\",\"3\"]"), "{body}");
}

#[test]
fn a_watched_config_reloads_on_change_and_skips_broken_saves() {
    let setup = Setup::new();
    setup.write(&tagged("main", 1), &tagged("side", 0));
    let proxy = Proxy::start(
        &setup.config(),
        Options {
            watch: Some(Duration::from_millis(20)),
        },
    )
    .unwrap();
    let (addr, admin) = (proxy.listener_addr().unwrap(), proxy.admin_addr().unwrap());
    let wait_for = |what: &str, done: &dyn Fn() -> bool| {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !done() {
            assert!(Instant::now() < deadline, "never happened: {what}");
            std::thread::sleep(Duration::from_millis(20));
        }
    };

    // A broken save is refused; the error shows in /filters; generation 1 serves on.
    setup.write("  main: [unclosed", &tagged("side", 0));
    wait_for("the broken save is seen", &|| {
        let (_, _, filters) = admin_http(admin, "GET", "/filters");
        filters.contains("proxy.yaml")
    });
    let (_, headers, _) = http(addr, "GET", "/", "api.test");
    assert_eq!(header(&headers, "x-dpumesh-generation"), Some("1"));

    // The fixed save is picked up.
    setup.write(&tagged("main", 2), &tagged("side", 0));
    wait_for("the fixed save is picked up", &|| {
        let (_, _, body) = http(addr, "GET", "/", "api.test");
        body.contains("[\"x-version\",\"2\"]")
    });
    let (_, headers, _) = http(addr, "GET", "/", "api.test");
    assert_eq!(header(&headers, "x-dpumesh-generation"), Some("2"));
}

#[test]
fn faulty_filters_under_load_leave_other_chains_serving() {
    let setup = Setup::new();
    let main = "  main:\n    component: test.wasm\n    deadline: 20ms\n    memory_cap: 8MiB\n    config: {request: [{spin_if_header: x-spin}, {panic_if_header: x-panic}, {alloc_mib_if_header: [x-bomb, 64]}]}";
    setup.write(main, &tagged("side", 7));
    let proxy = start(&setup);
    let addr = proxy.listener_addr().unwrap();

    let bad: Vec<_> = ["x-spin", "x-panic", "x-bomb"]
        .into_iter()
        .map(|header| {
            std::thread::spawn(move || {
                let mut statuses = Vec::new();
                for _ in 0..15 {
                    // Any failed step is a request not answered, which the
                    // assertion below counts (it is never a panic here).
                    let exchange = || -> std::io::Result<String> {
                        let mut stream = TcpStream::connect(addr)?;
                        write!(
                            stream,
                            "GET /bad HTTP/1.1\r\nhost: api.test\r\n{header}: 1\r\nconnection: close\r\n\r\n"
                        )?;
                        let mut raw = String::new();
                        stream.read_to_string(&mut raw)?;
                        Ok(raw)
                    };
                    statuses.push(match exchange() {
                        Ok(raw) => raw.split(' ').nth(1).unwrap_or("no status").to_owned(),
                        Err(e) => format!("no answer: {e}"),
                    });
                }
                statuses
            })
        })
        .collect();
    for _ in 0..50 {
        let (status, _, body) = http(addr, "GET", "/", "other.test");
        assert_eq!(status, 200, "{body}");
        assert!(body.contains("[\"x-version\",\"7\"]"), "{body}");
    }
    for statuses in bad.into_iter().map(dpumesh_test_support::joined) {
        // Fail-closed: every faulting request is denied (500), or 503 once the filter
        // is degraded; never served.
        assert!(
            statuses.iter().all(|s| s == "500" || s == "503"),
            "{statuses:?}"
        );
    }
    // Good requests on the faulting chain are served again once the backoff ends.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (status, _, _) = http(addr, "GET", "/", "api.test");
        if status == 200 {
            break;
        }
        assert_eq!(status, 503);
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn admin_mutations_need_the_token_and_every_call_the_admin_address() {
    let setup = Setup::new();
    setup.write(&tagged("main", 1), &tagged("side", 0));
    let proxy = start(&setup);
    let admin = proxy.admin_addr().unwrap();
    let here = admin.to_string();
    // Reads are open.
    assert_eq!(
        admin_as(admin, "GET", "/filters", &here, None).unwrap().0,
        200
    );
    let local = format!("localhost:{}", admin.port());
    assert_eq!(
        admin_as(admin, "GET", "/healthz", &local, None).unwrap().0,
        200
    );
    // A mutation without the token, or with another, is refused and does nothing.
    for token in [None, Some("guess"), Some("")] {
        let (status, headers, body) = admin_as(admin, "POST", "/reload", &here, token).unwrap();
        assert_eq!(status, 401, "{token:?}: {body}");
        assert!(body.contains("admin token"), "{body}");
        assert!(header(&headers, "www-authenticate").is_some());
    }
    let (_, _, filters) = admin_http(admin, "GET", "/filters");
    assert!(filters.contains("\"generation\":1"), "{filters}");
    // A page the operator's browser loaded from evil.example, its name rebound to the
    // admin address, sends its own host: refused, reads too.
    let evil = format!("evil.example:{}", admin.port());
    for (method, path) in [("POST", "/reload"), ("GET", "/metrics")] {
        let (status, _, body) = admin_as(admin, method, path, &evil, Some(ADMIN_TOKEN)).unwrap();
        assert_eq!(status, 421, "{method} {path}: {body}");
    }
    // With the token, from the admin address: done.
    assert_eq!(admin_http(admin, "POST", "/reload").0, 200);

    // A proxy configured with no token takes no mutation at all.
    let bare = Setup::new();
    bare.write(&tagged("main", 1), &tagged("side", 0));
    let text = std::fs::read_to_string(bare.config())
        .unwrap()
        .replace("admin_token_file: admin.token\n", "");
    std::fs::write(bare.config(), text).unwrap();
    let proxy = start(&bare);
    let admin = proxy.admin_addr().unwrap();
    let (status, _, body) = admin_http(admin, "POST", "/reload");
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("no admin token is configured"), "{body}");
}

#[test]
fn admin_endpoints_return_what_they_claim() {
    let setup = Setup::new();
    setup.write(&guard("main"), &tagged("side", 0));
    let proxy = start(&setup);
    let (addr, admin) = (proxy.listener_addr().unwrap(), proxy.admin_addr().unwrap());
    assert_eq!(admin_http(admin, "GET", "/healthz").0, 200);
    assert_eq!(admin_http(admin, "GET", "/readyz").0, 200);
    assert_eq!(admin_http(admin, "GET", "/nope").0, 404);
    assert_eq!(admin_http(admin, "GET", "/reload").0, 405);
    for _ in 0..3 {
        assert_eq!(http(addr, "DELETE", "/x", "api.test").0, 403);
    }
    assert_eq!(http(addr, "GET", "/x", "api.test").0, 200);

    let (status, headers, text) = admin_http(admin, "GET", "/metrics");
    assert_eq!(status, 200);
    assert!(
        header(&headers, "content-type")
            .unwrap()
            .starts_with("text/plain")
    );
    // Parse the exposition format: `name{labels} value` lines.
    let samples: Vec<(String, f64)> = text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (key, value) = l.rsplit_once(' ').expect("name and value");
            (key.to_owned(), value.parse().expect("a number"))
        })
        .collect();
    let value = |key: &str| {
        samples
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| *v)
            .unwrap_or_else(|| panic!("{key} missing from\n{text}"))
    };
    // Other tests in this process record into the same global recorder under the same
    // chain names, so these are lower bounds.
    assert!(value(r#"dpumesh_denials_total{chain="api",filter="main",status="403"}"#) >= 3.0);
    assert!(value(r#"dpumesh_filter_invocations_total{chain="api",filter="main"}"#) >= 4.0);
    assert!(value(r#"dpumesh_filter_instances{chain="api",filter="main"}"#) >= 2.0);
    assert!(
        text.contains("dpumesh_request_duration_seconds_bucket"),
        "{text}"
    );
    assert!(text.contains("dpumesh_generation"), "{text}");

    let (_, _, filters) = admin_http(admin, "GET", "/filters");
    let filters: serde_json::Value = serde_json::from_str(&filters).unwrap();
    let api = filters["chains"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["chain"] == "api")
        .unwrap();
    let names: Vec<&str> = api["filters"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["trace", "main"]);
    assert_eq!(api["filters"][1]["state"], "healthy");
    assert_eq!(api["filters"][1]["version"].as_str().unwrap().len(), 64);
    assert_eq!(filters["workers"], serde_json::json!([1, 1]));
}

#[test]
fn a_new_key_set_takes_effect_on_reload() {
    use jsonwebtoken::{EncodingKey, Header};

    let setup = Setup::new();
    std::fs::copy(artifacts::FILTER_JWT, setup.dir.path().join("jwt.wasm")).unwrap();
    let write = |secret: &str| {
        let text = format!(
            r#"admin: 127.0.0.1:0
admin_token_file: admin.token
listener: 127.0.0.1:0
workers: 2
cache_dir: cache
key_sets:
  shared: {{secret: "{secret}"}}
filters:
  jwt:
    component: jwt.wasm
    deadline: {DEADLINE}
    config:
      providers: {{p: {{issuer: "https://idp.test", audiences: [api], algorithms: [HS256], key_set: shared}}}}
      rules: [{{path_prefix: /, provider: p}}]
chains: {{api: [jwt]}}
services: {{api: {{chain: api}}}}
routes: [{{service: api}}]
"#
        );
        std::fs::write(setup.config(), text).unwrap();
    };
    let token = |secret: &str| {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        let claims = serde_json::json!({"iss": "https://idp.test", "aud": "api", "sub": "alice", "exp": now + 600});
        jsonwebtoken::encode(
            &Header::default(),
            &claims,
            &EncodingKey::from_secret(secret.as_bytes()),
        )
        .unwrap()
    };
    let get = |addr: SocketAddr, token: &str| {
        let mut stream = TcpStream::connect(addr).unwrap();
        write!(
            stream,
            "GET / HTTP/1.1\r\nhost: api.test\r\nauthorization: Bearer {token}\r\nconnection: close\r\n\r\n"
        )
        .unwrap();
        let mut raw = String::new();
        stream.read_to_string(&mut raw).unwrap();
        raw.split(' ').nth(1).unwrap().parse::<u16>().unwrap()
    };

    write("first-secret-0123456789abcdef0123");
    let proxy = start(&setup);
    let addr = proxy.listener_addr().unwrap();
    let (old, new) = (
        token("first-secret-0123456789abcdef0123"),
        token("second-secret-0123456789abcdef012"),
    );
    assert_eq!(get(addr, &old), 200);
    assert_eq!(get(addr, &new), 401);

    write("second-secret-0123456789abcdef012");
    proxy.policy().reload().unwrap();
    assert_eq!(
        get(addr, &old),
        401,
        "a cached verification does not outlive its key"
    );
    assert_eq!(get(addr, &new), 200);
}

#[test]
fn a_filter_config_file_is_read_and_watched() {
    let setup = Setup::new();
    let main = "  main:\n    component: test.wasm\n    config_file: main.yaml";
    let write_main = |version: usize| {
        let text = format!("request:\n  - set_header: [x-version, \"{version}\"]\n");
        let tmp = setup.dir.path().join("main.yaml.tmp");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, setup.dir.path().join("main.yaml")).unwrap();
    };
    write_main(1);
    std::fs::write(
        setup.dir.path().join("side.json"),
        r#"{"request": [{"set_header": ["x-side", "json"]}]}"#,
    )
    .unwrap();
    setup.write(
        main,
        "  side:\n    component: test.wasm\n    config_file: side.json",
    );
    let proxy = Proxy::start(
        &setup.config(),
        Options {
            watch: Some(Duration::from_millis(20)),
        },
    )
    .unwrap();
    let addr = proxy.listener_addr().unwrap();
    let (_, _, body) = http(addr, "GET", "/", "api.test");
    assert!(body.contains("[\"x-version\",\"1\"]"), "{body}");
    let (_, _, body) = http(addr, "GET", "/", "other.test");
    assert!(body.contains("[\"x-side\",\"json\"]"), "{body}");

    // Only the filter's config file changes: the watcher sees it.
    write_main(2);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (_, headers, body) = http(addr, "GET", "/", "api.test");
        if body.contains("[\"x-version\",\"2\"]") {
            assert_eq!(header(&headers, "x-dpumesh-generation"), Some("2"));
            break;
        }
        assert!(Instant::now() < deadline, "never reloaded: {body}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_reload_that_outgrows_the_instance_pool_asks_for_a_restart() {
    let setup = Setup::new();
    setup.write(&tagged("main", 1), &tagged("side", 0));
    let proxy = start(&setup);
    let many: Vec<String> = (0..40).map(|i| tagged(&format!("f{i}"), i)).collect();
    let names: Vec<String> = (0..40).map(|i| format!("f{i}")).collect();
    let text = format!(
        "admin: 127.0.0.1:0\nlistener: 127.0.0.1:0\nworkers: 2\ncache_dir: cache\nfilters:\n{}\nchains:\n  api: [{}]\nservices:\n  api: {{chain: api}}\nroutes:\n  - {{service: api}}\n",
        many.join("\n"),
        names.join(", ")
    );
    std::fs::write(setup.config(), text).unwrap();
    let e = proxy.policy().reload().unwrap_err().to_string();
    assert!(e.contains("restart the proxy to grow it"), "{e}");
    assert_eq!(proxy.policy().snapshot().generation.number(), 1);
}

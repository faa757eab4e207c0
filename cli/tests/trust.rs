//! What an attacker tries against the local mesh (`dpumesh up` on the hotel sample):
//! paths written to slip past a policy, ambiguous framing, clients that never finish.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

mod common;
use common::mesh::*;
use common::token;

/// The hotel policy with an explicit DENY on `/admin` for everyone, ahead of the ALLOW
/// RBAC (which lets admins in): only the DENY can stop an admin's request.
fn deny_admin(policy: String) -> String {
    let deny = "  deny-admin:\n    deadline: 100ms\n    component: COMPONENT\n    config:\n      action: DENY\n      policies:\n        - {name: no-admin, permissions: [{path: {prefix: /admin}}], principals: [{any: true}]}\n";
    let component = rbac_component(&policy);
    policy
        .replace(
            "\nchains:\n",
            &format!("{}\nchains:\n", deny.replace("COMPONENT", &component)),
        )
        .replace(
            "api: [trace, jwt, rbac,",
            "api: [trace, jwt, deny-admin, rbac,",
        )
        .replace("bench: [jwt, rbac,", "bench: [jwt, deny-admin, rbac,")
}

/// GETs each path with `token` and expects `status` for every one.
fn expect_each(mesh: &Mesh, token: &str, paths: &[&str], status: u16, why: &str) {
    for path in paths {
        let (got, _, body) = mesh.get(path, Some(token));
        assert_eq!(
            got,
            status,
            "{path}: {why}, got {got} {}",
            String::from_utf8_lossy(&body)
        );
    }
}

#[test]
fn no_path_trick_gets_past_a_deny_policy() {
    let mesh = Mesh::up_edited(|m| m, deny_admin);
    let root = token("root", &["admin", "user"]);
    // Each of these is `/admin` to a backend that normalizes (most frameworks do).
    let denied = [
        "/admin",
        "/admin/stats",
        "/ping/../admin",
        "/ping/./../admin",
        "/ping/x/../../admin",
        "/%61dmin",
        "/%2e%2e/admin",
        "/ping/%2E%2E/admin",
        "/ping/.%2e/admin",
        "//admin",
        "/./admin",
        "///admin//stats",
        "/hotels/..//admin",
    ];
    expect_each(
        &mesh,
        &root,
        &denied,
        403,
        "the DENY policy must see /admin",
    );
    // Encoded slashes and broken escapes are refused outright (Envoy's defaults).
    let refused = [
        "/admin%2Fstats",
        "/ping%2F..%2Fadmin",
        "/ping/..%2fadmin",
        "/ping/..%5Cadmin",
        "/%zzadmin",
        "/admin%",
        "/admin%00",
    ];
    expect_each(&mesh, &root, &refused, 400, "refused");
    // Routing and the service see the normalized path too.
    let (status, _, body) = mesh.get("/x/../%70ing", Some(&root));
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(body, b"pong\n");
    let (status, _, body) = mesh.get("/x/../hotels/../ping/.", Some(&root));
    assert_eq!(status, 404);
    assert_eq!(String::from_utf8_lossy(&body), "frontend has no /ping/\n");
}

#[test]
fn escaped_slashes_can_be_decoded_instead_and_the_policy_still_holds() {
    let mesh = Mesh::up_edited(
        |m| {
            m.replace(
                "  admin: 127.0.0.1:",
                "  path: {escaped_slashes: unescape}\n  admin: 127.0.0.1:",
            )
        },
        deny_admin,
    );
    let root = token("root", &["admin", "user"]);
    let decoded = ["/ping%2F..%2Fadmin", "/ping/..%5Cadmin", "/admin%2fstats"];
    expect_each(&mesh, &root, &decoded, 403, "decoded, then denied");
    let (status, _, body) = mesh.get("/ping%2Fx", Some(&root));
    assert_eq!(status, 404);
    assert_eq!(String::from_utf8_lossy(&body), "frontend has no /ping/x\n");
}

/// Reads what comes on `s` until it closes or `limit` passes.
fn read_all(s: &mut TcpStream, limit: Duration) -> String {
    s.set_read_timeout(Some(limit)).unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

#[test]
fn ambiguous_framing_is_refused_and_the_connection_closed() {
    let mesh = Mesh::up();
    let alice = token("alice", &["user"]);
    for (name, headers) in [
        (
            "CL.TE",
            "content-length: 6\r\ntransfer-encoding: chunked\r\n",
        ),
        (
            "TE.CL",
            "transfer-encoding: chunked\r\ncontent-length: 6\r\n",
        ),
    ] {
        let mut s = TcpStream::connect(mesh.ingress).unwrap();
        let request = format!(
            "POST /echo HTTP/1.1\r\nhost: hotel\r\nauthorization: Bearer {alice}\r\n{headers}\r\n0\r\n\r\nGET /ping HTTP/1.1\r\nhost: hotel\r\nauthorization: Bearer {alice}\r\n\r\n"
        );
        s.write_all(request.as_bytes()).unwrap();
        let answer = read_all(&mut s, Duration::from_secs(10));
        assert!(
            answer.starts_with("HTTP/1.1 400"),
            "{name}: 400, got {answer}"
        );
        assert!(answer.contains("connection: close"), "{name}: {answer}");
        assert_eq!(
            answer.matches("HTTP/1.1").count(),
            1,
            "{name}: nothing after the refusal is served: {answer}"
        );
    }
    // The same connection reused after a good request: the refusal counts per request.
    let mut s = TcpStream::connect(mesh.ingress).unwrap();
    let request = format!(
        "GET /ping HTTP/1.1\r\nhost: hotel\r\nauthorization: Bearer {alice}\r\n\r\nPOST /echo HTTP/1.1\r\nhost: hotel\r\nauthorization: Bearer {alice}\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n"
    );
    s.write_all(request.as_bytes()).unwrap();
    let answer = read_all(&mut s, Duration::from_secs(10));
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert_eq!(answer.matches("HTTP/1.1 400").count(), 1, "{answer}");
}

#[test]
fn slow_clients_are_cut_off_and_do_not_hold_the_ingress() {
    let mesh = Mesh::up_with(|m| {
        m.replace(
            "body_timeout: 10s",
            "body_timeout: 1s\n  header_timeout: 1s\n  idle_timeout: 3s",
        )
    });
    let alice = token("alice", &["user"]);
    // Slowloris: many connections each sending a head one byte at a time, never done.
    let started = Instant::now();
    let mut slow: Vec<TcpStream> = (0..64)
        .map(|_| {
            let mut s = TcpStream::connect(mesh.ingress).unwrap();
            s.write_all(b"GET /ping HTTP/1.1\r\nhost: hotel\r\n")
                .unwrap();
            s
        })
        .collect();
    let mut cut = 0;
    for round in 0..40 {
        for s in &mut slow {
            if s.write_all(b"x").is_err() {
                continue;
            }
        }
        // A real client is served all along.
        if round % 10 == 0 {
            let (status, _, _) = mesh.get("/ping", Some(&alice));
            assert_eq!(status, 200, "served while slow clients hang on");
        }
        std::thread::sleep(Duration::from_millis(100));
        if started.elapsed() > Duration::from_secs(3) {
            break;
        }
    }
    for s in &mut slow {
        let answer = read_all(s, Duration::from_secs(3));
        if answer.is_empty() || answer.starts_with("HTTP/1.1 408") {
            cut += 1;
        }
    }
    assert_eq!(
        cut,
        slow.len(),
        "every slow head is cut off after the header timeout"
    );
    // A body trickled in one byte at a time is cut off at the body timeout too.
    let mut s = TcpStream::connect(mesh.ingress).unwrap();
    s.write_all(
        format!("POST /echo HTTP/1.1\r\nhost: hotel\r\nauthorization: Bearer {alice}\r\ncontent-length: 1000\r\n\r\n").as_bytes(),
    )
    .unwrap();
    let trickle = Instant::now();
    s.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let mut answer = Vec::new();
    while trickle.elapsed() < Duration::from_secs(5) {
        let _ = s.write_all(b"y");
        let mut buf = [0u8; 512];
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => answer.extend_from_slice(&buf[..n]),
            Err(_) => {}
        }
        if !answer.is_empty() {
            break;
        }
    }
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(
        trickle.elapsed() < Duration::from_secs(3),
        "{:?}",
        trickle.elapsed()
    );

    // A kept-alive connection quiet for longer than the head limit is still served:
    // between requests the idle limit (3 s here) applies, not the head's (1 s).
    let request =
        format!("GET /ping HTTP/1.1\r\nhost: hotel\r\nauthorization: Bearer {alice}\r\n\r\n");
    let mut kept = TcpStream::connect(mesh.ingress).unwrap();
    kept.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut buf = [0u8; 4096];
    let admin = mesh.ingress_admin.unwrap();
    let parks = || metric_sum(admin, "dpumesh_ingress_connections_parked_total");
    let parked_before = parks();
    for quiet in [Duration::ZERO, Duration::from_millis(2_000)] {
        std::thread::sleep(quiet);
        if !quiet.is_zero() {
            // Quiet past `park_after` (250 ms): parked, its hyper connection and
            // buffers freed; the request below is served by a new one.
            let parked = metric_sum(admin, "dpumesh_ingress_connections_parked");
            assert!(parked >= 1.0, "the quiet connection is parked: {parked}");
            assert!(parks() > parked_before);
        }
        kept.write_all(request.as_bytes()).unwrap();
        let n = kept.read(&mut buf).unwrap();
        let answer = String::from_utf8_lossy(&buf[..n]);
        assert!(
            answer.starts_with("HTTP/1.1 200"),
            "after {quiet:?} quiet: {answer}"
        );
    }
    // Past the idle limit it is closed, as if the client had closed it: no answer.
    let quiet = Instant::now();
    let rest = read_all(&mut kept, Duration::from_secs(10));
    assert_eq!(rest, "", "nothing is sent on an idle connection");
    assert!(
        (Duration::from_millis(2_500)..Duration::from_secs(6)).contains(&quiet.elapsed()),
        "closed at the idle limit: {:?}",
        quiet.elapsed()
    );
    // A connection that says nothing at all has the head limit from its accept.
    let mut silent = TcpStream::connect(mesh.ingress).unwrap();
    let opened = Instant::now();
    assert_eq!(read_all(&mut silent, Duration::from_secs(10)), "");
    assert!(
        opened.elapsed() < Duration::from_millis(2_500),
        "a silent connection is cut off at the head limit: {:?}",
        opened.elapsed()
    );
}

#[test]
fn too_many_header_fields_are_refused() {
    let mesh = Mesh::up_with(|m| {
        m.replace(
            "  admin: 127.0.0.1:",
            "  max_headers: 20\n  admin: 127.0.0.1:",
        )
    });
    let alice = token("alice", &["user"]);
    let fields: String = (0..30).map(|i| format!("x-f{i}: v\r\n")).collect();
    let (status, _, _) = mesh.raw(
        format!(
            "GET /ping HTTP/1.1\r\nhost: hotel\r\nauthorization: Bearer {alice}\r\n{fields}\r\n"
        )
        .as_bytes(),
    );
    assert_eq!(status, 431);
    let fields: String = (0..10).map(|i| format!("x-f{i}: v\r\n")).collect();
    let (status, _, _) = mesh.raw(
        format!("GET /ping HTTP/1.1\r\nhost: hotel\r\nauthorization: Bearer {alice}\r\n{fields}connection: close\r\n\r\n").as_bytes(),
    );
    assert_eq!(status, 200);
}

#[test]
fn logs_written_to_a_pipe_or_file_carry_no_colour_codes() {
    let dir = tempfile::tempdir().unwrap();
    let (file, _) = mesh_files(dir.path(), |m| m);
    let run = dir.path().join("run");
    std::fs::create_dir_all(&run).unwrap();
    let log = dir.path().join("node.log");
    let mut node = dpumesh_test_support::Reaped(
        std::process::Command::new(env!("CARGO_BIN_EXE_dpumesh"))
            .args(["node", "--name", "node1", "--mesh"])
            .arg(&file)
            .arg("--run-dir")
            .arg(&run)
            .env("DPUMESH_LOG", "info")
            .env_remove("NO_COLOR")
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    let text = loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.contains("INFO") || Instant::now() > deadline {
            break text;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let _ = node.kill();
    let _ = node.wait();
    assert!(text.contains("INFO"), "the node logged at info: {text}");
    assert!(
        !text.contains('\x1b'),
        "no ANSI escapes in a log file: {text:?}"
    );
}

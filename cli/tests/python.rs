//! Services in Python on the mesh, through real processes: the hotel sample's Flask
//! frontend (`samples/hotel-py`, served by `python3 -m dpumesh.server`) calling the Rust
//! services, and the Rust frontend calling a Python `user` service.
//!
//! Needs the `dpumesh` Python package for `python3` (`scripts/install-python.sh`; the
//! test command runs it first).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;

mod common;
use common::mesh::*;
use common::{free_port, token, write_policy_with};

fn python_sample() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../samples/hotel-py")
}

fn require_package() {
    require_modules("dpumesh._native, flask");
}

/// `import <modules>` works for python3 (the test command installs them).
fn require_modules(modules: &str) {
    let out = Command::new("python3")
        .args(["-c", &format!("import {modules}")])
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "python3 cannot import {modules}: run ./scripts/install-python.sh\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `samples/hotel-py/mesh.yaml` as it is, on free ports, with this build's policy; the
/// app copied beside the mesh file (pods start in the mesh file's folder).
fn python_mesh() -> Mesh {
    require_package();
    let dir = tempfile::tempdir().unwrap();
    write_policy_with(dir.path(), |p| p);
    let sample = python_sample();
    let mut text = std::fs::read_to_string(sample.join("mesh.yaml")).unwrap();
    let ingress: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    text = text.replace("127.0.0.1:8010", &ingress.to_string());
    for port in ["7111", "7112", "9111", "9112", "9120"] {
        text = text.replace(
            &format!("127.0.0.1:{port}"),
            &format!("127.0.0.1:{}", free_port()),
        );
    }
    assert!(text.contains("policy: ../hotel/policy.yaml"), "{text}");
    text = text.replace("policy: ../hotel/policy.yaml", "policy: policy.yaml");
    for file in ["app.py", "demo-token.json"] {
        std::fs::copy(sample.join(file), dir.path().join(file)).unwrap();
    }
    let file = dir.path().join("mesh.yaml");
    std::fs::write(&file, text).unwrap();
    Mesh::start(dir, &file, ingress)
}

/// The Rust hotel mesh with its `user` service served by `python3 -m dpumesh.server
/// --app-dir samples/hotel-py <args>` (one pod in place of the Rust two).
fn hotel_with_python_user(args: &str) -> Mesh {
    let app_dir = python_sample().canonicalize().unwrap();
    Mesh::up_with(|m| {
        let python = format!(
            "user: {{nodes: [node1], command: [python3, -m, dpumesh.server, --app-dir, {}, {args}]}}",
            app_dir.display()
        );
        let edited = m.replace(
            "user: {nodes: [node1], replicas: 2, command: [hotel, user]}",
            &python,
        );
        assert_ne!(edited, m, "the sample's user line is as expected");
        edited
    })
}

#[test]
fn a_flask_frontend_on_the_mesh_calls_the_rust_services_and_is_policed() {
    let mesh = python_mesh();
    let alice = token("alice", &["user"]);

    // The Python frontend calls user (Rust, same node) and reservation (Rust, other
    // node) at once and merges them in an internal step: the Rust frontend's answer.
    let (status, headers, body) = mesh.get("/hotels?user=7", Some(&alice));
    let text = String::from_utf8_lossy(&body);
    assert_eq!(status, 200, "{text}");
    assert_eq!(header(&headers, "content-type"), Some("application/json"));
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["user"], serde_json::json!({"id": "7", "name": "guest-7"}));
    assert_eq!(v["reservations"][0]["hotel"], "harbour-view");
    assert_eq!(v["reservations"][1]["nights"], 1);

    // The DPU proxies' filters police it before any Python runs.
    let (status, _, _) = mesh.get("/hotels?user=7", None);
    assert_eq!(status, 401, "no token");
    let (status, _, _) = mesh.get("/admin/stats", Some(&alice));
    assert_eq!(status, 403, "a user is not an admin");

    // A failing egress call fails its step and the sequence stops there: 502 naming
    // the step (no service `inventory` in this mesh).
    let (status, _, body) = mesh.get("/hotels/inventory", Some(&alice));
    let text = String::from_utf8_lossy(&body);
    assert_eq!(status, 502, "{text}");
    assert!(
        text.contains("\"stock\""),
        "the failed step is named: {text}"
    );
    assert!(!text.contains("never reached"), "{text}");

    // A handler that answers by itself is served as is; Flask's own 404 too.
    let (status, _, body) = mesh.get("/ping", Some(&alice));
    assert_eq!((status, body.as_slice()), (200, &b"pong\n"[..]));
    let (status, _, _) = mesh.get("/hotels/nowhere", Some(&alice));
    assert_eq!(status, 404);

    // Flask reads the body the data path delivered (request.get_data()), and its
    // answer carries headers back: 0 B, 1 KiB, 1 MiB intact both ways.
    for len in [0usize, 1024, 1 << 20] {
        let sent: Vec<u8> = (0..len).map(|i| (i * 13 + i / 97) as u8).collect();
        let (status, headers, got) = mesh.post("/echo", &alice, &sent);
        assert_eq!(status, 200, "{len} B");
        assert_eq!(header(&headers, "x-len"), Some(len.to_string().as_str()));
        assert_eq!(
            header(&headers, "x-crc32"),
            Some(crc32fast::hash(&sent).to_string().as_str()),
            "{len} B arrived intact"
        );
        let mut want = sent;
        want.reverse();
        assert!(got == want, "{len} B came back intact");
    }
}

#[test]
fn the_rust_frontend_calls_a_python_user_service() {
    require_package();
    let mesh = hotel_with_python_user("users:app");
    let alice = token("alice", &["user"]);
    let (status, _, body) = mesh.get("/hotels?user=3", Some(&alice));
    let text = String::from_utf8_lossy(&body);
    assert_eq!(status, 200, "{text}");
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        v["user"],
        serde_json::json!({"id": "3", "name": "guest-3", "served_by": "python"})
    );
    assert_eq!(v["reservations"][0]["hotel"], "harbour-view");
}

#[test]
fn the_rust_frontend_calls_a_fastapi_user_service() {
    require_modules("dpumesh._native, fastapi");
    let mesh = hotel_with_python_user("--asgi, users_asgi:app");
    let alice = token("alice", &["user"]);
    let (status, _, body) = mesh.get("/hotels?user=5", Some(&alice));
    let text = String::from_utf8_lossy(&body);
    assert_eq!(status, 200, "{text}");
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["user"]["name"], "guest-5", "{v}");
    assert_eq!(v["user"]["served_by"], "fastapi", "{v}");
    // The caller is the mesh's word: the frontend's workload identity.
    let caller = v["user"]["caller"].as_str().unwrap_or_default();
    assert!(caller.ends_with("/sa/frontend"), "{v}");
}

/// The Rust hotel mesh with its `frontend` served by
/// `python3 -m dpumesh.server --asgi front_asgi:app` (`cli/tests/python_apps`).
fn hotel_with_fastapi_frontend() -> Mesh {
    require_modules("dpumesh._native, fastapi");
    let app_dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/python_apps")
        .canonicalize()
        .unwrap();
    Mesh::up_with(|m| {
        let python = format!(
            "frontend: {{nodes: [node1], command: [python3, -m, dpumesh.server, --asgi, --app-dir, {}, front_asgi:app]}}",
            app_dir.display()
        );
        let edited = m.replace(
            "frontend: {nodes: [node1], command: [hotel, frontend]}",
            &python,
        );
        assert_ne!(edited, m, "the sample's frontend line is as expected");
        edited
    })
}

#[test]
fn a_fastapi_service_serves_requests_concurrently_calls_the_mesh_and_streams() {
    let mesh = hotel_with_fastapi_frontend();
    let alice = token("alice", &["user"]);

    // A request that waits for another is answered once the other is: served one at
    // a time, the second would queue behind the first and the first time out.
    let waiting = {
        let (client, alice) = (Client(mesh.ingress), alice.clone());
        std::thread::spawn(move || client.get("/hotels/wait", Some(&alice)))
    };
    std::thread::sleep(std::time::Duration::from_millis(300));
    let (status, _, body) = mesh.get("/hotels/release", Some(&alice));
    assert_eq!((status, body.as_slice()), (200, &b"releasing\n"[..]));
    let (status, _, body) = waiting.join().unwrap();
    assert_eq!(
        (status, String::from_utf8_lossy(&body).as_ref()),
        (200, "released\n")
    );

    // A handler awaits a call to the Rust user service through the mesh.
    let (status, _, body) = mesh.get("/hotels/user?id=4", Some(&alice));
    let text = String::from_utf8_lossy(&body);
    assert_eq!(status, 200, "{text}");
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["status"], 200, "{v}");
    assert_eq!(v["user"]["name"], "guest-4", "{v}");
    // Server-sent events: the first is at the client while the second waits for a
    // request the client makes after reading it.
    let mut s = std::net::TcpStream::connect(mesh.ingress).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(20)))
        .unwrap();
    use std::io::{Read, Write};
    write!(
        s,
        "GET /events/ticks HTTP/1.1\r\nhost: hotel\r\nauthorization: Bearer {alice}\r\nconnection: close\r\n\r\n"
    )
    .unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains("data: first") {
        let n = s.read(&mut buf).unwrap();
        assert!(
            n > 0,
            "the stream ended early: {}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
    }
    assert!(!String::from_utf8_lossy(&got).contains("data: second"));
    let (status, _, _) = mesh.get("/hotels/tick", Some(&alice));
    assert_eq!(status, 200);
    s.read_to_end(&mut got).unwrap();
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.contains("text/event-stream"), "{text}");
    assert!(text.contains("data: second"), "{text}");

    // A download larger than a stream's buffers, made as the client reads it.
    let (status, _, body) = mesh.get("/download/big?mib=16", Some(&alice));
    assert_eq!(status, 200);
    assert_eq!(body.len(), 16 << 20, "the whole download arrives");
    let block: Vec<u8> = (0..65536u32).map(|i| (i % 251) as u8).collect();
    for (i, part) in body.chunks(65536).enumerate() {
        assert!(
            part == block.as_slice(),
            "block {i} of the download is intact"
        );
    }

    // An upload past the loop's whole-body limit (8 MiB), read part by part as it
    // arrives: with its length over h2c, chunked over HTTP/1.1.
    let sent: Vec<u8> = (0..(20u32 << 20))
        .map(|i| (i * 7 + i / 4093) as u8)
        .collect();
    let file = mesh._dir.path().join("upload");
    std::fs::write(&file, &sent).unwrap();
    for args in [
        &["--http2-prior-knowledge"][..],
        &["-H", "transfer-encoding: chunked"],
    ] {
        let out = Command::new("curl")
            .args(["-s", "--fail-with-body", "--max-time", "120", "-H"])
            .arg(format!("authorization: Bearer {alice}"))
            .arg("--data-binary")
            .arg(format!("@{}", file.display()))
            .args(args)
            .arg(format!("http://{}/upload/count", mesh.ingress))
            .output()
            .expect("curl runs");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{args:?}: {text}");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["bytes"], sent.len(), "{args:?}: {v}");
        assert_eq!(v["crc32"], crc32fast::hash(&sent), "{args:?}: {v}");
        assert!(v["parts"].as_u64().unwrap() > 1, "it came in parts: {v}");
    }

    // Answers of 5xx last: the sample's circuit breaker counts them.
    // A call the mesh cannot carry comes back as the mesh's answer, not a hang.
    let (status, _, _) = mesh.get("/hotels/nowhere", Some(&alice));
    assert!(status >= 400, "{status}");
    // Graphs are for WSGI handlers: said (FastAPI answers its own 500 for the
    // exception, whose text is in the pod's log), not a hang.
    let (status, _, body) = mesh.get("/hotels/graph", Some(&alice));
    assert_eq!(status, 500, "{}", String::from_utf8_lossy(&body));
    wait(
        "the pod's log names the mistake",
        std::time::Duration::from_secs(5),
        &|| mesh.log.lock().unwrap().contains("answers by itself"),
    );

    // A header HTTP does not allow is the app's error, said; nothing is injected.
    let (status, headers, body) = mesh.get("/hotels/badheader", Some(&alice));
    let text = String::from_utf8_lossy(&body);
    assert_eq!(status, 500, "{text}");
    assert!(text.contains("invalid value for header x-bad"), "{text}");
    assert_eq!(header(&headers, "x-injected"), None);
}

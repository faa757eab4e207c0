//! A proxy-wasm plugin that pauses requests for HTTP calls, in the hotel mesh under
//! `dpumesh up`: calls to a mesh service on the same node and on the other node (over
//! the fabric), to a configured upstream outside the mesh, an answer that denies, and
//! a call that never answers (its timeout) — while other requests keep flowing; and a
//! shared queue whose registrant is woken in the node.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dpumesh_test_support::joined;

mod common;
use common::mesh::*;

/// An upstream outside the mesh: answers each request `200 ok` with `x-user:
/// ext-user` and keeps what it was asked; `silent` never answers.
fn upstream(silent: bool) -> (String, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let asked = Arc::new(Mutex::new(Vec::new()));
    let kept = asked.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut s) = stream else { return };
            let kept = kept.clone();
            std::thread::spawn(move || {
                let mut got = Vec::new();
                let mut buf = [0u8; 4096];
                loop {
                    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                        match s.read(&mut buf) {
                            Ok(0) | Err(_) => return,
                            Ok(n) => got.extend_from_slice(&buf[..n]),
                        }
                    }
                    let end = got.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
                    kept.lock()
                        .unwrap()
                        .push(String::from_utf8_lossy(&got[..end]).to_lowercase());
                    got.drain(..end);
                    if silent {
                        std::thread::sleep(Duration::from_secs(30));
                        return;
                    }
                    let reply =
                        b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\nx-user: ext-user\r\n\r\nok\n";
                    if s.write_all(reply).is_err() {
                        return;
                    }
                }
            });
        }
    });
    (address, asked)
}

fn plugin(name: &str, via: &str, upstream: &str, path: &str, timeout_ms: u64) -> String {
    plugin_with(name, via, upstream, path, timeout_ms, "")
}

fn plugin_with(
    name: &str,
    via: &str,
    upstream: &str,
    path: &str,
    timeout_ms: u64,
    extra: &str,
) -> String {
    format!(
        "  {name}:\n    component: {}\n    deadline: 100ms\n    config: {{auth: {{prefix: '/ping?via={via}', upstream: {upstream}, path: '{path}', timeout_ms: {timeout_ms}}}{extra}}}\n",
        dpumesh_test_artifacts::PROXY_WASM_TEST
    )
}

#[test]
fn requests_wait_for_their_plugins_calls_to_mesh_services_and_upstreams() {
    let (ext, asked) = upstream(false);
    let (slow, _) = upstream(true);
    let (ticked, tick_asked) = upstream(false);
    let mesh = Mesh::up_edited(
        |m| m,
        |policy| {
            let filters = [
                // This one also edits every response's headers on the way out.
                plugin_with(
                    "pw-user",
                    "user",
                    "user",
                    "/user?id=",
                    3000,
                    ", response_header: [powered-by, proxy-wasm]",
                ),
                plugin(
                    "pw-peer",
                    "peer",
                    "reservation",
                    "/reservations?user=",
                    3000,
                ),
                plugin("pw-deny", "deny", "frontend", "/nothing", 3000),
                plugin("pw-ext", "ext", "ext", "/check", 3000),
                plugin("pw-slow", "slow", "slow", "/check", 300),
                // And a shared queue whose news wake the thread that registered it.
                plugin_with("pw-queue", "none", "user", "/", 3000, ", queue: jobs"),
                // And ticks whose root context calls an upstream; the answers go back
                // to the root.
                plugin_with(
                    "pw-tick",
                    "none",
                    "user",
                    "/",
                    3000,
                    ", tick_ms: 100, tick_call: ticked",
                ),
            ]
            .concat();
            policy
                .replacen("filters:\n", &format!("filters:\n{filters}"), 1)
                .replacen(
                    "chains:\n",
                    "chains:\n  calls: [pw-user, pw-peer, pw-deny, pw-ext, pw-slow, pw-queue, pw-tick]\n",
                    1,
                )
                .replacen(
                    "routes:\n",
                    "routes:\n  - {path_prefix: /ping, service: frontend, chain: calls}\n",
                    1,
                )
                + &format!(
                    "upstreams:\n  ext: {{address: \"{ext}\"}}\n  slow: {{address: \"{slow}\"}}\n  ticked: {{address: \"{ticked}\"}}\n"
                )
        },
    );
    let client = mesh.client();
    let node1 = mesh.admins()[0];

    // A call to a service on this node (user), and one to a service on the other
    // node (reservation, over the fabric): both answer 200, the request goes on.
    for via in ["user", "peer"] {
        let (status, headers, body) = client.get(&format!("/ping?via={via}"), None);
        assert_eq!(
            (status, body.as_slice()),
            (200, &b"pong\n"[..]),
            "via {via}: {}",
            String::from_utf8_lossy(&body)
        );
        // The plugin's response header edit reached the client.
        assert_eq!(header(&headers, "powered-by"), Some("proxy-wasm (200)"));
    }
    // The called service's own policy answers (the frontend wants a token): the
    // plugin denies on it.
    let (status, headers, body) = client.get("/ping?via=deny", None);
    assert_eq!(
        (status, String::from_utf8_lossy(&body).as_ref()),
        (403, "auth said 401\n")
    );
    // A local reply passes the response phase too.
    assert_eq!(header(&headers, "powered-by"), Some("proxy-wasm (403)"));
    // A configured upstream outside the mesh, asked as the plugin said.
    let (status, _, _) = client.get("/ping?via=ext", None);
    assert_eq!(status, 200);
    {
        let asked = asked.lock().unwrap();
        let first = asked.first().expect("the upstream was called");
        assert!(
            first.starts_with("get /check/ping?via=ext http/1.1"),
            "{first}"
        );
        assert!(first.contains("host: auth.local"), "{first}");
        assert!(first.contains("x-asked-by: proxy-wasm-test"), "{first}");
    }
    // No answer within the call's 300 ms: the plugin is told, and answers 503.
    let (status, headers, _) = client.get("/ping?via=slow", None);
    assert_eq!(status, 503);
    assert_eq!(header(&headers, "x-auth-failed"), Some("no answer"));

    // Many at once, mixed with requests that make no call: the shard parks each and
    // serves the rest meanwhile; every one is answered.
    let handles: Vec<_> = (0..16)
        .map(|i| {
            let client = Client(mesh.ingress);
            std::thread::spawn(move || {
                let path = match i % 4 {
                    0 => "/ping?via=user",
                    1 => "/ping?via=peer",
                    2 => "/ping?via=ext",
                    _ => "/ping",
                };
                client.status(path, None)
            })
        })
        .collect();
    for handle in handles {
        assert_eq!(joined(handle), 200);
    }
    let calls = metric_sum(node1, "dpumesh_filter_callouts_total");
    assert!(calls >= 17.0, "calls made: {calls}");

    // A request enqueues an item; the instance that registered the queue (the
    // shard's or a pool worker's) is woken and counts it, which later responses say.
    let enqueue =
        b"GET /ping HTTP/1.1\r\nhost: hotel\r\nx-enqueue: job-1\r\nconnection: close\r\n\r\n";
    assert_eq!(client.raw(enqueue).0, 200);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (_, headers, _) = client.get("/ping", None);
        if header(&headers, "x-queue-items") == Some("1") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the queue's registrant was never told: {headers:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }

    // The plugin's ticks call an upstream from the root context: the node makes the
    // calls, and the answers reach the root (which later responses say).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (_, headers, _) = client.get("/ping", None);
        if header(&headers, "x-root-answer") == Some("200 ok") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no tick's call was answered to the root: {headers:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let asked = tick_asked.lock().unwrap();
    let first = asked.first().expect("the tick's upstream was called");
    assert!(first.starts_with("get /tick http/1.1"), "{first}");
}

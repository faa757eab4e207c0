//! The ingress's routes follow the policy file: a route a reload adds is served
//! without a restart, and a file that does not load leaves the routes in use.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::time::{Duration, Instant};

fn status(ingress: SocketAddr, path: &str) -> String {
    let mut s = TcpStream::connect(ingress).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nhost: svc\r\nconnection: close\r\n\r\n").as_bytes(),
    )
    .unwrap();
    let mut reply = String::new();
    let _ = s.read_to_string(&mut reply);
    reply.lines().next().unwrap_or_default().to_owned()
}

fn save(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// `path`'s status once it is `want`, within 5 s (the file is looked at every 250 ms).
fn becomes(ingress: SocketAddr, path: &str, want: &str) -> String {
    let started = Instant::now();
    loop {
        let got = status(ingress, path);
        if got.starts_with(want) || started.elapsed() > Duration::from_secs(5) {
            return got;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_route_added_to_the_policy_is_served_without_a_restart() {
    let node = common::fake_node(
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicUsize::new(0)),
    );
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policy.yaml");
    let one = "chains: {open: []}\nservices: {svc: {chain: open}}\nroutes: [{path_prefix: /a, service: svc}]\n";
    save(&policy, one);
    let ingress = common::ingress(policy.clone(), node);
    let addr = ingress.addr();
    assert!(status(addr, "/a").starts_with("HTTP/1.1 200"));
    assert!(
        status(addr, "/b").starts_with("HTTP/1.1 404"),
        "no route yet"
    );
    save(
        &policy,
        &one.replace("routes: [", "routes: [{path_prefix: /b, service: svc}, "),
    );
    let got = becomes(addr, "/b", "HTTP/1.1 200");
    assert!(got.starts_with("HTTP/1.1 200"), "the added route: {got}");
    // A policy that does not load: the routes in use stay.
    save(&policy, "routes: [{service: svc, nonsense: 1}]\n");
    std::thread::sleep(Duration::from_millis(800));
    assert!(status(addr, "/b").starts_with("HTTP/1.1 200"));
    assert!(status(addr, "/a").starts_with("HTTP/1.1 200"));
    // A route removed is gone.
    save(&policy, one);
    let got = becomes(addr, "/b", "HTTP/1.1 404");
    assert!(got.starts_with("HTTP/1.1 404"), "the removed route: {got}");
}

//! The local mesh end to end through real processes: `dpumesh up` on the hotel sample
//! (two nodes, four services, the ingress), driven over plain TCP like any client.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

use dpumesh_test_support::joined;

mod common;
use common::mesh::*;
use common::token;

#[test]
fn the_hotel_mesh_serves_polices_and_carries_bodies_end_to_end() {
    let mesh = Mesh::up();
    let alice = token("alice", &["user"]);

    // Both nodes run on this machine and share its cores: neither has `cores:`, so
    // each runs half of them as shards (at least one).
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let nodes = pids_of(&mesh.child.id().to_string(), "dpumesh node");
    assert_eq!(nodes.len(), 2);
    for pid in nodes {
        assert_eq!(shard_threads(pid), (cores / 2).clamp(1, 64), "node {pid}");
    }

    // Allowed: frontend calls user (same node) and reservation (other node) in
    // parallel and merges them.
    let (status, _, body) = mesh.get("/hotels?user=7", Some(&alice));
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["user"]["id"], "7");
    assert_eq!(v["user"]["name"], "guest-7");
    assert_eq!(v["reservations"][0]["hotel"], "harbour-view");

    // Denials come from the DPU proxy's chain, before any service.
    let (status, _, body) = mesh.get("/hotels?user=7", None);
    assert_eq!(status, 401, "{}", String::from_utf8_lossy(&body));
    let (status, _, _) = mesh.get("/admin/stats", Some(&alice));
    assert_eq!(status, 403, "a user is not an admin");
    let bob = token("bob", &["user"]);
    let codes: Vec<u16> = (0..4).map(|_| mesh.get("/limited", Some(&bob)).0).collect();
    assert_eq!(codes, [200, 200, 200, 429], "3 tokens per minute for bob");

    // Bodies of 0 B, 1 KiB and 8 MiB go to the service and back intact.
    for len in [0usize, 1024, 8 << 20] {
        let sent: Vec<u8> = (0..len).map(|i| (i * 7 + i / 251) as u8).collect();
        let (status, headers, got) = mesh.post("/echo", &alice, &sent);
        assert_eq!(
            status,
            200,
            "{len} B: {}",
            String::from_utf8_lossy(&got[..got.len().min(200)])
        );
        assert_eq!(header(&headers, "x-len"), Some(len.to_string().as_str()));
        assert_eq!(
            header(&headers, "x-crc32"),
            Some(crc32fast::hash(&sent).to_string().as_str()),
            "{len} B arrived intact"
        );
        let mut want = sent.clone();
        want.reverse();
        assert!(got == want, "{len} B came back intact");
    }

    // A failing upstream opens the breaker (503 without calling it), which then
    // lets a probe through and closes again.
    let codes: Vec<u16> = (0..4)
        .map(|_| mesh.get("/flaky?fail=1", Some(&alice)).0)
        .collect();
    assert_eq!(codes, [500, 500, 500, 503]);
    assert_eq!(mesh.get("/flaky", Some(&alice)).0, 503, "still open");
    // After its ejection time the breaker lets a probe through, which closes it.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match mesh.get("/flaky", Some(&alice)).0 {
            200 => break,
            503 if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            other => panic!("the breaker did not recover: {other}"),
        }
    }
}

#[test]
fn malformed_and_ambiguous_requests_are_refused_at_the_ingress() {
    let mesh = Mesh::up();
    let alice = token("alice", &["user"]);
    let auth = format!("authorization: Bearer {alice}\r\n");
    // Request smuggling: a second request hidden in the first one's body must never
    // reach a service. Each vector gets 400 and the connection is closed.
    let vectors = [
        (
            "CL.TE",
            format!(
                "POST /echo HTTP/1.1\r\nhost: hotel\r\n{auth}content-length: 6\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\nGET /admin HTTP/1.1\r\nhost: hotel\r\n\r\n"
            ),
        ),
        (
            "TE.CL",
            format!(
                "POST /echo HTTP/1.1\r\nhost: hotel\r\n{auth}transfer-encoding: chunked\r\ncontent-length: 3\r\n\r\n8\r\nSMUGGLED\r\n0\r\n\r\n"
            ),
        ),
        (
            "TE.TE",
            format!(
                "POST /echo HTTP/1.1\r\nhost: hotel\r\n{auth}transfer-encoding: chunked\r\ntransfer-encoding: cow\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
            ),
        ),
        (
            "obfuscated TE",
            format!(
                "POST /echo HTTP/1.1\r\nhost: hotel\r\n{auth}transfer-encoding: xchunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
            ),
        ),
        (
            "two content-lengths",
            format!(
                "POST /echo HTTP/1.1\r\nhost: hotel\r\n{auth}content-length: 5\r\ncontent-length: 6\r\n\r\nhello!"
            ),
        ),
    ];
    for (name, request) in vectors {
        let mut s = TcpStream::connect(mesh.ingress).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(request.as_bytes()).unwrap();
        let (status, _, _) = read_response(&mut s).unwrap_or_else(|| panic!("{name}: no response"));
        assert!(
            status == 400 || status == 501,
            "{name}: refused, got {status}"
        );
        // Nothing more comes on that connection: no second response.
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        assert!(
            !String::from_utf8_lossy(&rest).contains("HTTP/1.1"),
            "{name}: a smuggled request was answered: {}",
            String::from_utf8_lossy(&rest)
        );
    }
    // Invalid header bytes.
    let (status, _, _) = mesh.raw(b"GET /ping HTTP/1.1\r\nhost: hotel\r\nx-bad: a\x01b\r\n\r\n");
    assert_eq!(status, 400);
    // A head over the limit: 431.
    let big = "a".repeat(40 << 10);
    let (status, _, _) = mesh
        .raw(format!("GET /ping HTTP/1.1\r\nhost: hotel\r\n{auth}x-big: {big}\r\n\r\n").as_bytes());
    assert_eq!(status, 431);
    // A body over the limit, announced: 413 before it is sent.
    let (status, _, body) = mesh.raw(
        format!(
            "POST /echo HTTP/1.1\r\nhost: hotel\r\n{auth}content-length: {}\r\n\r\n",
            9 << 20
        )
        .as_bytes(),
    );
    assert_eq!(status, 413, "{}", String::from_utf8_lossy(&body));
    // A body that never comes: 408 after the body timeout (2 s here).
    let started = Instant::now();
    let (status, _, body) = mesh.raw(
        format!(
            "POST /echo HTTP/1.1\r\nhost: hotel\r\n{auth}content-length: 100\r\n\r\nonly ten b"
        )
        .as_bytes(),
    );
    assert_eq!(status, 408, "{}", String::from_utf8_lossy(&body));
    assert!(started.elapsed() >= Duration::from_millis(1900));
    // The mesh still serves afterwards.
    let (status, _, _) = mesh.get("/ping", Some(&alice));
    assert_eq!(status, 200);
}

#[test]
fn a_killed_replica_costs_at_most_its_requests_and_a_reload_under_load_none() {
    let mesh = Mesh::up();
    let alice = token("alice", &["user"]);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let served = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let clients = load(&mesh, "/hotels?user=3", &alice, 4, &stop, &served);
    // Each phase waits for what it needs to see, not for a fixed time.
    let wait = |what: &str, done: &dyn Fn() -> bool| {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !done() {
            assert!(Instant::now() < deadline, "never happened: {what}");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let more_served = |n: usize| {
        let served = served.clone();
        let from = served.load(std::sync::atomic::Ordering::Relaxed);
        move || served.load(std::sync::atomic::Ordering::Relaxed) >= from + n
    };
    wait("the load is flowing", &more_served(20));
    // Kill one of the two user replicas of this mesh (children of its `up`).
    let users = pids_of(&mesh.child.id().to_string(), "hotel user");
    assert_eq!(users.len(), 2, "two user replicas: {users:?}");
    Command::new("kill")
        .args(["-KILL", &users[0].to_string()])
        .status()
        .unwrap();
    let node1 = mesh.admins()[0];
    wait("the killed replica is restarted and registered", &|| {
        let now = pids_of(&mesh.child.id().to_string(), "hotel user");
        now.len() == 2 && !now.contains(&users[0]) && metric(node1, "dpumesh_pods") == 4.0
    });
    wait("requests served after the restart", &more_served(20));
    // A reload of the policy on every node while the load goes on.
    let reload_started = Instant::now();
    let policy = mesh._dir.path().join("policy.yaml");
    let text = std::fs::read_to_string(&policy).unwrap();
    std::fs::write(
        &policy,
        text.replace("cache_entries: 1000", "cache_entries: 2000"),
    )
    .unwrap();
    wait("every node runs generation 2", &|| {
        mesh.admins().into_iter().all(|a| generation(a) == 2)
    });
    wait("requests served on generation 2", &more_served(20));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (mut ok, mut failed) = (0, Vec::new());
    for c in clients {
        let (o, f, _) = joined(c);
        ok += o;
        failed.extend(f);
    }
    assert!(ok > 20, "the mesh kept serving: {ok} ok");
    let mut by_status = std::collections::BTreeMap::new();
    for (_, f) in &failed {
        *by_status.entry(*f).or_insert(0usize) += 1;
    }
    // The kill may cost the requests the pod held (retries usually save them: at most
    // one per client can be in flight); the reload costs none.
    let during_reload = failed
        .iter()
        .filter(|(at, _)| *at >= reload_started)
        .count();
    assert!(
        failed.len() <= 4 && during_reload == 0,
        "failures: {by_status:?} (status: count; {during_reload} during the reload; {ok} ok)"
    );
    // The killed pod's slots are reclaimed and nothing else is held once idle: node1
    // runs frontend, flaky and two users again (the killed one was restarted).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let idle = [
            "dpumesh_exchanges_in_flight",
            "dpumesh_pool_slots_in_use{pool=\"dpu_tx_header\"}",
            "dpumesh_pool_slots_in_use{pool=\"dpu_rx_header\"}",
            "dpumesh_pool_slots_in_use{pool=\"pod_bodies\"}",
        ]
        .map(|m| metric(node1, m));
        let pods = metric(node1, "dpumesh_pods");
        if idle.iter().all(|v| *v == 0.0) && pods == 4.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "node1 not back to idle with 4 pods: in flight/slots {idle:?}, pods {pods}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // Both nodes still run the new generation.
    for admin in mesh.admins() {
        assert_eq!(generation(admin), 2);
    }
}

/// Threads of process `pid` that are proxy shards.
fn shard_threads(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|name| name.starts_with("dpumesh-shard-"))
        .count()
}

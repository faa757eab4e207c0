//! Faults through real processes: a pod that stops reading its ring (SIGSTOP: hung,
//! deadlocked, swapped out) — the mesh answers for it at once, the others serve on,
//! and once it is back nothing is left held; and a fabric link that drops while
//! bodies cross it (the node at its far end killed) — every client gets the whole
//! body or an error, never a truncated 200.

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use dpumesh_test_support::joined;

mod common;
use common::mesh::*;
use common::token;

/// The mesh file's request timeout (see `mesh_files`).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// How late past its deadline a timed-out answer may come on a loaded machine: the
/// node's timer fires on a shard that two CPU burners may keep off the CPU for a few
/// scheduler periods, and the answer then crosses the ingress. A hang would exceed it
/// by far (the clients' read timeout is 30 s).
const LATE: Duration = Duration::from_secs(3);

fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill {sig} {pid}");
}

/// One request to the reservation service (straight from the ingress).
fn reservation(client: &Client) -> Option<Reply> {
    client.try_raw(
        b"GET /reservations?user=3 HTTP/1.1\r\nhost: reservation\r\nconnection: close\r\n\r\n",
    )
}

/// Once the reservation service serves, stops its pod (SIGSTOP); returns its pid.
fn stop_the_reservation_pod(mesh: &Mesh) -> u32 {
    let client = mesh.client();
    wait("reservation serves", Duration::from_secs(60), &|| {
        reservation(&client).is_some_and(|r| r.0 == 200)
    });
    let pod = the_one(&mesh.child.id().to_string(), "hotel reservation");
    signal(pod, "-STOP");
    pod
}

/// The sample with its reservation service exposed as a virtual host (the tests drive
/// it directly).
fn reservation_exposed(policy: String) -> String {
    common::expose(policy, "reservation")
}

#[test]
fn a_pod_that_stops_reading_gets_503_with_retry_after_and_the_rest_serves_on() {
    let mesh = Mesh::up_edited(|m| m, reservation_exposed);
    let alice = token("alice", &["user"]);
    let up = mesh.child.id().to_string();
    let client = mesh.client();
    let pod = stop_the_reservation_pod(&mesh);
    // Clients keep asking the stopped pod's service for a while.
    let stop = Arc::new(AtomicBool::new(false));
    let askers: Vec<_> = (0..6)
        .map(|_| {
            let (stop, client) = (stop.clone(), Client(mesh.ingress));
            std::thread::spawn(move || {
                let mut seen = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let started = Instant::now();
                    let reply = reservation(&client);
                    seen.push((reply, started.elapsed()));
                }
                seen
            })
        })
        .collect();
    // The other services serve as before, on the same node and the other one. A ping
    // held behind the stopped pod would wait for the request timeout; anything less
    // is the machine's own delay (two CPU burners beside the test take seconds at
    // worst, never the timeout).
    let until = Instant::now() + Duration::from_secs(4);
    let mut pings = 0;
    while Instant::now() < until {
        let started = Instant::now();
        let (status, _, _) = mesh.get("/ping", Some(&alice));
        assert_eq!(status, 200, "the frontend is unaffected");
        assert!(
            started.elapsed() < REQUEST_TIMEOUT,
            "a ping waited as long as a timeout: {:?}",
            started.elapsed()
        );
        pings += 1;
        std::thread::sleep(Duration::from_millis(50));
    }
    stop.store(true, Ordering::Relaxed);
    let seen: Vec<_> = askers.into_iter().flat_map(joined).collect();
    signal(pod, "-CONT");
    let mut back_pressure = 0;
    for (reply, took) in &seen {
        let (status, headers, body) = reply.as_ref().expect("every request is answered");
        assert!(
            *status == 503 || *status == 504,
            "a stopped pod's service answers 503/504, got {status}: {}",
            String::from_utf8_lossy(body)
        );
        assert!(
            *took < REQUEST_TIMEOUT + LATE,
            "answered within its timeout: {took:?}"
        );
        if *status == 503 {
            assert_eq!(
                headers
                    .iter()
                    .find(|(k, _)| k == "retry-after")
                    .map(|(_, v)| v.as_str()),
                Some("1"),
                "back-pressure says when to come back: {}",
                String::from_utf8_lossy(body)
            );
            back_pressure += 1;
        }
    }
    // "At once" is "without waiting for the timeout": a fifth of it leaves a loaded
    // machine room while no wait for the timeout can pass.
    let fast = seen
        .iter()
        .filter(|(reply, took)| {
            reply.as_ref().is_some_and(|r| r.0 == 503) && *took < REQUEST_TIMEOUT / 5
        })
        .count();
    eprintln!(
        "{} requests to the stopped pod: {back_pressure} refused (503), {fast} of them within \
         {:?}; {pings} pings served meanwhile",
        seen.len(),
        REQUEST_TIMEOUT / 5
    );
    assert!(
        back_pressure > 0 && fast > 0,
        "once stalled, refused at once"
    );
    // Back: it serves again, and nothing stays held on any node.
    wait("reservation serves again", Duration::from_secs(30), &|| {
        reservation(&client).is_some_and(|r| r.0 == 200)
    });
    for admin in mesh.admins() {
        wait_idle(admin, Duration::from_secs(15));
    }
    let pids: Vec<u32> = ["dpumesh node", "dpumesh ingress", "hotel"]
        .iter()
        .flat_map(|p| pids_of(&up, p))
        .collect();
    drop(mesh);
    for pid in pids {
        assert_eq!(
            regions_of(pid),
            Vec::<String>::new(),
            "no region of {pid} left"
        );
    }
}

/// POSTs `body` to the reservation service's echo (node2: across the fabric from
/// the ingress, both ways).
fn echo(client: &Client, body: &[u8]) -> Option<Reply> {
    let mut r = format!(
        "POST /echo HTTP/1.1\r\nhost: reservation\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    r.extend_from_slice(body);
    client.try_raw(&r)
}

#[test]
fn a_link_dropped_mid_body_never_yields_a_truncated_200() {
    // The TCP fabric (with its mutual TLS): the link is a connection that breaks.
    let mesh = Mesh::up_edited(
        |m| m.replace("policy: policy.yaml", "policy: policy.yaml\ntransport: tcp"),
        reservation_exposed,
    );
    let up = mesh.child.id().to_string();
    let client = mesh.client();
    let body: Arc<Vec<u8>> = Arc::new(
        (0..(2usize << 20))
            .map(|i| (i * 13 + i / 509) as u8)
            .collect(),
    );
    wait("echo serves", Duration::from_secs(60), &|| {
        echo(&client, &body).is_some_and(|r| r.0 == 200)
    });
    let stop = Arc::new(AtomicBool::new(false));
    // Whole echoes so far, so that each phase waits for what it needs to see.
    let echoed = Arc::new(AtomicUsize::new(0));
    let senders: Vec<_> = (0..4)
        .map(|_| {
            let (stop, client, body, echoed) = (
                stop.clone(),
                Client(mesh.ingress),
                body.clone(),
                echoed.clone(),
            );
            std::thread::spawn(move || {
                let mut want = body.to_vec();
                want.reverse();
                let (mut whole, mut errors, mut dropped) = (0, 0, 0);
                while !stop.load(Ordering::Relaxed) {
                    match echo(&client, &body) {
                        Some((200, headers, got)) => {
                            assert_eq!(
                                header(&headers, "content-length"),
                                Some(body.len().to_string().as_str())
                            );
                            assert!(
                                got == want,
                                "a 200 carried {} of {} bytes, or other bytes",
                                got.len(),
                                body.len()
                            );
                            whole += 1;
                            echoed.fetch_add(1, Ordering::Relaxed);
                        }
                        Some((status, _, got)) => {
                            assert!(
                                status >= 500,
                                "an error status, got {status}: {}",
                                String::from_utf8_lossy(&got)
                            );
                            errors += 1;
                        }
                        None => dropped += 1,
                    }
                }
                (whole, errors, dropped)
            })
        })
        .collect();
    let more_echoed = |n: usize| {
        let from = echoed.load(Ordering::Relaxed);
        let echoed = echoed.clone();
        move || echoed.load(Ordering::Relaxed) >= from + n
    };
    // Bodies are flowing from every sender (some of them are then in flight).
    wait(
        "the senders' echoes flow",
        Duration::from_secs(60),
        &more_echoed(8),
    );
    let node2 = the_one(&up, "dpumesh node .*--name node2");
    signal(node2, "-KILL");
    // `up` starts it again; the senders go on through its return.
    wait(
        "node2 is back and echo serves",
        Duration::from_secs(60),
        &|| echo(&client, &body).is_some_and(|r| r.0 == 200),
    );
    wait(
        "the senders' echoes flow again",
        Duration::from_secs(60),
        &more_echoed(8),
    );
    stop.store(true, Ordering::Relaxed);
    let (mut whole, mut errors, mut dropped) = (0, 0, 0);
    for t in senders {
        let (w, e, d) = joined(t);
        (whole, errors, dropped) = (whole + w, errors + e, dropped + d);
    }
    eprintln!(
        "2 MiB echoes across a link killed mid-way: {whole} whole, {errors} errors, {dropped} connections dropped without an answer"
    );
    assert!(whole > 0 && errors > 0, "the kill hit bodies in flight");
    assert_eq!(dropped, 0, "every client got an answer");
    for admin in mesh.admins() {
        wait_idle(admin, Duration::from_secs(15));
    }
    drop(mesh);
    assert_eq!(
        regions_of(node2),
        Vec::<String>::new(),
        "the killed node's regions are swept"
    );
}

#[test]
fn an_exhausted_ingress_pool_refuses_with_retry_after_and_loses_no_slot() {
    // One slot in the whole ingress: a leaked slot would stop it for good. (Every
    // asker is this test's one address: its share is the whole ingress, so the askers
    // meet the pool's limit, not the per-client one.)
    let mesh = Mesh::up_edited(
        |m| {
            m.replace(
                "  request_timeout: 5s",
                "  request_timeout: 2s\n  slots: 1\n  slots_per_client: 8\n  threads: 1",
            )
        },
        reservation_exposed,
    );
    let client = mesh.client();
    let pod = stop_the_reservation_pod(&mesh);
    let ask_all = |n: usize| -> Vec<(Option<Reply>, Duration)> {
        let askers: Vec<_> = (0..n)
            .map(|_| {
                let client = Client(mesh.ingress);
                std::thread::spawn(move || {
                    let started = Instant::now();
                    (reservation(&client), started.elapsed())
                })
            })
            .collect();
        askers.into_iter().map(joined).collect()
    };
    let seen = ask_all(8);
    signal(pod, "-CONT");
    let mut at_capacity = 0;
    for (reply, took) in &seen {
        let (status, headers, body) = reply.as_ref().expect("every request is answered");
        let body = String::from_utf8_lossy(body);
        assert!(matches!(status, 503 | 504), "got {status}: {body}");
        // A wait for the slot ends within the request timeout (2 s, the mesh file
        // above), and an exchange that got the slot times out after as long again;
        // a loaded machine answers at most LATE after that.
        assert!(
            *took < 2 * Duration::from_secs(2) + LATE,
            "bounded wait: {took:?}"
        );
        if body.contains("at capacity") {
            assert_eq!(header(headers, "retry-after"), Some("1"), "{body}");
            at_capacity += 1;
        }
    }
    assert!(
        at_capacity > 0,
        "waiting for the one slot ends in 503 at capacity"
    );
    // The slot came back: everything is served again, one after the other.
    wait("reservation serves again", Duration::from_secs(30), &|| {
        reservation(&client).is_some_and(|r| r.0 == 200)
    });
    let after = ask_all(8);
    assert!(
        after
            .iter()
            .all(|(r, _)| r.as_ref().is_some_and(|r| r.0 == 200)),
        "{:?}",
        after
            .iter()
            .map(|(r, _)| r.as_ref().map(|r| r.0))
            .collect::<Vec<_>>()
    );
    for admin in mesh.admins() {
        wait_idle(admin, Duration::from_secs(15));
    }
}

#[test]
fn logs_to_a_full_disk_lose_no_request() {
    // `/dev/full` fails every write with ENOSPC: what a full log partition does to a
    // process whose output is redirected to a file there.
    let dir = tempfile::tempdir().unwrap();
    let (file, ingress) = mesh_files_with(dir.path(), |m| m, reservation_exposed);
    let full = || {
        std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .unwrap()
    };
    let mut up = dpumesh_test_support::Reaped(
        Command::new(env!("CARGO_BIN_EXE_dpumesh"))
            .args(["up", "--config"])
            .arg(&file)
            .stdout(full())
            .stderr(full())
            .spawn()
            .unwrap(),
    );
    let client = Client(ingress);
    let alice = token("alice", &["user"]);
    wait("the mesh serves", Duration::from_secs(120), &|| {
        client.status("/hotels?user=7", Some(&alice)) == 200
    });
    // A pod killed makes `up` and the node log (restart, re-registration): still
    // nothing fails but the log lines.
    let pod = the_one(&up.id().to_string(), "hotel reservation");
    signal(pod, "-KILL");
    wait("reservation serves again", Duration::from_secs(60), &|| {
        reservation(&client).is_some_and(|r| r.0 == 200)
    });
    for _ in 0..50 {
        assert_eq!(client.status("/hotels?user=7", Some(&alice)), 200);
    }
    assert!(up.try_wait().unwrap().is_none(), "`up` still runs");
    let mesh = dpumesh_config::MeshFile::read(&file).unwrap();
    for node in mesh.config.nodes.values() {
        let admin = node.admin.unwrap();
        wait_idle(admin, Duration::from_secs(15));
    }
    let pids: Vec<u32> = ["dpumesh node", "dpumesh ingress", "hotel"]
        .iter()
        .flat_map(|p| pids_of(&up.id().to_string(), p))
        .collect();
    signal(up.id(), "-INT");
    let status = up.wait().unwrap();
    assert!(status.success(), "`up` stops cleanly: {status:?}");
    for pid in pids {
        assert_eq!(
            regions_of(pid),
            Vec::<String>::new(),
            "no region of {pid} left"
        );
    }
}

//! Faults that do not kill anything, through real processes: a pod that stops reading
//! its ring (SIGSTOP: hung, deadlocked, swapped out). The mesh answers for it at
//! once, the others serve on, and once it is back nothing is left held.

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

mod common;
use common::mesh::*;
use common::token;

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

#[test]
fn a_pod_that_stops_reading_gets_503_with_retry_after_and_the_rest_serves_on() {
    let mesh = Mesh::up();
    let alice = token("alice", &["user"]);
    let up = mesh.child.id().to_string();
    let client = mesh.client();
    wait("reservation serves", Duration::from_secs(60), &|| {
        reservation(&client).is_some_and(|r| r.0 == 200)
    });
    let pod = the_one(&up, "hotel reservation");
    signal(pod, "-STOP");
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
    // The other services serve as before, on the same node and the other one.
    let until = Instant::now() + Duration::from_secs(4);
    let mut pings = 0;
    while Instant::now() < until {
        let started = Instant::now();
        let (status, _, _) = mesh.get("/ping", Some(&alice));
        assert_eq!(status, 200, "the frontend is unaffected");
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "{:?}",
            started.elapsed()
        );
        pings += 1;
        std::thread::sleep(Duration::from_millis(50));
    }
    stop.store(true, Ordering::Relaxed);
    let seen: Vec<_> = askers.into_iter().flat_map(|t| t.join().unwrap()).collect();
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
            *took < Duration::from_secs(6),
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
    let fast = seen
        .iter()
        .filter(|(_, took)| *took < Duration::from_millis(200))
        .count();
    eprintln!(
        "{} requests to the stopped pod: {back_pressure} refused (503), {fast} of them within \
         200 ms; {pings} pings served meanwhile",
        seen.len()
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
        wait("the node is idle again", Duration::from_secs(15), &|| {
            metric_sum(admin, "dpumesh_exchanges_in_flight") == 0.0
                && metric_sum(admin, "dpumesh_pool_slots_in_use") == 0.0
        });
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

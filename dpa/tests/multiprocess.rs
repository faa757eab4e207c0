//! Rings and pools shared by separate processes: this test binary re-executes itself
//! as the peer (`peer_entry`, selected by an environment variable), maps the regions
//! the parent created by path, and plays its part.

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::Arc;
use std::time::Duration;

mod common;

use dpumesh_dpa::{
    Buffer, BufferPool, Case, Descriptor, Destination, OwnerId, PoolLayout, Ring, RingError,
    SharedRegion, WakeMode,
};

const ROLE: &str = "DPUMESH_DPA_PEER_ROLE";

/// A peer process, killed if the test ends (or fails) before it does.
struct Peer(Child);

impl Peer {
    fn wait(&mut self) -> std::process::ExitStatus {
        self.0.wait().expect("wait for the peer")
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn_peer(role: &str, paths: &[&Path]) -> Peer {
    let mut cmd = common::this_test_binary();
    cmd.args([
        "--exact",
        "peer_entry",
        "--ignored",
        "--nocapture",
        "--test-threads",
        "1",
    ])
    .env(ROLE, role)
    // The harness's own chatter; a panic still reaches stderr.
    .stdout(Stdio::null());
    for (i, p) in paths.iter().enumerate() {
        cmd.env(format!("DPUMESH_DPA_PEER_PATH{i}"), p);
    }
    Peer(cmd.spawn().expect("spawn the peer process"))
}

fn peer_path(i: usize) -> PathBuf {
    PathBuf::from(std::env::var(format!("DPUMESH_DPA_PEER_PATH{i}")).unwrap())
}

fn open_ring(i: usize) -> Ring {
    Ring::attach(Arc::new(SharedRegion::open(&peer_path(i)).unwrap())).unwrap()
}

fn open_pool(i: usize) -> BufferPool {
    BufferPool::attach(Arc::new(SharedRegion::open(&peer_path(i)).unwrap())).unwrap()
}

fn desc(req: u32, body: Buffer) -> Descriptor {
    Descriptor::request(Case::PodToPod, req, 0, 1, Destination::Pod(2)).with_body(body)
}

/// The peer's side of each test. Ignored in normal runs; the tests start it.
#[test]
#[ignore = "entry point of the peer process the other tests spawn"]
fn peer_entry() {
    let role = std::env::var(ROLE).expect("run by the multi-process tests");
    match role.as_str() {
        // Echo descriptors from ring 0 to ring 1 until a descriptor with req_id 0.
        "echo-poll" | "echo-event" => {
            let mode = if role == "echo-poll" {
                WakeMode::Poll
            } else {
                WakeMode::LOW_CPU
            };
            let mut rx = open_ring(0).consumer();
            let mut tx = open_ring(1).producer();
            loop {
                let Some(d) = rx.pop_wait(mode, Duration::from_secs(20)).unwrap() else {
                    panic!("no descriptor within 20 s");
                };
                while tx.push(&d).is_err() {
                    std::thread::yield_now();
                }
                if d.req_id == 0 {
                    break;
                }
            }
        }
        // Fill 50 slots of pool 2 (owner 5) with a pattern and send them on ring 0;
        // read the released count back on ring 1.
        "producer-with-pool" => {
            let mut tx = open_ring(0).producer();
            let pool = open_pool(2);
            for n in 1..=50u32 {
                let slot = pool.alloc(OwnerId(5)).unwrap();
                let bytes: Vec<u8> = (0..n * 100).map(|i| (i * 31 + n) as u8).collect();
                let buffer = pool.write(slot, &bytes).unwrap();
                // Ownership travels with the descriptor: to the parent (owner 6).
                pool.transfer(slot, OwnerId(5), OwnerId(6)).unwrap();
                tx.push(&desc(n, buffer)).unwrap();
            }
        }
        // Take slots, say so on ring 0, and hang until killed.
        "hoard-and-hang" => {
            let mut tx = open_ring(0).producer();
            let pool = open_pool(1);
            for _ in 0..12 {
                pool.alloc(OwnerId(9)).unwrap();
            }
            tx.push(&desc(12, Buffer::NONE)).unwrap();
            std::thread::sleep(Duration::from_secs(60));
        }
        // Push until the ring refuses; report how many went in with the exit code.
        "fill" => {
            let mut tx = open_ring(0).producer();
            let mut n = 0;
            loop {
                match tx.push(&desc(n + 1, Buffer::NONE)) {
                    Ok(()) => n += 1,
                    Err(RingError::Full { .. }) => break,
                    Err(e) => panic!("{e}"),
                }
            }
            std::process::exit(n as i32);
        }
        other => panic!("unknown role {other}"),
    }
}

fn round_trips(role: &str, mode: WakeMode) {
    let to_peer = Ring::create_in_shm("dpumesh-mp-ring", 64).unwrap();
    let from_peer = Ring::create_in_shm("dpumesh-mp-ring", 64).unwrap();
    let mut child = spawn_peer(role, &[to_peer.region().path(), from_peer.region().path()]);
    let (mut tx, mut rx) = (to_peer.producer(), from_peer.consumer());
    let total = 20_000u32;
    let mut sent = 1u32;
    let mut received = 1u32;
    // Keep up to 32 in flight so both ends see a busy ring, not only ping-pong.
    while received <= total {
        while sent <= total && sent - received < 32 {
            let d = desc(sent, Buffer::NONE);
            tx.push(&d).unwrap();
            sent += 1;
        }
        let d = rx
            .pop_wait(mode, Duration::from_secs(20))
            .unwrap()
            .expect("the peer answers");
        assert_eq!(d.req_id, received, "in order, none lost or repeated");
        received += 1;
    }
    tx.push(&desc(0, Buffer::NONE)).unwrap();
    assert_eq!(
        rx.pop_wait(mode, Duration::from_secs(20))
            .unwrap()
            .unwrap()
            .req_id,
        0
    );
    assert!(child.wait().success());
}

#[test]
fn descriptors_cross_processes_in_polling_mode() {
    round_trips("echo-poll", WakeMode::Poll);
}

#[test]
fn descriptors_cross_processes_in_event_mode() {
    round_trips("echo-event", WakeMode::LOW_CPU);
}

#[test]
fn pool_slots_and_their_ownership_cross_processes() {
    let ring = Ring::create_in_shm("dpumesh-mp-ring", 64).unwrap();
    let pool = BufferPool::create_in_shm("dpumesh-mp-pool", 1, PoolLayout::new(8192, 64)).unwrap();
    let unused = Ring::create_in_shm("dpumesh-mp-ring", 2).unwrap();
    let mut child = spawn_peer(
        "producer-with-pool",
        &[
            ring.region().path(),
            unused.region().path(),
            pool.region().path(),
        ],
    );
    let mut rx = ring.consumer();
    for n in 1..=50u32 {
        let d = rx
            .pop_wait(WakeMode::LOW_CPU, Duration::from_secs(20))
            .unwrap()
            .unwrap();
        assert_eq!(d.req_id, n);
        let bytes = pool.read(d.body).unwrap();
        let expected: Vec<u8> = (0..n * 100).map(|i| (i * 31 + n) as u8).collect();
        assert_eq!(
            crc32fast::hash(&bytes),
            crc32fast::hash(&expected),
            "slot {n} arrived intact"
        );
        let slot = pool.slot_of(d.body).unwrap();
        // The peer handed it to us: it can no longer free it, we can.
        pool.release(slot, OwnerId(6)).unwrap();
    }
    assert!(child.wait().success());
    assert_eq!(pool.in_use(), 0);
}

#[test]
fn a_dead_peers_slots_are_reclaimed() {
    let ring = Ring::create_in_shm("dpumesh-mp-ring", 4).unwrap();
    let pool = BufferPool::create_in_shm("dpumesh-mp-pool", 1, PoolLayout::new(64, 16)).unwrap();
    let mut child = spawn_peer(
        "hoard-and-hang",
        &[ring.region().path(), pool.region().path()],
    );
    let mut rx = ring.consumer();
    let d = rx
        .pop_wait(WakeMode::LOW_CPU, Duration::from_secs(20))
        .unwrap()
        .expect("the peer took its slots");
    assert_eq!(d.req_id, 12);
    assert_eq!(pool.held_by(OwnerId(9)), 12);
    for _ in 0..4 {
        pool.alloc(OwnerId(1)).unwrap();
    }
    assert!(
        pool.alloc(OwnerId(1)).is_err(),
        "16 slots: 12 hoarded, 4 ours"
    );

    child.0.kill().unwrap();
    child.wait();
    // Whoever learns of the death (the control channel's EOF, here `wait`) reclaims.
    assert_eq!(pool.reclaim(OwnerId(9)), 12);
    assert_eq!(pool.in_use(), 4);
    for _ in 0..12 {
        pool.alloc(OwnerId(1)).unwrap();
    }
}

#[test]
fn a_full_ring_reports_back_pressure_to_another_process() {
    let ring = Ring::create_in_shm("dpumesh-mp-ring", 32).unwrap();
    let mut child = spawn_peer("fill", &[ring.region().path()]);
    let status = child.wait();
    assert_eq!(status.code(), Some(32), "exactly the capacity went in");
    let mut rx = ring.consumer();
    for n in 1..=32 {
        assert_eq!(rx.try_pop().unwrap().unwrap().req_id, n);
    }
    assert_eq!(rx.try_pop().unwrap(), None);
}

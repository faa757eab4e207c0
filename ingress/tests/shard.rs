//! An ingress shard under supervision, and an ingress that stops: a panic of the
//! shard's fabric pump answers what it held (503, never a hang), the pump comes back
//! and serves again; a pump that keeps panicking is left down and calls get a 503
//! naming it at once; a request in flight when the ingress stops gets 503 "shutting
//! down" once the drain grace is over.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use dpumesh_dpa::fabric::shm::ShmFabric;
use dpumesh_error::{ErrorKind, ProxyError};
use dpumesh_fabric_client::health::Health;
use dpumesh_fabric_client::{Answer, Client};
use dpumesh_head::wire;

async fn call(shard: &Client<ShmFabric>, node: SocketAddr) -> Result<Answer, ProxyError> {
    let slot = shard.acquire().await;
    let answer = shard.call(node, slot, Vec::new(), 0, Duration::from_secs(5));
    tokio::time::timeout(Duration::from_secs(10), answer)
        .await
        .expect("an answer comes: never a hang")
        .expect("the answer is never dropped unsent")
}

#[tokio::test(flavor = "current_thread")]
async fn a_panicking_pump_answers_what_it_held_and_serves_again() {
    let local = tokio::task::LocalSet::new();
    local
        .run_until(async {
            let hold = Arc::new(AtomicBool::new(false));
            let got = Arc::new(AtomicUsize::new(0));
            let node = common::fake_node(hold.clone(), got.clone());
            let shard: Rc<Client<ShmFabric>> = Client::new(
                "ingress",
                ShmFabric::new(),
                8,
                4096,
                Arc::new(Health::new([])),
            )
            .unwrap();
            shard.spawn_pump();
            let answer = call(&shard, node).await.unwrap();
            assert_eq!(wire::decode_response(&answer.head).unwrap().status, 200);
            assert_eq!(&answer.body[..], b"ok");

            // A request the node holds (it got it), then the pump panics.
            hold.store(true, Ordering::SeqCst);
            let held = call(&shard, node);
            let panic = async {
                while got.load(Ordering::SeqCst) < 2 {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                shard.inject_panic();
            };
            let (held, ()) = tokio::join!(held, panic);
            let e = held.unwrap_err();
            assert_eq!((e.kind(), e.status()), (ErrorKind::ThreadLost, 503), "{e}");

            // The pump is back; the shard links again and serves.
            hold.store(false, Ordering::SeqCst);
            let answer = call(&shard, node).await.unwrap();
            assert_eq!(wire::decode_response(&answer.head).unwrap().status, 200);
            let health = &shard.supervisor().threads()[0];
            assert_eq!(health.panics(), 1);
            assert!(health.running());
            assert_eq!(shard.ready(), Ok(()));
        })
        .await;
}

#[tokio::test(flavor = "current_thread")]
async fn a_pump_that_keeps_panicking_is_left_down_and_calls_get_503() {
    let local = tokio::task::LocalSet::new();
    local
        .run_until(async {
            let node = common::fake_node(Arc::new(AtomicBool::new(false)), Arc::default());
            let shard: Rc<Client<ShmFabric>> = Client::new(
                "ingress",
                ShmFabric::new(),
                8,
                4096,
                Arc::new(Health::new([])),
            )
            .unwrap();
            shard.spawn_pump();
            let health = shard.supervisor().threads()[0].clone();
            for n in 1..=6 {
                shard.inject_panic();
                while health.panics() < n {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
            while !health.dead() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let e = call(&shard, node).await.unwrap_err();
            assert_eq!((e.kind(), e.status()), (ErrorKind::ThreadLost, 503), "{e}");
            assert!(e.message().contains("dpumesh-ingress-pump"), "{e}");
        })
        .await;
}

#[test]
fn a_request_in_flight_when_the_ingress_stops_gets_503_shutting_down() {
    let hold = Arc::new(AtomicBool::new(true));
    let got = Arc::new(AtomicUsize::new(0));
    let node = common::fake_node(hold, got.clone());
    let dir = tempfile::tempdir().unwrap();
    let policy = common::open_policy(dir.path());
    let ingress = common::ingress(policy, node);
    let addr = ingress.addr();
    let client = std::thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        s.write_all(b"GET /x HTTP/1.1\r\nhost: svc\r\n\r\n")
            .unwrap();
        let mut reply = String::new();
        let _ = s.read_to_string(&mut reply);
        reply
    });
    while got.load(Ordering::SeqCst) < 1 {
        std::thread::sleep(Duration::from_millis(5));
    }
    drop(ingress);
    let reply = dpumesh_test_support::joined(client);
    assert!(reply.starts_with("HTTP/1.1 503"), "{reply}");
    assert!(reply.contains("shutting down"), "{reply}");
}

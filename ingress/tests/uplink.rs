//! The ingress uplink under supervision: a panic of its thread answers what it held
//! (503, never a hang), the thread comes back and serves again, and a thread that
//! keeps panicking is left down — calls then get a 503 naming it, at once.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use dpumesh_dpa::fabric::soft::SoftFabric;
use dpumesh_dpa::fabric::{CompletionQueue, Fabric, QpCaps, QpListener};
use dpumesh_dpa::frame::{Message, Response, ResponseBody};
use dpumesh_dpa::link::{Link, LinkEvent};
use dpumesh_error::{ErrorKind, ProxyError};
use dpumesh_head::wire::{self, ResponseHead};
use dpumesh_ingress::{Answer, Call, Uplink};

/// A node that answers every request 200, or holds them while `hold` is set; it
/// counts the requests it got in `got`.
fn fake_node(hold: Arc<AtomicBool>, got: Arc<AtomicUsize>) -> SocketAddr {
    let fabric = SoftFabric::new();
    let pd = fabric.alloc_pd().unwrap();
    let cq = fabric.create_cq(4096).unwrap();
    let listener = fabric
        .listen(&pd, "127.0.0.1:0".parse().unwrap(), &cq, QpCaps::default())
        .unwrap();
    let addr = listener.local_addr();
    std::thread::spawn(move || {
        let mut links: Vec<Link<SoftFabric>> = Vec::new();
        let mut wcs = Vec::new();
        loop {
            if let Ok(Some(qp)) = listener.accept(Duration::from_millis(1)) {
                links.push(Link::new(&fabric, &pd, qp).unwrap());
            }
            wcs.clear();
            cq.poll(&mut wcs, 64);
            for wc in &wcs {
                let Some(link) = links.iter_mut().find(|l| l.qp_num() == wc.qp_num) else {
                    continue;
                };
                let Ok(Some(LinkEvent::Message(Message::Request(r)))) = link.on_completion(wc)
                else {
                    continue;
                };
                got.fetch_add(1, Ordering::SeqCst);
                if hold.load(Ordering::SeqCst) {
                    continue;
                }
                let head = wire::encode_response(&ResponseHead {
                    status: 200,
                    headers: Default::default(),
                })
                .unwrap();
                let _ = link.send(Message::Response(Response {
                    xid: r.xid,
                    body: ResponseBody::None,
                    head,
                }));
            }
            links.retain(|l| !l.is_down());
        }
    });
    addr
}

async fn call(uplink: &Uplink, node: SocketAddr) -> Result<Answer, ProxyError> {
    let slot = uplink.slots().acquire().await;
    let (reply, answer) = tokio::sync::oneshot::channel();
    uplink.call(Call {
        node,
        slot,
        head: Vec::new(),
        body_len: 0,
        deadline: Duration::from_secs(5),
        reply,
    });
    tokio::time::timeout(Duration::from_secs(10), answer)
        .await
        .expect("an answer comes: never a hang")
        .expect("the reply is never dropped unanswered")
}

#[tokio::test(flavor = "current_thread")]
async fn a_panicking_uplink_answers_what_it_held_and_serves_again() {
    let hold = Arc::new(AtomicBool::new(false));
    let got = Arc::new(AtomicUsize::new(0));
    let node = fake_node(hold.clone(), got.clone());
    let uplink = Uplink::start(SoftFabric::new(), 8, 4096).unwrap();
    let answer = call(&uplink, node).await.unwrap();
    assert_eq!(wire::decode_response(&answer.head).unwrap().status, 200);

    // A request the node holds (it got it), then the uplink thread panics.
    hold.store(true, Ordering::SeqCst);
    let held = call(&uplink, node);
    let panic = async {
        while got.load(Ordering::SeqCst) < 2 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        uplink.inject_panic();
    };
    let (held, ()) = tokio::join!(held, panic);
    let e = held.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ThreadLost, "{e}");
    assert_eq!(e.status(), 503);

    // The thread is back; it connects again and serves.
    hold.store(false, Ordering::SeqCst);
    let answer = call(&uplink, node).await.unwrap();
    assert_eq!(wire::decode_response(&answer.head).unwrap().status, 200);
    let health = &uplink.supervisor().threads()[0];
    assert_eq!(health.panics(), 1);
    assert!(health.running());
    assert_eq!(uplink.supervisor().ready(), Ok(()));
}

#[tokio::test(flavor = "current_thread")]
async fn an_uplink_that_keeps_panicking_is_left_down_and_calls_get_503() {
    let node = fake_node(Arc::new(AtomicBool::new(false)), Arc::default());
    let uplink = Uplink::start(SoftFabric::new(), 8, 4096).unwrap();
    let health = uplink.supervisor().threads()[0].clone();
    for n in 1..=6 {
        uplink.inject_panic();
        while health.panics() < n {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    while !health.dead() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let e = call(&uplink, node).await.unwrap_err();
    assert_eq!(e.status(), 503, "{e}");
    assert_eq!(e.kind(), ErrorKind::ThreadLost);
    assert!(e.message().contains("dpumesh-uplink"), "{e}");
    assert!(uplink.supervisor().ready().is_err());
}

#[tokio::test(flavor = "current_thread")]
async fn a_request_in_flight_when_the_ingress_stops_gets_503_shutting_down() {
    let hold = Arc::new(AtomicBool::new(true));
    let got = Arc::new(AtomicUsize::new(0));
    let node = fake_node(hold, got.clone());
    let uplink = Uplink::start(SoftFabric::new(), 8, 4096).unwrap();
    let slot = uplink.slots().acquire().await;
    let (reply, answer) = tokio::sync::oneshot::channel();
    uplink.call(Call {
        node,
        slot,
        head: Vec::new(),
        body_len: 0,
        deadline: Duration::from_secs(5),
        reply,
    });
    while got.load(Ordering::SeqCst) < 1 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    drop(uplink);
    let e = answer.await.unwrap().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ShuttingDown, "{e}");
    assert_eq!(
        e.status(),
        503,
        "shutting down is unavailable, not a bad gateway"
    );
}

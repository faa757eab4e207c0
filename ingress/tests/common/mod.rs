//! What the ingress's integration tests share: a node that answers, and an ingress in
//! front of it.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use dpumesh_dpa::fabric::shm::ShmFabric;
use dpumesh_dpa::fabric::{CompletionQueue, Fabric, QpCaps, QpListener};
use dpumesh_dpa::frame::{Message, Response, ResponseBody};
use dpumesh_dpa::link::{Link, LinkEvent};
use dpumesh_head::wire::{self, ResponseHead};
use dpumesh_ingress::{Ingress, Settings};

/// A node that answers every request 200, or holds them while `hold` is set; it
/// counts the requests it got in `got`.
pub fn fake_node(hold: Arc<AtomicBool>, got: Arc<AtomicUsize>) -> SocketAddr {
    let fabric = ShmFabric::new();
    let pd = fabric.alloc_pd().unwrap();
    let cq = fabric.create_cq(4096).unwrap();
    let listener = fabric
        .listen(&pd, "127.0.0.1:0".parse().unwrap(), &cq, QpCaps::default())
        .unwrap();
    let addr = listener.local_addr();
    std::thread::spawn(move || {
        let mut links: Vec<Link<ShmFabric>> = Vec::new();
        let mut completions = Vec::new();
        loop {
            if let Ok(Some(qp)) = listener.accept(Duration::from_millis(1)) {
                links.push(Link::new(&fabric, &pd, qp).unwrap());
            }
            completions.clear();
            cq.poll(&mut completions, 64);
            for wc in &completions {
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
                    ..Default::default()
                })
                .unwrap();
                let _ = link.send(Message::Response(Response {
                    xid: r.xid,
                    body: ResponseBody::Inline(b"ok".to_vec()),
                    head,
                }));
            }
            links.retain(|l| !l.is_down());
        }
    });
    addr
}

/// A policy file in `dir` routing every request to service `svc`, with no filter.
pub fn open_policy(dir: &std::path::Path) -> PathBuf {
    let policy = dir.join("policy.yaml");
    std::fs::write(
        &policy,
        "chains: {open: []}\nservices: {svc: {chain: open}}\nroutes: [{service: svc}]\n",
    )
    .unwrap();
    policy
}

/// One shard of an ingress with `policy`, its service `svc` on `node`.
pub fn ingress(policy: PathBuf, node: SocketAddr) -> Ingress {
    ingress_with(policy, node, |_| {})
}

/// [`ingress`] with its settings changed by `change`.
pub fn ingress_with(
    policy: PathBuf,
    node: SocketAddr,
    change: impl FnOnce(&mut Settings),
) -> Ingress {
    let mut settings = Settings {
        listen: "127.0.0.1:0".parse().unwrap(),
        max_head: 32 << 10,
        max_body: 4096,
        body_timeout: Duration::from_secs(5),
        header_timeout: Duration::from_secs(5),
        idle_timeout: Duration::from_secs(60),
        park_after: Duration::from_millis(250),
        max_headers: 100,
        request_timeout: Duration::from_secs(1),
        slots: 4,
        slots_per_client: 4,
        threads: Some(1),
        policy,
        services: BTreeMap::from([("svc".to_owned(), vec![node])]),
        admin: None,
        path: Default::default(),
        eject: None,
        tls: None,
    };
    change(&mut settings);
    Ingress::start(ShmFabric::new(), settings).unwrap()
}

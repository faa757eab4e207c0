//! A pod across PCIe: the fabric reaches its bodies only through the node's staging
//! copies of its body pools (`dma::manager::Staging`), which the DMA manager keeps in
//! step with the host's pools: a TX body staged when the proxy asks, before the
//! fabric reads it; an RX body the fabric wrote carried to the host at delivery.

use std::time::{Duration, Instant};

use dpumesh_dpa::control::transport::Endpoint;
use dpumesh_dpa::dma::manager::WindowCopyError;
use dpumesh_dpa::{
    Buffer, Case, Descriptor, Destination, Dpu, DpuConfig, HostPort, Incoming, Outgoing,
};

use super::body;

#[test]
fn across_pcie_the_fabric_reaches_a_pods_bodies_only_through_their_staging_copies() {
    let dir = tempfile::tempdir().unwrap();
    let control = Endpoint::Unix(dir.path().join("control.sock"));
    let mut config = DpuConfig::new("staging");
    config.across_pcie = true;
    config.pod.body_slots = 8;
    let node = Dpu::start(config, &control).unwrap();
    let mut port = node.take_shards().remove(0);
    let mut pod = HostPort::connect(&control, "stager", "svc-stage").unwrap();
    let me = pod.pod_id();
    let info = port.pod(me).unwrap();

    // A response body for the fabric (to pod 0, outside the node).
    let sent = body(5000, 3);
    pod.send(&Outgoing {
        case: Case::ExternalToHost,
        dst: Destination::Pod(0),
        req_id: 5,
        step_id: 1,
        response: true,
        status: 200,
        stream: false,
        header: b"status=200",
        body: &sent,
        lane: 0,
    })
    .unwrap();
    let d = super::streams::next(&mut port);
    assert_eq!(d.body.len, 5000);
    // The fabric's memory does not hold it until it is staged: a body that stays on
    // the host never crosses PCIe for nothing.
    assert_ne!(info.read_tx_body(d.body).unwrap(), sent);
    let copied = node
        .stats()
        .bytes
        .load(std::sync::atomic::Ordering::Relaxed);
    port.stage_tx(me, d.body, 0, d.body.len).unwrap();
    assert_eq!(info.read_tx_body(d.body).unwrap(), sent, "staged whole");
    assert_eq!(
        node.stats()
            .bytes
            .load(std::sync::atomic::Ordering::Relaxed)
            - copied,
        5000,
        "one copy of the body across PCIe"
    );
    // A range past the body, or a body the manager does not hold, is refused.
    assert!(matches!(
        port.stage_tx(me, d.body, 4000, 2000),
        Err(WindowCopyError::OutOfSlot { .. })
    ));
    let mut done = d;
    done.kind.completion = true;
    port.forward(&done).unwrap();
    // Handed back: the pod has its slot again, and the manager holds it no more.
    let deadline = Instant::now() + Duration::from_secs(20);
    while pod.in_flight() > 0 {
        port.pass();
        port.wake_pods();
        let _ = pod.try_recv().unwrap();
        assert!(Instant::now() < deadline, "the body's slot never came back");
    }
    assert!(matches!(
        port.stage_tx(me, d.body, 0, 10),
        Err(WindowCopyError::NotHandedOver(_))
    ));

    // A body the fabric wrote into the pod's staging copy reaches the host when it
    // is delivered.
    let slot = port.reserve_body(me, 6000).unwrap();
    let part = body(6000, 9);
    let memory = info.rx_body_memory().expect("a staging copy across PCIe");
    let at = info.rx_body.offset_of(Buffer::new(slot.addr, 0)).unwrap();
    memory.write(at, &part).unwrap();
    let out = Descriptor::request(Case::ExternalToHost, 6, 1, 0, Destination::Pod(me))
        .with_header(port.alloc_header(b"status=200").unwrap())
        .with_body(Buffer::new(slot.addr, 6000));
    port.forward(&out).unwrap();
    match delivered(&mut port, &mut pod) {
        Incoming::Message { body, .. } => assert_eq!(body, part, "the fabric's bytes"),
        other => panic!("expected the body, got {other:?}"),
    }
}

/// The pod's next message, the shard passing meanwhile (across PCIe its rings reach
/// the host only by the shard's pushes, at the end of a batch).
fn delivered(port: &mut dpumesh_dpa::DpuShard, pod: &mut HostPort) -> Incoming {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        port.pass();
        port.wake_pods();
        if let Some(incoming) = pod.try_recv().unwrap() {
            return incoming;
        }
        assert!(Instant::now() < deadline, "nothing reached the pod in 20 s");
        std::thread::sleep(Duration::from_millis(1));
    }
}

//! Stream parts through one node's DMA manager: parts and their `Sent`, the proxy's
//! cancel notice, a caller's `Taken` for an answer streaming to its call, and a
//! window of a streamed answer copied into a slot of its own.

use std::time::{Duration, Instant};

use dpumesh_dpa::control::transport::Endpoint;
use dpumesh_dpa::dma::manager::WindowCopyError;
use dpumesh_dpa::{
    Buffer, Case, Descriptor, DescriptorStatus, Destination, Dpu, DpuConfig, HostPort, Incoming,
    Outgoing, OwnerId, StreamPart,
};

use super::{body, recv};

#[test]
fn stream_parts_both_ways_come_back_as_sent_and_a_cancel_reaches_its_pod() {
    let dir = tempfile::tempdir().unwrap();
    let node = Dpu::start(
        DpuConfig::new("streams"),
        &Endpoint::Unix(dir.path().join("control.sock")),
    )
    .unwrap();
    let mut port = node.take_shards().remove(0);
    let mut pod = HostPort::connect(
        &Endpoint::Unix(dir.path().join("control.sock")),
        "streamer",
        "svc-stream",
    )
    .unwrap();
    let part = body(5000, 7);
    let send = |pod: &mut HostPort, response: bool| {
        // An answer goes back to pod 0 (outside the node); a request to a pod.
        let dst = Destination::Pod(if response { 0 } else { pod.pod_id() });
        pod.send(&Outgoing {
            case: Case::ExternalToHost,
            dst,
            req_id: 41,
            step_id: 2,
            response,
            status: StreamPart::Data.code(),
            stream: true,
            header: &[],
            body: &part,
            lane: 0,
        })
        .unwrap();
    };
    // A data part reaches the proxy as one; handed back, the pod hears `Sent` (its
    // window) with the stream's ids.
    send(&mut pod, true);
    let d = loop {
        if let Some(d) = port.recv(Duration::from_millis(50)).unwrap() {
            break d;
        }
    };
    assert_eq!(d.stream_part(), Some(StreamPart::Data));
    assert_eq!(d.body.len, 5000);
    let mut done = d;
    done.kind.completion = true;
    port.forward(&done).unwrap();
    match recv(&mut pod) {
        Incoming::Sent { descriptor } => {
            assert_eq!((descriptor.req_id, descriptor.step_id), (41, 2));
            assert!(descriptor.kind.response, "the answer's part");
        }
        other => panic!("expected the part back, got {other:?}"),
    }
    assert_eq!(pod.in_flight(), 0, "the part's slot is free again");

    // The proxy's cancel notice (no buffers) is delivered, not freed.
    let mut cancel = d;
    cancel.header = Buffer::NONE;
    cancel.body = Buffer::NONE;
    cancel.kind.completion = true;
    cancel.kind.error = true;
    cancel.status = DescriptorStatus::Cancelled as u16;
    port.forward(&cancel).unwrap();
    match recv(&mut pod) {
        Incoming::Error { descriptor, status } => {
            assert_eq!(status, DescriptorStatus::Cancelled);
            assert!(descriptor.kind.stream);
            assert_eq!(descriptor.req_id, 41);
        }
        other => panic!("expected the cancel notice, got {other:?}"),
    }

    // A part of a request's streamed body (a pod's upload) reaches the proxy too;
    // handed back, its `Sent` says which way it flows, so a pod streaming both ways
    // under the same ids tells its windows apart.
    send(&mut pod, false);
    let up = next(&mut port);
    assert_eq!(up.stream_part(), Some(StreamPart::Data));
    assert!(!up.kind.response);
    let mut done = up;
    done.kind.completion = true;
    port.forward(&done).unwrap();
    match recv(&mut pod) {
        Incoming::Sent { descriptor } => {
            assert!(
                !descriptor.kind.response,
                "the upload's part, not the answer's"
            )
        }
        other => panic!("expected the part back, got {other:?}"),
    }
    assert_eq!(pod.in_flight(), 0);
}

/// Waits for the node's next descriptor for the proxy.
pub(super) fn next(port: &mut dpumesh_dpa::DpuShard) -> Descriptor {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(d) = port.recv(Duration::from_millis(50)).unwrap() {
            return d;
        }
        assert!(
            Instant::now() < deadline,
            "nothing reached the proxy in 20 s"
        );
    }
}

#[test]
fn a_callers_taken_reaches_the_proxy_and_a_window_is_copied_into_a_slot_of_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let control = Endpoint::Unix(dir.path().join("control.sock"));
    let node = Dpu::start(DpuConfig::new("windows"), &control).unwrap();
    let mut port = node.take_shards().remove(0);
    let mut pod = HostPort::connect(&control, "caller", "svc-caller").unwrap();
    let me = pod.pod_id();
    fn ack(part: StreamPart, body: &[u8]) -> Outgoing<'_> {
        Outgoing {
            // The caller answers the stream's opening (from outside the node: pod 0).
            case: Case::ExternalToHost,
            dst: Destination::Pod(0),
            req_id: 9,
            step_id: 3,
            response: false,
            status: part.code(),
            stream: true,
            header: &[],
            body,
            lane: 0,
        }
    }
    // `Taken`, in the request's direction and with no buffers, reaches the proxy as
    // the caller's: its pod is the ring's, not a field it wrote.
    pod.send(&ack(StreamPart::Taken, &[])).unwrap();
    let d = next(&mut port);
    assert_eq!(d.stream_part(), Some(StreamPart::Taken));
    assert!(!d.kind.response);
    assert_eq!((d.src_pod, d.req_id, d.step_id), (me, 9, 3));

    // A `Taken` that carries a body is refused, and the slot comes back.
    pod.send(&ack(StreamPart::Taken, b"smuggled")).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let refusal = loop {
        assert!(
            port.recv(Duration::from_millis(20)).unwrap().is_none(),
            "a Taken with buffers never reaches the proxy"
        );
        if let Some(incoming) = pod.try_recv().unwrap() {
            break incoming;
        }
        assert!(Instant::now() < deadline, "no refusal within 20 s");
    };
    assert!(
        matches!(
            refusal,
            Incoming::Error {
                status: DescriptorStatus::Malformed,
                ..
            }
        ),
        "{refusal:?}"
    );
    assert_eq!(pod.in_flight(), 0);

    // A reply slot lent to the fabric; the peer wrote 5000 bytes into its third
    // window (at 512 KiB).
    let slot = port.reserve_body(me, 1 << 20).unwrap();
    let info = port.pod(me).unwrap();
    let part = body(5000, 11);
    let at = 512 << 10;
    let slot_start = info.rx_body.offset_of(Buffer::new(slot.addr, 0)).unwrap();
    info.rx_body.region().write(slot_start + at, &part).unwrap();
    let copy = port.copy_rx_window(me, slot, at, 5000).unwrap();
    assert_ne!(copy.addr, slot.addr, "a slot of its own");
    // The window's slot stays the fabric's; the copy is delivered like a body the
    // fabric wrote, as a part of the answer.
    let index = info
        .rx_body
        .slot_of(Buffer::new(slot.addr, 0))
        .unwrap()
        .index;
    assert_eq!(
        info.rx_body.state(index).map(|s| s.1),
        Some(OwnerId::FABRIC)
    );
    let mut out =
        Descriptor::request(Case::ExternalToHost, 9, 3, 0, Destination::Pod(me)).with_body(copy);
    out.kind.response = true;
    out.kind.stream = true;
    out.status = StreamPart::Data.code();
    port.forward(&out).unwrap();
    let _ = port.recv(Duration::from_millis(50)).unwrap();
    match recv(&mut pod) {
        Incoming::Message {
            descriptor, body, ..
        } => {
            assert_eq!(descriptor.stream_part(), Some(StreamPart::Data));
            assert_eq!(body, part, "the window's bytes, whole");
        }
        other => panic!("expected the part, got {other:?}"),
    }

    // Bytes past the slot, or a slot the fabric does not hold, are refused.
    let slot_size = info.rx_body.layout().slot_size;
    assert!(matches!(
        port.copy_rx_window(me, slot, u64::from(slot_size) - 10, 11),
        Err(WindowCopyError::OutOfSlot { .. })
    ));
    let _ = info.rx_body.release(
        info.rx_body.slot_of(Buffer::new(slot.addr, 0)).unwrap(),
        OwnerId::FABRIC,
    );
    assert!(matches!(
        port.copy_rx_window(me, slot, 0, 10),
        Err(WindowCopyError::NotTheFabrics(_))
    ));
}

//! The software fabric's own tests (the conformance suite covers the verbs).

use super::*;
use crate::fabric::conformance::pair_with;

#[test]
fn held_sends_wait_for_the_flush_and_leave_in_one_write() {
    let (a, b) = pair_with::<SoftFabric>(Access::all());
    b.qp.post_recv(RecvWr {
        wr_id: 1,
        sge: b.mr.sge(0, 64),
    })
    .unwrap();
    b.qp.post_recv(RecvWr {
        wr_id: 2,
        sge: b.mr.sge(64, 64),
    })
    .unwrap();
    a.region.write(0, b"one two").unwrap();
    a.cq.hold_sends(true);
    for _ in 0..2 {
        a.qp.post_send(SendWr {
            wr_id: 9,
            op: SendOp::Send,
            sge: a.mr.sge(0, 7),
            signaled: false,
        })
        .unwrap();
    }
    // Nothing is on the wire yet: the peer sees no receive complete.
    let mut out = Vec::new();
    assert!(!b.cq.wait(Duration::from_millis(50)).unwrap());
    assert_eq!(b.cq.poll(&mut out, 8), 0);
    a.cq.flush_sends();
    let deadline = Instant::now() + Duration::from_secs(10);
    while out.len() < 2 && Instant::now() < deadline {
        let _ = b.cq.wait(Duration::from_millis(10));
        b.cq.poll(&mut out, 8);
    }
    let ids: Vec<u64> = out.iter().map(|wc| wc.wr_id).collect();
    assert_eq!(ids, vec![1, 2]);
    assert_eq!(b.region.read_vec(64, 7).unwrap(), b"one two");
}

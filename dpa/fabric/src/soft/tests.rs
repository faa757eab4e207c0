//! The software fabric's own tests (the conformance suite covers the verbs).

use super::*;
use crate::conformance::pair_with;

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

#[test]
fn a_hello_says_what_is_wrong_with_it() {
    use super::{HELLO_MAGIC, parse_hello};
    let hello = |magic: u32, version: u32, mode: u32| {
        let mut b = [0u8; 16];
        b[0..4].copy_from_slice(&magic.to_le_bytes());
        b[4..8].copy_from_slice(&version.to_le_bytes());
        b[12..16].copy_from_slice(&mode.to_le_bytes());
        b
    };
    assert_eq!(parse_hello(&hello(HELLO_MAGIC, 2, 0)), Ok(false));
    assert_eq!(parse_hello(&hello(HELLO_MAGIC, 2, 1)), Ok(true));
    for (bytes, why) in [
        (hello(0x1234, 2, 0).to_vec(), "not a DPUmesh"),
        (hello(HELLO_MAGIC, 1, 0).to_vec(), "speaks 2, the peer 1"),
        (hello(HELLO_MAGIC, 2, 7).to_vec(), "security mode 7"),
        (hello(HELLO_MAGIC, 2, 0)[..12].to_vec(), "16 bytes, got 12"),
        (Vec::new(), "16 bytes, got 0"),
    ] {
        let e = parse_hello(&bytes).unwrap_err();
        assert!(e.contains(why), "{e}");
    }
}

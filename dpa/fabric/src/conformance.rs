//! The verbs semantics every [`Fabric`] backend must follow, as tests written once
//! against the trait and run for each backend (`fabric_conformance!`): SEND into a
//! posted receive (held while none is posted), WRITE, READ, immediates, keys, bounds
//! and rights checked before a byte moves, error states and flushes, a peer that goes
//! away, one poller for many queue pairs, interrupts.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::{
    Access, CompletionQueue, Fabric, FabricError, MemoryRegion, QpCaps, QpListener, QpState,
    QueuePair, RecvWr, RemoteAddr, SendOp, SendWr, WcOpcode, WcStatus, WorkCompletion,
};
use dpumesh_rings::shm::SharedRegion;

pub(crate) struct Side<F: Fabric> {
    pub(crate) pd: F::Pd,
    pub(crate) cq: F::Cq,
    pub(crate) qp: F::Qp,
    pub(crate) region: Arc<SharedRegion>,
    pub(crate) mr: F::Mr,
}

/// Two connected queue pairs in this process, each with a 16 MiB region registered
/// with `access`.
pub(crate) fn pair_with<F: Fabric + Default>(access: Access) -> (Side<F>, Side<F>) {
    let fabric = F::default();
    let side = |fabric: &F| {
        let pd = fabric.alloc_pd().unwrap();
        let cq = fabric.create_cq(4096).unwrap();
        let region =
            Arc::new(SharedRegion::create_unique("dpumesh-test-fabric", 16 << 20).unwrap());
        let mr = fabric.register(&pd, &region, 0, 16 << 20, access).unwrap();
        (pd, cq, region, mr)
    };
    let (pd_a, cq_a, region_a, mr_a) = side(&fabric);
    let (pd_b, cq_b, region_b, mr_b) = side(&fabric);
    let listener = fabric
        .listen(
            &pd_b,
            "127.0.0.1:0".parse().unwrap(),
            &cq_b,
            QpCaps::default(),
        )
        .unwrap();
    let addr = listener.local_addr();
    let accept =
        std::thread::spawn(move || listener.accept(Duration::from_secs(10)).unwrap().unwrap());
    let qp_a = fabric
        .connect(&pd_a, addr, &cq_a, QpCaps::default())
        .unwrap();
    let qp_b = dpumesh_test_support::joined(accept);
    (
        Side {
            pd: pd_a,
            cq: cq_a,
            qp: qp_a,
            region: region_a,
            mr: mr_a,
        },
        Side {
            pd: pd_b,
            cq: cq_b,
            qp: qp_b,
            region: region_b,
            mr: mr_b,
        },
    )
}

fn pair<F: Fabric + Default>() -> (Side<F>, Side<F>) {
    pair_with(Access::all())
}

/// Progresses both sides until `side` has a completion (the other side must make
/// progress too: it is the one that reads, writes and answers).
fn next<F: Fabric>(side: &Side<F>, other: &Side<F>) -> WorkCompletion {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut out = Vec::new();
    while Instant::now() < deadline {
        other.cq.poll(&mut Vec::new(), 0);
        if side.cq.poll(&mut out, 1) == 1 {
            return out[0];
        }
        let _ = side.cq.wait(Duration::from_millis(1));
        let _ = other.cq.wait(Duration::from_millis(1));
    }
    panic!("no completion within 20 s");
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8 ^ seed).collect()
}

pub(crate) fn send_with_imm_lands_in_the_posted_receive<F: Fabric + Default>() {
    let (a, b) = pair::<F>();
    b.qp.post_recv(RecvWr {
        wr_id: 77,
        sge: b.mr.sge(4096, 1024),
    })
    .unwrap();
    a.region.write(0, b"hello fabric").unwrap();
    a.qp.post_send(SendWr {
        wr_id: 1,
        op: SendOp::SendWithImm(0xfeed),
        sge: a.mr.sge(0, 12),
        signaled: true,
    })
    .unwrap();
    let wc = next(&b, &a);
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode, wc.byte_len, wc.imm),
        (77, WcStatus::Success, WcOpcode::Recv, 12, Some(0xfeed))
    );
    assert_eq!(b.region.read_vec(4096, 12).unwrap(), b"hello fabric");
    let wc = next(&a, &b);
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode),
        (1, WcStatus::Success, WcOpcode::Send)
    );
}

pub(crate) fn a_send_before_any_receive_waits_for_one<F: Fabric + Default>() {
    let (a, b) = pair::<F>();
    a.region.write(0, b"early").unwrap();
    a.qp.post_send(SendWr {
        wr_id: 1,
        op: SendOp::Send,
        sge: a.mr.sge(0, 5),
        signaled: true,
    })
    .unwrap();
    // Let it arrive with no receive posted.
    for _ in 0..20 {
        b.cq.poll(&mut Vec::new(), 0);
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut none = Vec::new();
    assert_eq!(b.cq.poll(&mut none, 8), 0, "held, not failed");
    b.qp.post_recv(RecvWr {
        wr_id: 9,
        sge: b.mr.sge(100, 64),
    })
    .unwrap();
    let wc = next(&b, &a);
    assert_eq!(
        (wc.wr_id, wc.status, wc.byte_len),
        (9, WcStatus::Success, 5)
    );
    assert_eq!(b.region.read_vec(100, 5).unwrap(), b"early");
    assert_eq!(next(&a, &b).status, WcStatus::Success);
}

pub(crate) fn write_read_and_write_with_imm_move_8_mib_intact<F: Fabric + Default>() {
    let (a, b) = pair::<F>();
    let data = pattern(8 << 20, 3);
    a.region.write(0, &data).unwrap();
    // WRITE a → b.
    a.qp.post_send(SendWr {
        wr_id: 1,
        op: SendOp::Write(b.mr.remote(1 << 20)),
        sge: a.mr.sge(0, data.len() as u32),
        signaled: true,
    })
    .unwrap();
    let wc = next(&a, &b);
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode),
        (1, WcStatus::Success, WcOpcode::RdmaWrite)
    );
    assert_eq!(
        crc32fast::hash(&b.region.read_vec(1 << 20, data.len()).unwrap()),
        crc32fast::hash(&data)
    );
    // READ it back from b into another place of a.
    a.qp.post_send(SendWr {
        wr_id: 2,
        op: SendOp::Read(b.mr.remote(1 << 20)),
        sge: a.mr.sge(8 << 20, data.len() as u32),
        signaled: true,
    })
    .unwrap();
    let wc = next(&a, &b);
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode, wc.byte_len),
        (2, WcStatus::Success, WcOpcode::RdmaRead, data.len() as u32)
    );
    assert_eq!(
        crc32fast::hash(&a.region.read_vec(8 << 20, data.len()).unwrap()),
        crc32fast::hash(&data)
    );
    // WRITE_WITH_IMM: data lands, then the receiver hears of it through a receive.
    b.qp.post_recv(RecvWr {
        wr_id: 50,
        sge: b.mr.sge(0, 0),
    })
    .unwrap();
    a.qp.post_send(SendWr {
        wr_id: 3,
        op: SendOp::WriteWithImm(b.mr.remote(0), 42),
        sge: a.mr.sge(0, 4096),
        signaled: false,
    })
    .unwrap();
    let wc = next(&b, &a);
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode, wc.imm, wc.byte_len),
        (
            50,
            WcStatus::Success,
            WcOpcode::RecvRdmaWithImm,
            Some(42),
            4096
        )
    );
    assert_eq!(b.region.read_vec(0, 4096).unwrap(), data[..4096]);
}

pub(crate) fn a_wrong_rkey_is_a_remote_access_error_and_memory_stays_untouched<
    F: Fabric + Default,
>() {
    let (a, b) = pair::<F>();
    b.region.fill(0, 4096, 0xaa).unwrap();
    b.qp.post_recv(RecvWr {
        wr_id: 5,
        sge: b.mr.sge(0, 64),
    })
    .unwrap();
    a.region.write(0, &[0x55; 4096]).unwrap();
    let bad = RemoteAddr {
        addr: b.mr.addr(),
        rkey: b.mr.rkey() ^ 0x100,
    };
    a.qp.post_send(SendWr {
        wr_id: 1,
        op: SendOp::Write(bad),
        sge: a.mr.sge(0, 4096),
        signaled: true,
    })
    .unwrap();
    let wc = next(&a, &b);
    assert_eq!((wc.wr_id, wc.status), (1, WcStatus::RemoteAccess));
    assert_eq!(
        b.region.read_vec(0, 4096).unwrap(),
        vec![0xaa; 4096],
        "not a byte written"
    );
    // Both queue pairs are in error: posting fails, the peer's receive was flushed.
    assert_eq!(a.qp.state(), QpState::Error);
    assert!(matches!(
        a.qp.post_send(SendWr {
            wr_id: 2,
            op: SendOp::Send,
            sge: a.mr.sge(0, 1),
            signaled: true
        }),
        Err(FabricError::QpError(_))
    ));
    let wc = next(&b, &a);
    assert_eq!((wc.wr_id, wc.status), (5, WcStatus::WrFlush));
    assert_eq!(b.qp.state(), QpState::Error);
}

pub(crate) fn out_of_bounds_and_unpermitted_accesses_are_refused<F: Fabric + Default>() {
    // Past the end of the registered range.
    let (a, b) = pair::<F>();
    let past = b.mr.remote(b.mr.len() - 10);
    a.qp.post_send(SendWr {
        wr_id: 1,
        op: SendOp::Write(past),
        sge: a.mr.sge(0, 11),
        signaled: true,
    })
    .unwrap();
    assert_eq!(next(&a, &b).status, WcStatus::RemoteAccess);

    // Below its start.
    let (a, b) = pair::<F>();
    let before = RemoteAddr {
        addr: b.mr.addr() - 1,
        rkey: b.mr.rkey(),
    };
    a.qp.post_send(SendWr {
        wr_id: 1,
        op: SendOp::Read(before),
        sge: a.mr.sge(0, 8),
        signaled: true,
    })
    .unwrap();
    assert_eq!(next(&a, &b).status, WcStatus::RemoteAccess);

    // A region registered without remote rights.
    let (a, b) = pair_with::<F>(Access::LOCAL_WRITE);
    a.qp.post_send(SendWr {
        wr_id: 1,
        op: SendOp::Write(b.mr.remote(0)),
        sge: a.mr.sge(0, 8),
        signaled: true,
    })
    .unwrap();
    assert_eq!(next(&a, &b).status, WcStatus::RemoteAccess);
    let (a, b) = pair_with::<F>(Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    a.qp.post_send(SendWr {
        wr_id: 1,
        op: SendOp::Read(b.mr.remote(0)),
        sge: a.mr.sge(0, 8),
        signaled: true,
    })
    .unwrap();
    assert_eq!(next(&a, &b).status, WcStatus::RemoteAccess);
}

pub(crate) fn a_deregistered_region_is_out_of_reach<F: Fabric + Default>() {
    let (a, b) = pair::<F>();
    let fabric = F::default();
    let extra = Arc::new(SharedRegion::create_unique("dpumesh-test-fabric", 4096).unwrap());
    let mr = fabric
        .register(&b.pd, &extra, 0, 4096, Access::all())
        .unwrap();
    let remote = mr.remote(0);
    drop(mr);
    a.qp.post_send(SendWr {
        wr_id: 1,
        op: SendOp::Write(remote),
        sge: a.mr.sge(0, 8),
        signaled: true,
    })
    .unwrap();
    assert_eq!(next(&a, &b).status, WcStatus::RemoteAccess);
}

pub(crate) fn a_send_too_large_for_the_receive_fails_on_both_sides<F: Fabric + Default>() {
    let (a, b) = pair::<F>();
    b.qp.post_recv(RecvWr {
        wr_id: 7,
        sge: b.mr.sge(0, 16),
    })
    .unwrap();
    a.qp.post_send(SendWr {
        wr_id: 1,
        op: SendOp::Send,
        sge: a.mr.sge(0, 17),
        signaled: true,
    })
    .unwrap();
    let wc = next(&b, &a);
    assert_eq!((wc.wr_id, wc.status), (7, WcStatus::LocalLength));
    assert_eq!(next(&a, &b).status, WcStatus::RemoteInvalidRequest);
}

pub(crate) fn a_bad_lkey_is_a_local_protection_error<F: Fabric + Default>() {
    let (a, b) = pair::<F>();
    let mut sge = a.mr.sge(0, 8);
    sge.lkey ^= 0x200;
    a.qp.post_send(SendWr {
        wr_id: 3,
        op: SendOp::Send,
        sge,
        signaled: false,
    })
    .unwrap();
    let wc = next(&a, &b);
    assert_eq!(
        (wc.wr_id, wc.status),
        (3, WcStatus::LocalProtection),
        "errors complete even unsignaled"
    );
    assert_eq!(a.qp.state(), QpState::Error);
}

pub(crate) fn completions_come_in_order_and_unsignaled_ones_stay_quiet<F: Fabric + Default>() {
    let (a, b) = pair::<F>();
    for i in 0..10u64 {
        a.qp.post_send(SendWr {
            wr_id: i,
            op: SendOp::Write(b.mr.remote(i * 8)),
            sge: a.mr.sge(i * 8, 8),
            signaled: i % 3 == 2,
        })
        .unwrap();
    }
    let ids: Vec<u64> = (0..3).map(|_| next(&a, &b).wr_id).collect();
    assert_eq!(ids, vec![2, 5, 8]);
    // The 10th (unsignaled) retired with nothing to show; the queue drains only by
    // signaling: 256 unsignaled requests fill it.
    let mut posted = 0;
    loop {
        match a.qp.post_send(SendWr {
            wr_id: 100,
            op: SendOp::Write(b.mr.remote(0)),
            sge: a.mr.sge(0, 8),
            signaled: false,
        }) {
            Ok(()) => posted += 1,
            Err(FabricError::QueueFull { limit, .. }) => {
                assert_eq!(limit, 256);
                break;
            }
            Err(e) => panic!("{e}"),
        }
        assert!(posted <= 256);
    }
}

pub(crate) fn a_peer_that_goes_away_fails_what_is_outstanding<F: Fabric + Default>() {
    let (a, b) = pair::<F>();
    b.qp.post_recv(RecvWr {
        wr_id: 1,
        sge: b.mr.sge(0, 64),
    })
    .unwrap();
    let remote = b.mr.remote(0);
    drop(b);
    a.qp.post_send(SendWr {
        wr_id: 9,
        op: SendOp::Read(remote),
        sge: a.mr.sge(0, 8),
        signaled: true,
    })
    .unwrap_or(());
    let mut out = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while out.is_empty() && Instant::now() < deadline {
        a.cq.wait(Duration::from_millis(50)).unwrap();
        a.cq.poll(&mut out, 1);
    }
    let wc = out[0];
    assert_eq!(wc.wr_id, 9);
    assert!(
        matches!(wc.status, WcStatus::RetryExceeded | WcStatus::WrFlush),
        "{wc:?}"
    );
    assert_eq!(a.qp.state(), QpState::Error);
}

pub(crate) fn one_poller_serves_many_queue_pairs<F: Fabric + Default>() {
    let fabric = F::default();
    let pd = fabric.alloc_pd().unwrap();
    let cq = fabric.create_cq(4096).unwrap();
    let region = Arc::new(SharedRegion::create_unique("dpumesh-test-fabric", 1 << 20).unwrap());
    let mr = fabric
        .register(&pd, &region, 0, 1 << 20, Access::all())
        .unwrap();
    let listener = fabric
        .listen(&pd, "127.0.0.1:0".parse().unwrap(), &cq, QpCaps::default())
        .unwrap();
    let addr = listener.local_addr();
    // Eight clients, each on its own thread with its own CQ, send 100 messages.
    let clients: Vec<_> = (0..8u8)
        .map(|c| {
            std::thread::spawn(move || {
                let fabric = F::default();
                let pd = fabric.alloc_pd().unwrap();
                let cq = fabric.create_cq(1024).unwrap();
                let region =
                    Arc::new(SharedRegion::create_unique("dpumesh-test-fabric", 4096).unwrap());
                let mr = fabric
                    .register(&pd, &region, 0, 4096, Access::all())
                    .unwrap();
                let qp = fabric.connect(&pd, addr, &cq, QpCaps::default()).unwrap();
                region.write(0, &[c; 64]).unwrap();
                for i in 0..100u64 {
                    qp.post_send(SendWr {
                        wr_id: i,
                        op: SendOp::Send,
                        sge: mr.sge(0, 64),
                        signaled: true,
                    })
                    .unwrap();
                    let mut out = Vec::new();
                    while out.is_empty() {
                        cq.wait(Duration::from_secs(10)).unwrap();
                        cq.poll(&mut out, 1);
                    }
                    assert_eq!(out[0].status, WcStatus::Success);
                }
            })
        })
        .collect();
    let mut qps = Vec::new();
    while qps.len() < 8 {
        let qp = listener.accept(Duration::from_secs(10)).unwrap().unwrap();
        for i in 0..100u64 {
            qp.post_recv(RecvWr {
                wr_id: (qps.len() as u64) << 32 | i,
                sge: mr.sge(qps.len() as u64 * 64, 64),
            })
            .unwrap();
        }
        qps.push(qp);
    }
    let mut got = 0;
    let mut out = Vec::new();
    while got < 800 {
        cq.wait(Duration::from_secs(10)).unwrap();
        out.clear();
        got += cq.poll(&mut out, 64);
        assert!(
            out.iter()
                .all(|wc| wc.status == WcStatus::Success && wc.opcode == WcOpcode::Recv)
        );
    }
    for c in clients {
        dpumesh_test_support::joined(c);
    }
}

pub(crate) fn an_interrupt_ends_a_wait_early_and_one_before_the_wait_is_not_lost<
    F: Fabric + Default,
>() {
    let fabric = F::default();
    let cq = fabric.create_cq(16).unwrap();
    let interrupter = cq.interrupter();
    // Before anyone waits: the next wait returns at once.
    interrupter.interrupt();
    let started = Instant::now();
    assert!(!cq.wait(Duration::from_secs(10)).unwrap());
    assert!(started.elapsed() < Duration::from_secs(5));
    // While a wait sleeps.
    let waiter = {
        let cq = cq.clone();
        std::thread::spawn(move || {
            let started = Instant::now();
            let got = cq.wait(Duration::from_secs(30)).unwrap();
            (got, started.elapsed())
        })
    };
    std::thread::sleep(Duration::from_millis(50));
    interrupter.interrupt();
    let (got, took) = dpumesh_test_support::joined(waiter);
    assert!(!got, "no completion came");
    assert!(
        took < Duration::from_secs(20),
        "woken, not timed out: {took:?}"
    );
    // Consumed: a later wait times out.
    assert!(!cq.wait(Duration::from_millis(20)).unwrap());
}

/// Waits up to `timeout` for `fd` to turn readable.
fn readable(fd: std::os::fd::BorrowedFd<'_>, timeout: Duration) -> bool {
    let mut fds = [rustix::event::PollFd::new(
        &fd,
        rustix::event::PollFlags::IN,
    )];
    let ts = rustix::fs::Timespec {
        tv_sec: timeout.as_secs() as i64,
        tv_nsec: timeout.subsec_nanos() as i64,
    };
    matches!(rustix::event::poll(&mut fds, Some(&ts)), Ok(n) if n > 0)
}

/// Posts `n` receives of 64 bytes on `side` (ids 0..n).
fn post_receives<F: Fabric>(side: &Side<F>, n: u64) {
    for i in 0..n {
        side.qp
            .post_recv(RecvWr {
                wr_id: i,
                sge: side.mr.sge(i * 64, 64),
            })
            .unwrap();
    }
}

/// Posts an unsignaled 8-byte SEND from `side`.
fn send_small<F: Fabric>(side: &Side<F>, wr_id: u64) {
    side.qp
        .post_send(SendWr {
            wr_id,
            op: SendOp::Send,
            sge: side.mr.sge(0, 8),
            signaled: false,
        })
        .unwrap();
}

/// Whether `fd` turns readable within 10 s when `send` runs 50 ms into the wait.
fn woken_by(fd: std::os::fd::BorrowedFd<'_>, send: impl FnOnce() + Send) -> bool {
    std::thread::scope(|scope| {
        scope.spawn(|| {
            std::thread::sleep(Duration::from_millis(50));
            send();
        });
        readable(fd, Duration::from_secs(10))
    })
}

/// `b`'s first completion within 10 s, polling `a` meanwhile (none: empty).
fn received<F: Fabric>(a: &Side<F>, b: &Side<F>) -> Vec<WorkCompletion> {
    let mut out = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while out.is_empty() && Instant::now() < deadline {
        a.cq.poll(&mut Vec::new(), 0);
        b.cq.poll(&mut out, 1);
    }
    out
}

pub(crate) fn an_owner_sleeping_on_its_wait_fd_is_woken_by_a_send<F: Fabric + Default>() {
    let (a, b) = pair::<F>();
    let Some(_) = b.cq.wait_fd() else {
        return;
    };
    post_receives(&b, 8);
    let send = |wr_id: u64| send_small(&a, wr_id);
    // Sleeps that were prepared and then not taken (work was there) leave nothing
    // behind that would keep a later sleeper from being woken.
    send(0);
    let _ = next(&b, &a);
    for _ in 0..3 {
        send(1);
        while b.cq.prepare_sleep() {
            b.cq.finish_sleep();
            a.cq.poll(&mut Vec::new(), 0);
        }
        b.cq.finish_sleep();
        let mut out = Vec::new();
        while out.is_empty() {
            b.cq.poll(&mut out, 1);
        }
    }
    // Now a real sleep: nothing there, the descriptor quiet, then a send wakes it.
    assert!(b.cq.prepare_sleep(), "nothing to do yet");
    let fd = b.cq.wait_fd().unwrap();
    assert!(!readable(fd, Duration::ZERO), "quiet before the send");
    assert!(woken_by(fd, || send(3)), "the send woke the sleeper");
    b.cq.finish_sleep();
    let out = received(&a, &b);
    assert_eq!((out[0].wr_id, out[0].status), (4, WcStatus::Success));
}

/// An owner woken by something else than its descriptor (the ingress's task, by a
/// request to post) withdraws its sleep with `end_sleep`: a wake-up that came meanwhile
/// is kept for the next sleep, consumed by the `finish_sleep` after it, and later
/// sends still wake a sleeper.
pub(crate) fn a_sleep_ended_early_keeps_its_wake_up_for_the_next<F: Fabric + Default>() {
    let (a, b) = pair::<F>();
    let Some(_) = b.cq.wait_fd() else {
        return;
    };
    post_receives(&b, 4);
    let send = |wr_id: u64| send_small(&a, wr_id);
    let fd = b.cq.wait_fd().unwrap();
    assert!(b.cq.prepare_sleep(), "nothing to do yet");
    send(0);
    b.cq.end_sleep();
    assert!(
        readable(fd, Duration::from_secs(10)),
        "the wake-up is kept for the next sleep"
    );
    assert_eq!(received(&a, &b).len(), 1);
    // The next sleep's finish consumes what is left of it (on the shared-memory
    // fabric the bell's eventfd; the TCP fabric's poll already read the socket).
    assert!(b.cq.prepare_sleep(), "nothing left to do");
    b.cq.finish_sleep();
    assert!(!readable(fd, Duration::ZERO), "consumed by finish_sleep");
    // A sleep after an ended one is still woken by a send.
    assert!(b.cq.prepare_sleep());
    assert!(woken_by(fd, || send(1)), "the send woke the sleeper");
    b.cq.finish_sleep();
    assert_eq!(received(&a, &b)[0].wr_id, 1);
}

/// Sends held by their completion queue's owner leave on flush, in order and intact,
/// small and large mixed (a fabric that gathers small frames into one write must not
/// reorder them around a large one).
pub(crate) fn held_sends_leave_on_flush_in_order_and_intact<F: Fabric + Default>() {
    let (a, b) = pair::<F>();
    const N: u64 = 120;
    // Sizes from empty to 40 KiB, so some payloads are inline and some not.
    let size = |i: u64| ((i * 337) % (40 << 10)) as usize * usize::from(!i.is_multiple_of(7));
    for i in 0..N {
        b.qp.post_recv(RecvWr {
            wr_id: i,
            sge: b.mr.sge(i * (64 << 10), 64 << 10),
        })
        .unwrap();
        a.region
            .write(i * (64 << 10), &pattern(size(i), i as u8))
            .unwrap();
    }
    a.cq.hold_sends(true);
    for i in 0..N {
        a.qp.post_send(SendWr {
            wr_id: i,
            op: SendOp::SendWithImm(i as u32),
            sge: a.mr.sge(i * (64 << 10), size(i) as u32),
            signaled: i % 10 == 9,
        })
        .unwrap();
    }
    a.cq.flush_sends();
    for i in 0..N {
        let wc = next(&b, &a);
        assert_eq!(
            (wc.wr_id, wc.status, wc.byte_len, wc.imm),
            (i, WcStatus::Success, size(i) as u32, Some(i as u32)),
            "receive {i}"
        );
        assert_eq!(
            b.region.read_vec(i * (64 << 10), size(i)).unwrap(),
            pattern(size(i), i as u8),
            "payload {i}"
        );
    }
    for i in (9..N).step_by(10) {
        let wc = next(&a, &b);
        assert_eq!((wc.wr_id, wc.status), (i, WcStatus::Success));
    }
    a.cq.hold_sends(false);
}

/// Runs every conformance test against `$fabric`, in a module named `$name`.
macro_rules! fabric_conformance {
    ($name:ident, $fabric:ty) => {
        mod $name {
            use crate::conformance as c;
            #[test]
            fn send_with_imm_lands_in_the_posted_receive() {
                c::send_with_imm_lands_in_the_posted_receive::<$fabric>()
            }
            #[test]
            fn a_send_before_any_receive_waits_for_one() {
                c::a_send_before_any_receive_waits_for_one::<$fabric>()
            }
            #[test]
            fn write_read_and_write_with_imm_move_8_mib_intact() {
                c::write_read_and_write_with_imm_move_8_mib_intact::<$fabric>()
            }
            #[test]
            fn a_wrong_rkey_is_a_remote_access_error_and_memory_stays_untouched() {
                c::a_wrong_rkey_is_a_remote_access_error_and_memory_stays_untouched::<$fabric>()
            }
            #[test]
            fn out_of_bounds_and_unpermitted_accesses_are_refused() {
                c::out_of_bounds_and_unpermitted_accesses_are_refused::<$fabric>()
            }
            #[test]
            fn a_deregistered_region_is_out_of_reach() {
                c::a_deregistered_region_is_out_of_reach::<$fabric>()
            }
            #[test]
            fn a_send_too_large_for_the_receive_fails_on_both_sides() {
                c::a_send_too_large_for_the_receive_fails_on_both_sides::<$fabric>()
            }
            #[test]
            fn a_bad_lkey_is_a_local_protection_error() {
                c::a_bad_lkey_is_a_local_protection_error::<$fabric>()
            }
            #[test]
            fn completions_come_in_order_and_unsignaled_ones_stay_quiet() {
                c::completions_come_in_order_and_unsignaled_ones_stay_quiet::<$fabric>()
            }
            #[test]
            fn a_peer_that_goes_away_fails_what_is_outstanding() {
                c::a_peer_that_goes_away_fails_what_is_outstanding::<$fabric>()
            }
            #[test]
            fn one_poller_serves_many_queue_pairs() {
                c::one_poller_serves_many_queue_pairs::<$fabric>()
            }
            #[test]
            fn an_owner_sleeping_on_its_wait_fd_is_woken_by_a_send() {
                c::an_owner_sleeping_on_its_wait_fd_is_woken_by_a_send::<$fabric>()
            }
            #[test]
            fn a_sleep_ended_early_keeps_its_wake_up_for_the_next() {
                c::a_sleep_ended_early_keeps_its_wake_up_for_the_next::<$fabric>()
            }
            #[test]
            fn held_sends_leave_on_flush_in_order_and_intact() {
                c::held_sends_leave_on_flush_in_order_and_intact::<$fabric>()
            }
            #[test]
            fn an_interrupt_ends_a_wait_early_and_one_before_the_wait_is_not_lost() {
                c::an_interrupt_ends_a_wait_early_and_one_before_the_wait_is_not_lost::<$fabric>()
            }
        }
    };
}

fabric_conformance!(soft, crate::soft::SoftFabric);
fabric_conformance!(shm, crate::shm::ShmFabric);

/// A fabric whose connections run over mutual TLS with a node certificate of a
/// test CA (made once per test process): the same semantics must hold through it.
#[derive(Clone)]
pub(crate) struct WithTls<F>(F);

/// Fabrics that take certificates.
pub(crate) trait TakesTls: Sized {
    fn with_tls(self, tls: Arc<dpumesh_identity::MeshTls>) -> Self;
}

impl TakesTls for crate::soft::SoftFabric {
    fn with_tls(self, tls: Arc<dpumesh_identity::MeshTls>) -> Self {
        crate::soft::SoftFabric::with_tls(self, Some(tls))
    }
}

impl TakesTls for crate::shm::ShmFabric {
    fn with_tls(self, tls: Arc<dpumesh_identity::MeshTls>) -> Self {
        crate::shm::ShmFabric::with_tls(self, Some(tls))
    }
}

pub(crate) use crate::test_tls::test_tls;

impl<F: Fabric + Default + TakesTls> Default for WithTls<F> {
    fn default() -> Self {
        Self(F::default().with_tls(test_tls()))
    }
}

impl<F: Fabric> Fabric for WithTls<F> {
    type Pd = F::Pd;
    type Mr = F::Mr;
    type Cq = F::Cq;
    type Qp = F::Qp;
    type Listener = F::Listener;

    fn name(&self) -> &'static str {
        self.0.name()
    }
    fn alloc_pd(&self) -> Result<F::Pd, FabricError> {
        self.0.alloc_pd()
    }
    fn register(
        &self,
        pd: &F::Pd,
        region: &Arc<SharedRegion>,
        offset: u64,
        len: u64,
        access: Access,
    ) -> Result<F::Mr, FabricError> {
        self.0.register(pd, region, offset, len, access)
    }
    fn create_cq(&self, depth: u32) -> Result<F::Cq, FabricError> {
        self.0.create_cq(depth)
    }
    fn listen(
        &self,
        pd: &F::Pd,
        addr: std::net::SocketAddr,
        cq: &F::Cq,
        caps: QpCaps,
    ) -> Result<F::Listener, FabricError> {
        self.0.listen(pd, addr, cq, caps)
    }
    fn connect(
        &self,
        pd: &F::Pd,
        addr: std::net::SocketAddr,
        cq: &F::Cq,
        caps: QpCaps,
    ) -> Result<F::Qp, FabricError> {
        let qp = self.0.connect(pd, addr, cq, caps)?;
        let id = qp.peer_identity().expect("a TLS connection knows its peer");
        assert_eq!(id.to_string(), "spiffe://test.mesh/dpumesh/node/n1");
        Ok(qp)
    }
}

fabric_conformance!(soft_tls, super::WithTls<crate::soft::SoftFabric>);
fabric_conformance!(shm_tls, super::WithTls<crate::shm::ShmFabric>);

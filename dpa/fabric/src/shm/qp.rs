//! Queue pairs of the shared-memory fabric: one shared segment per queue pair holding,
//! for each side, the receives it posted (the other side consumes them) and the
//! completions the other side produced for it.
//!
//! ```text
//! segment: line 0: magic|version, capacity, state (0 ready, 1 error)
//!          side 0 (connector), side 1 (acceptor), each:
//!            receives:    head line | tail line | entries [wr_id, addr, key<<32|len]
//!            completions: head line | tail line | entries [wr_id, len<<32|imm, opcode|status|imm?]
//!            flags line:  rnr (the side holds sends until a receive is posted)
//! ```
//!
//! Work requests execute when posted, in order: a WRITE or READ is a copy between the
//! two processes' mappings, a SEND a copy into the peer's next posted receive followed
//! by a completion in the peer's ring and a ring of its bell. Every remote access is
//! checked against the peer's region table first. A SEND (or WRITE_WITH_IMM) finding
//! no posted receive is held, with everything posted after it, until the peer posts
//! one (receiver-not-ready). A failure moves the queue pair to the error state on both
//! sides; what was posted and not done then completes as flushed.

use std::collections::VecDeque;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering, fence};

use parking_lot::Mutex;

use super::cq::CqInner;
use super::mr::{MrTable, PeerRegions};
use crate::{
    Access, FabricError, QpCaps, QpState, RecvWr, SendOp, SendWr, WcOpcode, WcStatus,
    WorkCompletion,
};
use dpumesh_rings::bell::Bell;
use dpumesh_rings::shm::SharedRegion;

const MAGIC: u64 = u32::from_le_bytes(*b"DPQP") as u64 | 1 << 32;
const LINE: u64 = 64;
const WORDS: usize = 3;

/// Entries of each ring for queue pairs with `caps` (a power of two).
pub(super) fn capacity(caps: QpCaps) -> u64 {
    u64::from(caps.max_recv_wr.max(2)).next_power_of_two()
}

fn ring_len(cap: u64) -> u64 {
    (2 * LINE + cap * WORDS as u64 * 8).next_multiple_of(LINE)
}

fn side_len(cap: u64) -> u64 {
    2 * ring_len(cap) + LINE
}

/// Bytes of a segment with rings of `cap` entries.
pub(super) fn segment_len(cap: u64) -> usize {
    (LINE + 2 * side_len(cap)) as usize
}

/// Writes a fresh segment's header.
pub(super) fn init_segment(seg: &SharedRegion, cap: u64) -> Result<(), FabricError> {
    let header = seg
        .atomic_u64s(0, 3)
        .map_err(|e| FabricError::Register(e.to_string()))?;
    header[1].store(cap, Ordering::Relaxed);
    header[2].store(0, Ordering::Relaxed);
    header[0].store(MAGIC, Ordering::Release);
    Ok(())
}

/// The capacity a peer's segment was made with, after checking it is one.
pub(super) fn check_segment(seg: &SharedRegion) -> Result<u64, String> {
    let header = seg.atomic_u64s(0, 3).map_err(|e| e.to_string())?;
    if header[0].load(Ordering::Acquire) != MAGIC {
        return Err(format!("{} holds no queue pair segment", seg.name()));
    }
    let cap = header[1].load(Ordering::Relaxed);
    if !cap.is_power_of_two() || seg.len() < segment_len(cap) {
        return Err(format!("{} has a bad capacity {cap}", seg.name()));
    }
    Ok(cap)
}

/// A single-producer/single-consumer ring of three-word entries in a segment.
#[derive(Debug)]
struct Ring {
    seg: Arc<SharedRegion>,
    base: u64,
    cap: u64,
}

impl Ring {
    fn word(&self, offset: u64) -> &AtomicU64 {
        &self
            .seg
            .atomic_u64s(self.base + offset, 1)
            .expect("inside the checked segment")[0]
    }

    fn head(&self) -> &AtomicU64 {
        self.word(0)
    }

    fn tail(&self) -> &AtomicU64 {
        self.word(LINE)
    }

    fn entry(&self, position: u64) -> &[AtomicU64] {
        let at = self.base + 2 * LINE + (position & (self.cap - 1)) * WORDS as u64 * 8;
        self.seg
            .atomic_u64s(at, WORDS)
            .expect("inside the checked segment")
    }

    /// Appends an entry; false when full.
    fn push(&self, words: [u64; WORDS]) -> bool {
        let tail = self.tail().load(Ordering::Relaxed);
        let head = self.head().load(Ordering::Acquire);
        // A consumer position past the tail (a scribbled ring) counts as full.
        if tail.wrapping_sub(head) >= self.cap {
            return false;
        }
        for (slot, w) in self.entry(tail).iter().zip(words) {
            slot.store(w, Ordering::Relaxed);
        }
        self.tail().store(tail + 1, Ordering::Release);
        true
    }

    fn pop(&self) -> Option<[u64; WORDS]> {
        let head = self.head().load(Ordering::Relaxed);
        let tail = self.tail().load(Ordering::Acquire);
        if head == tail || tail.wrapping_sub(head) > self.cap {
            return None;
        }
        let e = self.entry(head);
        let words = [
            e[0].load(Ordering::Relaxed),
            e[1].load(Ordering::Relaxed),
            e[2].load(Ordering::Relaxed),
        ];
        self.head().store(head + 1, Ordering::Release);
        Some(words)
    }

    fn is_empty(&self) -> bool {
        self.head().load(Ordering::Relaxed) == self.tail().load(Ordering::Acquire)
    }
}

fn opcode_code(op: WcOpcode) -> u64 {
    match op {
        WcOpcode::Send => 0,
        WcOpcode::RdmaWrite => 1,
        WcOpcode::RdmaRead => 2,
        WcOpcode::Recv => 3,
        WcOpcode::RecvRdmaWithImm => 4,
    }
}

fn opcode_of(code: u64) -> WcOpcode {
    match code {
        0 => WcOpcode::Send,
        1 => WcOpcode::RdmaWrite,
        2 => WcOpcode::RdmaRead,
        4 => WcOpcode::RecvRdmaWithImm,
        _ => WcOpcode::Recv,
    }
}

fn status_code(s: WcStatus) -> u64 {
    match s {
        WcStatus::Success => 0,
        WcStatus::LocalLength => 1,
        WcStatus::LocalProtection => 2,
        WcStatus::RemoteAccess => 3,
        WcStatus::RemoteInvalidRequest => 4,
        WcStatus::RemoteOperation => 5,
        WcStatus::WrFlush => 6,
        WcStatus::RetryExceeded => 7,
        WcStatus::RnrRetryExceeded => 8,
        WcStatus::General => 9,
    }
}

fn status_of(code: u64) -> WcStatus {
    match code {
        0 => WcStatus::Success,
        1 => WcStatus::LocalLength,
        2 => WcStatus::LocalProtection,
        3 => WcStatus::RemoteAccess,
        4 => WcStatus::RemoteInvalidRequest,
        5 => WcStatus::RemoteOperation,
        6 => WcStatus::WrFlush,
        7 => WcStatus::RetryExceeded,
        8 => WcStatus::RnrRetryExceeded,
        _ => WcStatus::General,
    }
}

fn op_opcode(op: SendOp) -> WcOpcode {
    match op {
        SendOp::Send | SendOp::SendWithImm(_) => WcOpcode::Send,
        SendOp::Write(_) | SendOp::WriteWithImm(..) => WcOpcode::RdmaWrite,
        SendOp::Read(_) => WcOpcode::RdmaRead,
    }
}

/// What the peer gave at connection time.
pub(super) struct PeerParts {
    pub(super) bell: Bell,
    pub(super) regions: PeerRegions,
}

#[derive(Debug, Default)]
struct Posted {
    /// Send queue entries not retired by a completion yet.
    unretired: u32,
    /// Sends held for a receive (and everything posted after them), in order.
    held: VecDeque<SendWr>,
    /// Our posted receives' ids, in the order the peer consumes them.
    receives: VecDeque<u64>,
    /// Flushed after the error state was reached.
    flushed: bool,
}

/// The four rings of a queue pair's segment, as one side sees them: the receives it
/// posted and those its peer posted, the completions it reaps and those it writes for
/// its peer.
struct Rings {
    my_receives: Ring,
    peer_receives: Ring,
    my_completions: Ring,
    peer_completions: Ring,
}

/// One side of a queue pair.
pub(super) struct QpInner {
    pub(super) num: u32,
    seg: Arc<SharedRegion>,
    rings: Rings,
    my_side: usize,
    peer_bell: Bell,
    peer_regions: PeerRegions,
    pd: Arc<MrTable>,
    pub(super) cq: Arc<CqInner>,
    pub(super) sock: UnixStream,
    caps: QpCaps,
    posted: Mutex<Posted>,
    held: AtomicUsize,
    gone: AtomicBool,
}

impl std::fmt::Debug for QpInner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmQp")
            .field("num", &self.num)
            .field("segment", &self.seg.name())
            .finish_non_exhaustive()
    }
}

impl QpInner {
    /// Side `side` (0: connector, 1: acceptor) of the queue pair in `seg`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        num: u32,
        seg: Arc<SharedRegion>,
        cap: u64,
        side: usize,
        peer: PeerParts,
        pd: Arc<MrTable>,
        cq: Arc<CqInner>,
        sock: UnixStream,
        caps: QpCaps,
    ) -> Self {
        let ring = |s: usize, which: u64| Ring {
            seg: seg.clone(),
            base: LINE + s as u64 * side_len(cap) + which * ring_len(cap),
            cap,
        };
        let other = 1 - side;
        Self {
            num,
            rings: Rings {
                my_receives: ring(side, 0),
                peer_receives: ring(other, 0),
                my_completions: ring(side, 1),
                peer_completions: ring(other, 1),
            },
            my_side: side,
            seg,
            peer_bell: peer.bell,
            peer_regions: peer.regions,
            pd,
            cq,
            sock,
            caps,
            posted: Mutex::new(Posted::default()),
            held: AtomicUsize::new(0),
            gone: AtomicBool::new(false),
        }
    }

    fn state_word(&self) -> &AtomicU64 {
        &self.seg.atomic_u64s(2 * 8, 1).expect("header checked")[0]
    }

    fn rnr_word(&self, side: usize) -> &AtomicU64 {
        let cap = self.rings.my_receives.cap;
        let at = LINE + side as u64 * side_len(cap) + 2 * ring_len(cap);
        &self
            .seg
            .atomic_u64s(at, 1)
            .expect("inside the checked segment")[0]
    }

    pub(super) fn state(&self) -> QpState {
        if self.state_word().load(Ordering::Acquire) != 0 {
            QpState::Error
        } else {
            QpState::ReadyToSend
        }
    }

    fn completion(&self, wr_id: u64, status: WcStatus, opcode: WcOpcode) -> WorkCompletion {
        WorkCompletion {
            wr_id,
            status,
            opcode,
            byte_len: 0,
            imm: None,
            qp_num: self.num,
        }
    }

    /// Moves both sides to the error state; the peer is told through its bell.
    fn fail(&self) {
        self.state_word().store(1, Ordering::Release);
        self.peer_bell.interrupt();
        self.cq.bell.interrupt();
    }

    /// The peer process went away (its socket closed).
    pub(super) fn peer_gone(&self) {
        if !self.gone.swap(true, Ordering::AcqRel) {
            tracing::debug!(qp = self.num, "shm fabric: peer went away");
            self.state_word().store(1, Ordering::Release);
            self.cq.bell.interrupt();
        }
    }

    /// Posting to a queue pair in the error state: refused once the error was
    /// surfaced (flushed), otherwise taken and completed as flushed — as when verbs
    /// learns of the error only after the post.
    fn post_in_error(
        &self,
        posted: &Posted,
        wr_id: u64,
        opcode: WcOpcode,
    ) -> Result<(), FabricError> {
        if posted.flushed {
            return Err(FabricError::QpError(self.num));
        }
        self.cq
            .push(self.completion(wr_id, WcStatus::WrFlush, opcode));
        Ok(())
    }

    pub(super) fn post_recv(&self, wr: RecvWr) -> Result<(), FabricError> {
        let mut posted = self.posted.lock();
        if self.state() == QpState::Error {
            return self.post_in_error(&posted, wr.wr_id, WcOpcode::Recv);
        }
        if posted.receives.len() >= self.caps.max_recv_wr as usize {
            return Err(FabricError::QueueFull {
                qp: self.num,
                which: "receive",
                limit: self.caps.max_recv_wr,
            });
        }
        let entry = [
            wr.wr_id,
            wr.sge.addr,
            u64::from(wr.sge.lkey) << 32 | u64::from(wr.sge.len),
        ];
        if !self.rings.my_receives.push(entry) {
            return Err(FabricError::QueueFull {
                qp: self.num,
                which: "receive",
                limit: self.rings.my_receives.cap as u32,
            });
        }
        posted.receives.push_back(wr.wr_id);
        drop(posted);
        // A peer holding sends for want of a receive is told it has one now.
        fence(Ordering::SeqCst);
        if self.rnr_word(1 - self.my_side).load(Ordering::Relaxed) != 0 {
            self.peer_bell.interrupt();
        }
        Ok(())
    }

    pub(super) fn post_send(&self, wr: SendWr) -> Result<(), FabricError> {
        let mut posted = self.posted.lock();
        if self.state() == QpState::Error {
            return self.post_in_error(&posted, wr.wr_id, op_opcode(wr.op));
        }
        // As in verbs, a send queue entry is retired only by a completion: requests
        // that never signal fill the queue.
        if posted.unretired >= self.caps.max_send_wr {
            return Err(FabricError::QueueFull {
                qp: self.num,
                which: "send",
                limit: self.caps.max_send_wr,
            });
        }
        posted.unretired += 1;
        if wr.signaled {
            // It completes (now or when released from hold), retiring all before it.
            posted.unretired = posted.held.len() as u32;
        }
        if !posted.held.is_empty() {
            posted.held.push_back(wr);
            self.held.store(posted.held.len(), Ordering::Release);
            return Ok(());
        }
        if !self.execute(&wr) {
            posted.held.push_back(wr);
            self.held.store(posted.held.len(), Ordering::Release);
            self.rnr_word(self.my_side).store(1, Ordering::Relaxed);
            // Store (flag) then load (the peer's receive tail) against the peer's
            // store (tail) then load (flag): each side needs a full fence between the
            // two (`post_recv` has its own), or on a weakly ordered CPU (Arm, whose
            // load-acquire may pass an earlier store) both may miss each other and
            // the held send waits for an unrelated wake-up.
            std::sync::atomic::fence(Ordering::SeqCst);
            // A receive posted between our look and raising the flag was missed:
            // look again.
            if !self.rings.peer_receives.is_empty() {
                self.cq.bell.interrupt();
            }
        }
        Ok(())
    }

    /// Carries out `wr`; false if it needs a receive the peer has not posted (nothing
    /// was done then).
    fn execute(&self, wr: &SendWr) -> bool {
        let opcode = op_opcode(wr.op);
        let fail_with = |status: WcStatus| {
            self.cq.push(self.completion(wr.wr_id, status, opcode));
            self.fail();
        };
        // The local buffer, in our own table.
        let local = match self.pd.local(wr.sge.lkey) {
            Some(mr) => mr,
            None => {
                fail_with(WcStatus::LocalProtection);
                return true;
            }
        };
        let local_at = match local.locate(wr.sge.addr, u64::from(wr.sge.len)) {
            Some(at)
                if !matches!(wr.op, SendOp::Read(_))
                    || local.access.contains(Access::LOCAL_WRITE) =>
            {
                at
            }
            _ => {
                fail_with(WcStatus::LocalProtection);
                return true;
            }
        };
        let len = u64::from(wr.sge.len);
        // Two-sided operations need a posted receive; without one, hold.
        let needs_receive = matches!(
            wr.op,
            SendOp::Send | SendOp::SendWithImm(_) | SendOp::WriteWithImm(..)
        );
        let receive = if needs_receive {
            match self.rings.peer_receives.pop() {
                Some(r) => Some(r),
                None => return false,
            }
        } else {
            None
        };
        let imm = match wr.op {
            SendOp::SendWithImm(imm) | SendOp::WriteWithImm(_, imm) => Some(imm),
            _ => None,
        };
        match wr.op {
            SendOp::Write(remote) | SendOp::WriteWithImm(remote, _) => {
                match self
                    .peer_regions
                    .resolve(remote.rkey, remote.addr, len, Access::REMOTE_WRITE)
                {
                    Ok((dst, at))
                        if len == 0 || dst.copy_from(at, &local.region, local_at, len).is_ok() => {}
                    _ => {
                        // A receive taken for the immediate is flushed at the peer
                        // with the rest when it sees the error state.
                        fail_with(WcStatus::RemoteAccess);
                        return true;
                    }
                }
            }
            SendOp::Read(remote) => {
                match self
                    .peer_regions
                    .resolve(remote.rkey, remote.addr, len, Access::REMOTE_READ)
                {
                    Ok((src, at))
                        if len == 0 || local.region.copy_from(local_at, &src, at, len).is_ok() => {}
                    _ => {
                        fail_with(WcStatus::RemoteAccess);
                        return true;
                    }
                }
            }
            SendOp::Send | SendOp::SendWithImm(_) => {
                let r = receive.expect("taken above");
                let (wr_id, addr, key_len) = (r[0], r[1], r[2]);
                let (key, room) = ((key_len >> 32) as u32, key_len & 0xffff_ffff);
                if len > room {
                    // verbs: the receiver sees a length error, the sender an invalid
                    // request, and the queue pair fails.
                    self.complete_peer(wr_id, WcStatus::LocalLength, WcOpcode::Recv, 0, None);
                    fail_with(WcStatus::RemoteInvalidRequest);
                    return true;
                }
                if len > 0 {
                    match self
                        .peer_regions
                        .resolve(key, addr, len, Access::LOCAL_WRITE)
                    {
                        Ok((dst, at))
                            if dst.copy_from(at, &local.region, local_at, len).is_ok() => {}
                        _ => {
                            self.complete_peer(
                                wr_id,
                                WcStatus::LocalProtection,
                                WcOpcode::Recv,
                                0,
                                None,
                            );
                            fail_with(WcStatus::RemoteOperation);
                            return true;
                        }
                    }
                }
            }
        }
        if let Some(r) = receive {
            let opcode = match wr.op {
                SendOp::WriteWithImm(..) => WcOpcode::RecvRdmaWithImm,
                _ => WcOpcode::Recv,
            };
            self.complete_peer(r[0], WcStatus::Success, opcode, len as u32, imm);
        }
        if wr.signaled {
            let mut wc = self.completion(wr.wr_id, WcStatus::Success, opcode);
            if matches!(wr.op, SendOp::Read(_)) {
                wc.byte_len = wr.sge.len;
            }
            self.cq.push(wc);
        }
        true
    }

    /// A completion for the peer's receive `wr_id`, then its bell.
    fn complete_peer(
        &self,
        wr_id: u64,
        status: WcStatus,
        opcode: WcOpcode,
        byte_len: u32,
        imm: Option<u32>,
    ) {
        let entry = [
            wr_id,
            u64::from(byte_len) << 32 | u64::from(imm.unwrap_or(0)),
            opcode_code(opcode) | status_code(status) << 8 | u64::from(imm.is_some()) << 16,
        ];
        if !self.rings.peer_completions.push(entry) {
            // Cannot happen with a well-behaved peer: it has at most `cap` receives
            // posted. A scribbled ring fails the queue pair.
            self.fail();
            return;
        }
        self.peer_bell.ring();
    }

    /// Whether [`QpInner::progress`] has something to do.
    pub(super) fn has_work(&self) -> bool {
        !self.rings.my_completions.is_empty()
            || (self.state() == QpState::Error && !self.posted.lock().flushed)
            || (self.held.load(Ordering::Acquire) > 0 && !self.rings.peer_receives.is_empty())
    }

    /// Moves what the peer completed for us into the completion queue, retries held
    /// sends, and flushes everything once the queue pair is in the error state.
    pub(super) fn progress(&self) {
        let mut posted = self.posted.lock();
        let drain = |posted: &mut Posted| {
            while let Some(e) = self.rings.my_completions.pop() {
                let (wr_id, len_imm, flags) = (e[0], e[1], e[2]);
                if posted.receives.front() == Some(&wr_id) {
                    posted.receives.pop_front();
                } else if let Some(i) = posted.receives.iter().position(|r| *r == wr_id) {
                    posted.receives.remove(i);
                }
                self.cq.push(WorkCompletion {
                    wr_id,
                    status: status_of((flags >> 8) & 0xff),
                    opcode: opcode_of(flags & 0xff),
                    byte_len: (len_imm >> 32) as u32,
                    imm: ((flags >> 16) & 1 == 1).then_some(len_imm as u32),
                    qp_num: self.num,
                });
            }
        };
        drain(&mut posted);
        if self.state() == QpState::Error {
            if !posted.flushed {
                posted.flushed = true;
                // What the peer published before the error still counts.
                drain(&mut posted);
                let gone = self.gone.load(Ordering::Acquire);
                for wr in posted.held.drain(..) {
                    let status = if gone {
                        WcStatus::RetryExceeded
                    } else {
                        WcStatus::WrFlush
                    };
                    self.cq
                        .push(self.completion(wr.wr_id, status, op_opcode(wr.op)));
                }
                for wr_id in posted.receives.drain(..) {
                    self.cq
                        .push(self.completion(wr_id, WcStatus::WrFlush, WcOpcode::Recv));
                }
                self.held.store(0, Ordering::Release);
            }
            return;
        }
        while let Some(wr) = posted.held.front().copied() {
            if !self.execute(&wr) {
                break;
            }
            posted.held.pop_front();
        }
        self.held.store(posted.held.len(), Ordering::Release);
        if posted.held.is_empty() {
            self.rnr_word(self.my_side).store(0, Ordering::Relaxed);
        }
    }
}

impl Drop for QpInner {
    fn drop(&mut self) {
        // The peer learns it at once (its socket closes); the state word makes any
        // later access by it fail.
        self.state_word().store(1, Ordering::Release);
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
        self.peer_bell.interrupt();
    }
}

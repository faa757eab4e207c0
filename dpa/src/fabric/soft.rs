//! The software fabric: verbs semantics over TCP, one connection per queue pair.
//!
//! Frames carry what a NIC would put on the wire: SEND, WRITE (both optionally with
//! immediate data), READ requests and responses, ACK and NAK, each with a sequence
//! number. The responder checks every remote access (rkey, bounds, rights) before a
//! byte lands, streams payloads straight into the registered region, and NAKs what
//! it refuses; the requester turns ACKs, read responses and NAKs into completions in
//! order.
//!
//! Progress is driven by whoever polls or waits on a completion queue: the queue's
//! epoll set holds the sockets of its queue pairs, and a poll reads what arrived,
//! answers reads, and flushes what is queued to send (libfabric calls this manual
//! progress). A queue pair whose queues nobody polls does not progress, which is why
//! every user of the fabric keeps a poller on its completion queues. Posting writes
//! to the socket at once when it can, so a request costs one system call, as on a
//! NIC doorbell.

use std::collections::{HashMap, VecDeque};
use std::io::{IoSlice, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use rustix::event::epoll;

use super::{
    Access, CompletionQueue, Fabric, FabricError, MemoryRegion, QpCaps, QpListener, QpState,
    QueuePair, RecvWr, RemoteAddr, SendOp, SendWr, WcOpcode, WcStatus, WorkCompletion,
};
use crate::shm::SharedRegion;

const FRAME_HEADER: usize = 32;
const HELLO_MAGIC: u32 = u32::from_le_bytes(*b"DPRF");
const HELLO_VERSION: u32 = 1;
/// Payloads up to this size are copied at post time and written with their header
/// in one system call; larger ones are streamed from the region as the socket takes
/// them.
const INLINE: u64 = 16 << 10;
/// Bytes of SENDs held for a receiver that posted no receive before it counts as
/// "receiver not ready" for too long.
const MAX_HELD_BYTES: usize = 64 << 20;
/// Payload still to come above which it is read from the socket straight into its
/// registered region.
const DIRECT_READ: u64 = 64 << 10;
/// Token of a completion queue's wake-up eventfd in its epoll set.
const WAKE_TOKEN: u64 = u64::MAX;

const K_SEND: u8 = 1;
const K_WRITE: u8 = 2;
const K_READ_REQ: u8 = 3;
const K_READ_RESP: u8 = 4;
const K_ACK: u8 = 5;
const K_NAK: u8 = 6;
const F_ACK_REQ: u8 = 1;
const F_IMM: u8 = 2;

fn status_code(s: WcStatus) -> u32 {
    match s {
        WcStatus::Success => 0,
        WcStatus::LocalLength => 1,
        WcStatus::LocalProtection => 2,
        WcStatus::RemoteAccess => 3,
        WcStatus::RemoteInvalidRequest => 4,
        WcStatus::WrFlush => 5,
        WcStatus::RetryExceeded => 6,
        WcStatus::RnrRetryExceeded => 7,
        WcStatus::General => 8,
        WcStatus::RemoteOperation => 9,
    }
}

fn status_of(code: u32) -> WcStatus {
    match code {
        0 => WcStatus::Success,
        1 => WcStatus::LocalLength,
        2 => WcStatus::LocalProtection,
        3 => WcStatus::RemoteAccess,
        4 => WcStatus::RemoteInvalidRequest,
        5 => WcStatus::WrFlush,
        6 => WcStatus::RetryExceeded,
        7 => WcStatus::RnrRetryExceeded,
        9 => WcStatus::RemoteOperation,
        _ => WcStatus::General,
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct Header {
    kind: u8,
    flags: u8,
    len: u32,
    psn: u64,
    addr: u64,
    rkey: u32,
    imm: u32,
}

impl Header {
    fn encode(&self) -> [u8; FRAME_HEADER] {
        let mut b = [0u8; FRAME_HEADER];
        b[0] = self.kind;
        b[1] = self.flags;
        b[4..8].copy_from_slice(&self.len.to_le_bytes());
        b[8..16].copy_from_slice(&self.psn.to_le_bytes());
        b[16..24].copy_from_slice(&self.addr.to_le_bytes());
        b[24..28].copy_from_slice(&self.rkey.to_le_bytes());
        b[28..32].copy_from_slice(&self.imm.to_le_bytes());
        b
    }

    fn decode(b: &[u8]) -> Self {
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(w)
        };
        Self {
            kind: b[0],
            flags: b[1],
            len: u32_at(4),
            psn: u64_at(8),
            addr: u64_at(16),
            rkey: u32_at(24),
            imm: u32_at(28),
        }
    }
}

// === memory registration ===

#[derive(Debug)]
struct MrEntry {
    region: Arc<SharedRegion>,
    /// Offset of the registered range in the region.
    offset: u64,
    len: u64,
    /// Virtual address of the range's first byte.
    addr: u64,
    access: Access,
}

impl MrEntry {
    /// The region offset of `[addr, addr + len)`, if it lies inside the range.
    fn locate(&self, addr: u64, len: u64) -> Option<u64> {
        let start = addr.checked_sub(self.addr)?;
        (start.checked_add(len)? <= self.len).then_some(self.offset + start)
    }
}

#[derive(Debug, Default)]
struct PdInner {
    by_lkey: RwLock<HashMap<u32, Arc<MrEntry>>>,
    by_rkey: RwLock<HashMap<u32, Arc<MrEntry>>>,
}

/// A protection domain of the software fabric.
#[derive(Debug, Clone, Default)]
pub struct SoftPd {
    inner: Arc<PdInner>,
}

/// A registered region of the software fabric; deregistered when dropped.
#[derive(Debug)]
pub struct SoftMr {
    pd: Arc<PdInner>,
    entry: Arc<MrEntry>,
    lkey: u32,
    rkey: u32,
}

impl MemoryRegion for SoftMr {
    fn lkey(&self) -> u32 {
        self.lkey
    }
    fn rkey(&self) -> u32 {
        self.rkey
    }
    fn addr(&self) -> u64 {
        self.entry.addr
    }
    fn len(&self) -> u64 {
        self.entry.len
    }
}

impl Drop for SoftMr {
    fn drop(&mut self) {
        self.pd.by_lkey.write().remove(&self.lkey);
        self.pd.by_rkey.write().remove(&self.rkey);
    }
}

// === completion queues ===

#[derive(Debug)]
struct CqInner {
    entries: Mutex<VecDeque<WorkCompletion>>,
    /// How long `wait` polls before it sleeps.
    spin: Duration,
    depth: usize,
    epoll: OwnedFd,
    wake: OwnedFd,
    sleepers: AtomicUsize,
    /// Set by interrupters: the current or next `wait` returns.
    interrupted: AtomicBool,
    qps: RwLock<HashMap<u32, Weak<QpInner>>>,
    overflowed: AtomicBool,
    /// Set by the owner ([`CompletionQueue::hold_sends`]): frames its queue pairs
    /// post wait in their queues until [`CompletionQueue::flush_sends`], so a batch
    /// of work leaves in one write per connection.
    holding: AtomicBool,
    /// Queue pairs (by number) with frames held.
    held: Mutex<Vec<u32>>,
}

impl CqInner {
    fn push(&self, wc: WorkCompletion) {
        {
            let mut entries = self.entries.lock();
            if entries.len() >= self.depth {
                // Verbs treats an overrun as a fatal CQ error; keep the oldest and say
                // so loudly (the depth is the caller's to size).
                if !self.overflowed.swap(true, Ordering::Relaxed) {
                    tracing::error!(
                        depth = self.depth,
                        "completion queue overrun: completions lost"
                    );
                }
                return;
            }
            entries.push_back(wc);
        }
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            let _ = rustix::io::write(&self.wake, &1u64.to_ne_bytes());
        }
    }

    /// Waits up to `timeout` for socket activity, then progresses every ready queue
    /// pair.
    fn progress(&self, timeout: Option<Duration>) -> Result<(), FabricError> {
        thread_local! {
            // One epoll buffer per polling thread, not one per wait.
            static EVENTS: std::cell::RefCell<Vec<epoll::Event>> = std::cell::RefCell::new(Vec::with_capacity(64));
        }
        let mut events = EVENTS.with(|e| std::mem::take(&mut *e.borrow_mut()));
        events.clear();
        events.reserve(64);
        let result = self.progress_with(timeout, &mut events);
        EVENTS.with(|e| *e.borrow_mut() = events);
        result
    }

    fn progress_with(
        &self,
        timeout: Option<Duration>,
        events: &mut Vec<epoll::Event>,
    ) -> Result<(), FabricError> {
        let ts = timeout.map(|t| rustix::fs::Timespec {
            tv_sec: t.as_secs() as i64,
            tv_nsec: t.subsec_nanos() as i64,
        });
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        // A completion pushed by another thread between our last look and this wait
        // rings the eventfd, so the wait returns.
        let waited = if timeout.is_some_and(|t| !t.is_zero()) && !self.entries.lock().is_empty() {
            Ok(())
        } else {
            epoll::wait(
                &self.epoll,
                rustix::buffer::spare_capacity(events),
                ts.as_ref(),
            )
            .map(|_| ())
        };
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
        match waited {
            Ok(()) => {}
            Err(rustix::io::Errno::INTR) => return Ok(()),
            Err(e) => return Err(FabricError::Io(e.into())),
        }
        for event in events.iter() {
            let token = event.data.u64();
            if token == WAKE_TOKEN {
                let mut buf = [0u8; 8];
                let _ = rustix::io::read(&self.wake, &mut buf);
                continue;
            }
            let qp = self.qps.read().get(&(token as u32)).and_then(Weak::upgrade);
            if let Some(qp) = qp {
                qp.progress();
            }
        }
        Ok(())
    }
}

/// A completion queue of the software fabric.
#[derive(Debug, Clone)]
pub struct SoftCq {
    inner: Arc<CqInner>,
}

impl CompletionQueue for SoftCq {
    fn interrupter(&self) -> super::Interrupter {
        let inner = self.inner.clone();
        // Always written: a waiter about to sleep must find it. The next progress
        // pass drains it.
        super::Interrupter::new(move || {
            inner.interrupted.store(true, Ordering::SeqCst);
            let _ = rustix::io::write(&inner.wake, &1u64.to_ne_bytes());
        })
    }

    fn poll(&self, out: &mut Vec<WorkCompletion>, max: usize) -> usize {
        if self.inner.entries.lock().is_empty() {
            let _ = self.inner.progress(Some(Duration::ZERO));
        }
        let mut entries = self.inner.entries.lock();
        let n = entries.len().min(max);
        out.extend(entries.drain(..n));
        n
    }

    fn wait_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        // Readable when a socket of its queue pairs is, or on an interrupt or a
        // completion pushed while someone sleeps.
        Some(self.inner.epoll.as_fd())
    }

    fn prepare_sleep(&self) -> bool {
        // Withdrawn by `finish_sleep`, which the caller calls either way.
        self.inner.sleepers.fetch_add(1, Ordering::SeqCst);
        self.inner.entries.lock().is_empty()
    }

    fn hold_sends(&self, on: bool) {
        self.inner.holding.store(on, Ordering::Relaxed);
        if !on {
            self.flush_sends();
        }
    }

    fn flush_sends(&self) {
        let held = std::mem::take(&mut *self.inner.held.lock());
        for num in held {
            let qp = self.inner.qps.read().get(&num).and_then(Weak::upgrade);
            if let Some(qp) = qp {
                let mut tx = qp.tx.lock();
                tx.held = false;
                qp.flush(&mut tx);
            }
        }
    }

    fn finish_sleep(&self) {
        self.inner.sleepers.fetch_sub(1, Ordering::SeqCst);
        // Reads what the sockets have and drains the wake-up, so the epoll descriptor
        // is quiet until something new arrives.
        let _ = self.inner.progress(Some(Duration::ZERO));
    }

    fn wait(&self, timeout: Duration) -> Result<bool, FabricError> {
        let started = Instant::now();
        let deadline = started + timeout;
        let spin = self.inner.spin.min(timeout);
        loop {
            if !self.inner.entries.lock().is_empty() {
                return Ok(true);
            }
            if self.inner.interrupted.swap(false, Ordering::SeqCst) {
                return Ok(false);
            }
            let now = Instant::now();
            let Some(left) = deadline.checked_duration_since(now) else {
                return Ok(false);
            };
            // Poll the sockets for a short while before sleeping: the next frame of a
            // conversation usually comes within microseconds, and a sleep costs a
            // wake-up (tens of microseconds on a loaded VM).
            if now - started < spin {
                self.inner.progress(Some(Duration::ZERO))?;
                std::hint::spin_loop();
            } else {
                self.inner.progress(Some(left))?;
            }
        }
    }
}

// === queue pairs ===

#[derive(Debug)]
struct Outstanding {
    psn: u64,
    wr_id: u64,
    opcode: WcOpcode,
    signaled: bool,
    /// For reads: where the response lands.
    read: Option<(Arc<SharedRegion>, u64, u32)>,
}

#[derive(Debug)]
enum Payload {
    None,
    Inline(Vec<u8>),
    Region(Arc<SharedRegion>, u64, u64),
}

#[derive(Debug)]
struct OutFrame {
    head: [u8; FRAME_HEADER],
    payload: Payload,
    /// Bytes of head + payload written so far.
    sent: u64,
}

impl OutFrame {
    fn total(&self) -> u64 {
        FRAME_HEADER as u64
            + match &self.payload {
                Payload::None => 0,
                Payload::Inline(v) => v.len() as u64,
                Payload::Region(_, _, len) => *len,
            }
    }
}

#[derive(Debug, Default)]
struct Tx {
    next_psn: u64,
    outstanding: VecDeque<Outstanding>,
    queue: VecDeque<OutFrame>,
    want_writable: bool,
    /// Listed in the send queue's held queue pairs.
    held: bool,
}

/// Frames gathered into one write.
const GATHER: usize = 64;

#[derive(Debug)]
enum Sink {
    Discard,
    Region(Arc<SharedRegion>, u64),
    Buffer(Vec<u8>),
}

#[derive(Debug)]
struct InFrame {
    header: Header,
    got: u64,
    sink: Sink,
    /// A receive this frame consumes (SEND landing in place, or WRITE_WITH_IMM).
    recv: Option<RecvWr>,
    /// What went wrong, answered when the frame ends.
    nak: Option<WcStatus>,
    /// The requester's read this response completes.
    read: Option<Outstanding>,
}

#[derive(Debug)]
enum Held {
    /// A SEND whose payload waits for a receive.
    Send { header: Header, payload: Vec<u8> },
    /// A WRITE_WITH_IMM (data already written) waiting for a receive.
    Imm { header: Header },
}

#[derive(Debug)]
struct Rx {
    recvs: VecDeque<RecvWr>,
    held: VecDeque<Held>,
    held_bytes: usize,
    buf: Vec<u8>,
    start: usize,
    end: usize,
    current: Option<InFrame>,
}

impl Rx {
    fn new() -> Self {
        Self {
            recvs: VecDeque::new(),
            held: VecDeque::new(),
            held_bytes: 0,
            buf: vec![0u8; 256 << 10],
            start: 0,
            end: 0,
            current: None,
        }
    }
}

struct QpInner {
    num: u32,
    peer: SocketAddr,
    pd: Arc<PdInner>,
    send_cq: Arc<CqInner>,
    recv_cq: Arc<CqInner>,
    sock: TcpStream,
    caps: QpCaps,
    error: AtomicBool,
    tx: Mutex<Tx>,
    rx: Mutex<Rx>,
}

impl std::fmt::Debug for QpInner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QpInner")
            .field("num", &self.num)
            .field("peer", &self.peer)
            .finish_non_exhaustive()
    }
}

impl QpInner {
    fn cqs(&self) -> impl Iterator<Item = &Arc<CqInner>> {
        let same = Arc::ptr_eq(&self.send_cq, &self.recv_cq);
        std::iter::once(&self.send_cq).chain((!same).then_some(&self.recv_cq))
    }

    fn local(
        &self,
        addr: u64,
        len: u64,
        lkey: u32,
        need: Access,
    ) -> Option<(Arc<SharedRegion>, u64)> {
        let entry = self.pd.by_lkey.read().get(&lkey).cloned()?;
        if !entry.access.contains(need) {
            return None;
        }
        let offset = entry.locate(addr, len)?;
        Some((entry.region.clone(), offset))
    }

    fn remote(
        &self,
        addr: u64,
        len: u64,
        rkey: u32,
        need: Access,
    ) -> Option<(Arc<SharedRegion>, u64)> {
        let entry = self.pd.by_rkey.read().get(&rkey).cloned()?;
        if !entry.access.contains(need) {
            return None;
        }
        let offset = entry.locate(addr, len)?;
        Some((entry.region.clone(), offset))
    }

    fn complete_send(&self, o: &Outstanding, status: WcStatus, byte_len: u32) {
        if o.signaled || status != WcStatus::Success {
            self.send_cq.push(WorkCompletion {
                wr_id: o.wr_id,
                status,
                opcode: o.opcode,
                byte_len,
                imm: None,
                qp_num: self.num,
            });
        }
    }

    fn complete_recv(
        &self,
        wr_id: u64,
        status: WcStatus,
        opcode: WcOpcode,
        byte_len: u32,
        imm: Option<u32>,
    ) {
        self.recv_cq.push(WorkCompletion {
            wr_id,
            status,
            opcode,
            byte_len,
            imm,
            qp_num: self.num,
        });
    }

    /// Moves to the error state: the first outstanding request gets `first` (if
    /// given), everything else posted is flushed.
    fn fail(&self, first: Option<(u64, WcStatus)>, tx: &mut Tx, rx: Option<&mut Rx>) {
        let was = self.error.swap(true, Ordering::SeqCst);
        for o in tx.outstanding.drain(..).collect::<Vec<_>>() {
            let status = match first {
                Some((psn, s)) if psn == o.psn => s,
                _ => WcStatus::WrFlush,
            };
            self.complete_send(&o, status, 0);
        }
        // Keep a frame that is half on the wire (cutting it would desync the peer) and
        // NAKs still to say why; the socket is shut once they are out.
        tx.queue.retain(|f| f.sent > 0 || f.head[0] == K_NAK);
        match rx {
            Some(rx) => self.flush_recvs(rx),
            // Called with only the send side locked: take the receive side if free
            // (whoever holds it flushes its receives on its next pass, see `begin`).
            None => {
                if let Some(mut rx) = self.rx.try_lock() {
                    self.flush_recvs(&mut rx);
                }
            }
        }
        if tx.queue.is_empty() {
            let _ = self.sock.shutdown(std::net::Shutdown::Write);
        }
        if !was {
            tracing::debug!(qp = self.num, peer = %self.peer, "queue pair moved to the error state");
        }
    }

    /// Completes every posted receive with a flush error (the queue pair failed).
    fn flush_recvs(&self, rx: &mut Rx) {
        for r in rx.recvs.drain(..) {
            self.complete_recv(r.wr_id, WcStatus::WrFlush, WcOpcode::Recv, 0, None);
        }
        rx.held.clear();
        rx.held_bytes = 0;
    }

    fn enqueue(&self, tx: &mut Tx, frame: OutFrame) {
        tx.queue.push_back(frame);
        if self.send_cq.holding.load(Ordering::Relaxed) {
            if !tx.held {
                tx.held = true;
                self.send_cq.held.lock().push(self.num);
            }
            return;
        }
        self.flush(tx);
    }

    /// Writes the queue's leading frames that carry no region payload (heads and
    /// inline payloads, up to [`GATHER`] frames) in one vectored write; returns the
    /// bytes written, or `None` if the first frame is not of that kind.
    fn write_gathered(&self, tx: &Tx) -> Option<std::io::Result<usize>> {
        let mut slices: [IoSlice<'_>; 2 * GATHER] = [IoSlice::new(&[]); 2 * GATHER];
        let mut n = 0;
        for frame in tx.queue.iter().take(GATHER) {
            let payload: &[u8] = match &frame.payload {
                Payload::None => &[],
                Payload::Inline(v) => v,
                Payload::Region(..) => break,
            };
            let sent = frame.sent as usize;
            if sent < FRAME_HEADER {
                slices[n] = IoSlice::new(&frame.head[sent..]);
                n += 1;
                if !payload.is_empty() {
                    slices[n] = IoSlice::new(payload);
                    n += 1;
                }
            } else {
                slices[n] = IoSlice::new(&payload[sent - FRAME_HEADER..]);
                n += 1;
            }
        }
        if n < 2 {
            // One slice or none: the frame-by-frame path does as well.
            return None;
        }
        Some((&self.sock).write_vectored(&slices[..n]))
    }

    /// Accounts `n` written bytes to the queue's leading frames.
    fn advance(&self, tx: &mut Tx, mut n: u64) {
        while n > 0 {
            let Some(frame) = tx.queue.front_mut() else {
                return;
            };
            let step = (frame.total() - frame.sent).min(n);
            frame.sent += step;
            n -= step;
            if frame.sent >= frame.total() {
                tx.queue.pop_front();
            }
        }
    }

    /// Writes queued frames until done or the socket is full: runs of small frames
    /// in one vectored write, region payloads straight from their memory.
    fn flush(&self, tx: &mut Tx) {
        let mut sock = &self.sock;
        while !tx.queue.is_empty() {
            if tx.queue.len() > 1
                && let Some(result) = self.write_gathered(tx)
            {
                match result {
                    Ok(0) => {
                        self.fail(None, tx, None);
                        return;
                    }
                    Ok(n) => {
                        self.advance(tx, n as u64);
                        if tx.queue.is_empty() && self.error.load(Ordering::SeqCst) {
                            let _ = self.sock.shutdown(std::net::Shutdown::Write);
                        }
                        continue;
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        self.set_writable_interest(tx, true);
                        return;
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(_) => {
                        let first = tx
                            .outstanding
                            .front()
                            .map(|o| (o.psn, WcStatus::RetryExceeded));
                        self.fail(first, tx, None);
                        return;
                    }
                }
            }
            let frame = tx.queue.front_mut().expect("not empty");
            let total = frame.total();
            let result = if frame.sent < FRAME_HEADER as u64 {
                let head = &frame.head[frame.sent as usize..];
                match &frame.payload {
                    Payload::Inline(v) => {
                        sock.write_vectored(&[IoSlice::new(head), IoSlice::new(v)])
                    }
                    _ => sock.write(head),
                }
            } else {
                let done = frame.sent - FRAME_HEADER as u64;
                match &frame.payload {
                    Payload::None => Ok(0),
                    Payload::Inline(v) => sock.write(&v[done as usize..]),
                    // Straight from the registered memory, as a NIC reads it.
                    Payload::Region(region, offset, len) => region.write_to(
                        self.sock.as_fd(),
                        offset + done,
                        (len - done).min(4 << 20) as usize,
                    ),
                }
            };
            match result {
                Ok(0) if total > frame.sent => {
                    self.fail(None, tx, None);
                    return;
                }
                Ok(n) => {
                    let frame = tx.queue.front_mut().expect("present");
                    frame.sent += n as u64;
                    if frame.sent >= total {
                        tx.queue.pop_front();
                        if tx.queue.is_empty() && self.error.load(Ordering::SeqCst) {
                            // The last word of a failed queue pair is out: the peer
                            // learns the connection is over.
                            let _ = self.sock.shutdown(std::net::Shutdown::Write);
                        }
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    // A large frame is mid-way: wait a little for room rather than
                    // leave it to a poller that must first be woken. Bounded, so two
                    // sides writing to each other at once cannot wait on each other.
                    if total - frame.sent >= DIRECT_READ
                        && self.wait_writable(Duration::from_micros(500))
                    {
                        continue;
                    }
                    self.set_writable_interest(tx, true);
                    return;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => {
                    let first = tx
                        .outstanding
                        .front()
                        .map(|o| (o.psn, WcStatus::RetryExceeded));
                    self.fail(first, tx, None);
                    return;
                }
            }
        }
        self.set_writable_interest(tx, false);
    }

    fn wait_writable(&self, timeout: Duration) -> bool {
        let mut fds = [rustix::event::PollFd::new(
            &self.sock,
            rustix::event::PollFlags::OUT,
        )];
        let ts = rustix::fs::Timespec {
            tv_sec: 0,
            tv_nsec: timeout.as_nanos() as i64,
        };
        matches!(rustix::event::poll(&mut fds, Some(&ts)), Ok(n) if n > 0)
    }

    fn set_writable_interest(&self, tx: &mut Tx, on: bool) {
        if tx.want_writable == on {
            return;
        }
        tx.want_writable = on;
        let mut flags = epoll::EventFlags::IN | epoll::EventFlags::RDHUP;
        if on {
            flags |= epoll::EventFlags::OUT;
        }
        for cq in self.cqs() {
            let _ = epoll::modify(
                &cq.epoll,
                &self.sock,
                epoll::EventData::new_u64(self.num as u64),
                flags,
            );
        }
    }

    /// Reads and handles what arrived, then flushes what is queued.
    fn progress(&self) {
        if let Some(mut rx) = self.rx.try_lock() {
            self.read_all(&mut rx);
        }
        if let Some(mut tx) = self.tx.try_lock()
            && !tx.queue.is_empty()
        {
            self.flush(&mut tx);
        }
    }

    fn read_all(&self, rx: &mut Rx) {
        loop {
            // A large payload bound for registered memory lands there directly once
            // the buffered bytes are used up (no bounce through the receive buffer).
            if rx.start == rx.end
                && let Some(frame) = rx.current.as_mut()
                && let Sink::Region(region, offset) = &frame.sink
                && frame.header.len as u64 - frame.got >= DIRECT_READ
            {
                let want = (frame.header.len as u64 - frame.got) as usize;
                match region.read_from(self.sock.as_fd(), *offset + frame.got, want) {
                    Ok(0) => {
                        self.peer_gone(rx);
                        return;
                    }
                    Ok(n) => {
                        frame.got += n as u64;
                        if frame.got == frame.header.len as u64 {
                            let frame = rx.current.take().expect("matched above");
                            self.finish(frame, rx);
                        }
                        continue;
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(_) => {
                        self.peer_gone(rx);
                        return;
                    }
                }
            }
            if rx.start == rx.end {
                rx.start = 0;
                rx.end = 0;
            } else if rx.end == rx.buf.len() {
                rx.buf.copy_within(rx.start..rx.end, 0);
                rx.end -= rx.start;
                rx.start = 0;
            }
            let end = rx.end;
            match (&self.sock).read(&mut rx.buf[end..]) {
                Ok(0) => {
                    self.peer_gone(rx);
                    return;
                }
                Ok(n) => {
                    rx.end += n;
                    self.parse(rx);
                    if rx.end < rx.buf.len() {
                        // A short read drained the socket; epoll says when more comes.
                        return;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => {
                    self.peer_gone(rx);
                    return;
                }
            }
        }
    }

    fn peer_gone(&self, rx: &mut Rx) {
        // Nothing more will arrive: stop watching the socket (a closed socket stays
        // readable and would wake its pollers forever).
        for cq in self.cqs() {
            let _ = epoll::delete(&cq.epoll, &self.sock);
        }
        if self.error.load(Ordering::SeqCst) {
            return;
        }
        let mut tx = self.tx.lock();
        let first = tx
            .outstanding
            .front()
            .map(|o| (o.psn, WcStatus::RetryExceeded));
        self.fail(first, &mut tx, Some(rx));
    }

    fn parse(&self, rx: &mut Rx) {
        loop {
            if rx.current.is_none() {
                if rx.end - rx.start < FRAME_HEADER {
                    return;
                }
                let header = Header::decode(&rx.buf[rx.start..rx.start + FRAME_HEADER]);
                rx.start += FRAME_HEADER;
                let frame = self.begin(header, rx);
                rx.current = Some(frame);
            }
            let frame = rx.current.as_mut().expect("set above");
            let want = frame.header.len as u64 - frame.got;
            let n = want.min((rx.end - rx.start) as u64) as usize;
            if n > 0 {
                let bytes = &rx.buf[rx.start..rx.start + n];
                match &mut frame.sink {
                    Sink::Discard => {}
                    Sink::Buffer(v) => v.extend_from_slice(bytes),
                    Sink::Region(region, offset) => {
                        let _ = region.write(*offset + frame.got, bytes);
                    }
                }
                frame.got += n as u64;
                rx.start += n;
            }
            if frame.got < frame.header.len as u64 {
                return;
            }
            let frame = rx.current.take().expect("set above");
            self.finish(frame, rx);
        }
    }

    /// Decides where a frame's payload goes, before any of it arrives.
    fn begin(&self, header: Header, rx: &mut Rx) -> InFrame {
        let mut frame = InFrame {
            header,
            got: 0,
            sink: Sink::Discard,
            recv: None,
            nak: None,
            read: None,
        };
        if self.error.load(Ordering::SeqCst) {
            if !rx.recvs.is_empty() {
                self.flush_recvs(rx);
            }
            return frame;
        }
        let len = header.len as u64;
        match header.kind {
            K_SEND => {
                // Land in place when the next receive is posted and fits; otherwise
                // hold the bytes for when one is (receiver not ready).
                if rx.held.is_empty()
                    && let Some(r) = rx.recvs.front().copied()
                {
                    rx.recvs.pop_front();
                    if len > r.sge.len as u64 {
                        frame.nak = Some(WcStatus::RemoteInvalidRequest);
                        frame.recv = Some(r);
                    } else if let Some((region, offset)) =
                        self.local(r.sge.addr, len, r.sge.lkey, Access::LOCAL_WRITE)
                    {
                        frame.sink = Sink::Region(region, offset);
                        frame.recv = Some(r);
                    } else {
                        frame.nak = Some(WcStatus::RemoteOperation);
                        frame.recv = Some(r);
                    }
                } else if rx.held_bytes as u64 + len > MAX_HELD_BYTES as u64 {
                    // Refused before a byte is buffered: one frame may announce 4 GiB.
                    frame.nak = Some(WcStatus::RnrRetryExceeded);
                } else {
                    frame.sink = Sink::Buffer(Vec::with_capacity(len.min(1 << 20) as usize));
                }
            }
            K_WRITE => match self.remote(header.addr, len, header.rkey, Access::REMOTE_WRITE) {
                Some((region, offset)) => frame.sink = Sink::Region(region, offset),
                None => frame.nak = Some(WcStatus::RemoteAccess),
            },
            K_READ_RESP => {
                let mut tx = self.tx.lock();
                // Requests before the read that asked for no ACK are done by now.
                while tx
                    .outstanding
                    .front()
                    .is_some_and(|o| o.psn < header.psn && o.read.is_none())
                {
                    let o = tx.outstanding.pop_front().expect("checked");
                    self.complete_send(&o, WcStatus::Success, 0);
                }
                if let Some(o) = tx.outstanding.pop_front() {
                    if let Some((region, offset, want)) = &o.read
                        && o.psn == header.psn
                        && *want as u64 == len
                    {
                        frame.sink = Sink::Region(region.clone(), *offset);
                    } else {
                        frame.nak = Some(WcStatus::General);
                    }
                    frame.read = Some(o);
                } else {
                    frame.nak = Some(WcStatus::General);
                }
            }
            _ => {}
        }
        frame
    }

    fn finish(&self, frame: InFrame, rx: &mut Rx) {
        if self.error.load(Ordering::SeqCst) {
            return;
        }
        let h = frame.header;
        let imm = (h.flags & F_IMM != 0).then_some(h.imm);
        match h.kind {
            K_SEND => match (frame.nak, frame.recv, frame.sink) {
                (Some(status), Some(r), _) => {
                    let local = if status == WcStatus::RemoteInvalidRequest {
                        WcStatus::LocalLength
                    } else {
                        WcStatus::LocalProtection
                    };
                    self.complete_recv(r.wr_id, local, WcOpcode::Recv, h.len, imm);
                    self.nak(h.psn, status, rx);
                }
                (None, Some(r), _) => {
                    self.complete_recv(r.wr_id, WcStatus::Success, WcOpcode::Recv, h.len, imm);
                    self.ack(h);
                }
                (Some(status), None, _) => self.nak(h.psn, status, rx),
                (_, None, Sink::Buffer(payload)) => {
                    rx.held_bytes += payload.len();
                    rx.held.push_back(Held::Send { header: h, payload });
                    self.check_held(rx, h.psn);
                }
                _ => {}
            },
            K_WRITE => {
                if let Some(status) = frame.nak {
                    self.nak(h.psn, status, rx);
                    return;
                }
                if imm.is_some() {
                    rx.held.push_back(Held::Imm { header: h });
                    self.drain_held(rx);
                } else {
                    self.ack(h);
                }
            }
            K_READ_REQ => {
                let len = h.imm as u64;
                match self.remote(h.addr, len, h.rkey, Access::REMOTE_READ) {
                    Some((region, offset)) => {
                        let head = Header {
                            kind: K_READ_RESP,
                            len: len as u32,
                            psn: h.psn,
                            ..Header::default()
                        };
                        let payload = if len <= INLINE {
                            let mut v = vec![0u8; len as usize];
                            let _ = region.read(offset, &mut v);
                            Payload::Inline(v)
                        } else {
                            Payload::Region(region, offset, len)
                        };
                        let mut tx = self.tx.lock();
                        self.enqueue(
                            &mut tx,
                            OutFrame {
                                head: head.encode(),
                                payload,
                                sent: 0,
                            },
                        );
                    }
                    None => self.nak(h.psn, WcStatus::RemoteAccess, rx),
                }
            }
            K_READ_RESP => {
                if let Some(o) = frame.read {
                    match frame.nak {
                        None => self.complete_send(&o, WcStatus::Success, h.len),
                        Some(status) => {
                            let mut tx = self.tx.lock();
                            tx.outstanding.push_front(o);
                            let first = Some((h.psn, status));
                            self.fail(first, &mut tx, Some(rx));
                        }
                    }
                }
            }
            K_ACK => {
                let mut tx = self.tx.lock();
                while tx
                    .outstanding
                    .front()
                    .is_some_and(|o| o.psn <= h.psn && o.read.is_none())
                {
                    let o = tx.outstanding.pop_front().expect("checked");
                    self.complete_send(&o, WcStatus::Success, 0);
                }
            }
            K_NAK => {
                let mut tx = self.tx.lock();
                // Everything before the refused request was carried out.
                while tx
                    .outstanding
                    .front()
                    .is_some_and(|o| o.psn < h.psn && o.read.is_none())
                {
                    let o = tx.outstanding.pop_front().expect("checked");
                    self.complete_send(&o, WcStatus::Success, 0);
                }
                self.fail(Some((h.psn, status_of(h.imm))), &mut tx, Some(rx));
            }
            _ => {
                // Not a frame this version sends: the peer is broken.
                let mut tx = self.tx.lock();
                self.fail(None, &mut tx, Some(rx));
            }
        }
    }

    fn ack(&self, h: Header) {
        if h.flags & F_ACK_REQ == 0 {
            return;
        }
        let head = Header {
            kind: K_ACK,
            psn: h.psn,
            ..Header::default()
        };
        let mut tx = self.tx.lock();
        self.enqueue(
            &mut tx,
            OutFrame {
                head: head.encode(),
                payload: Payload::None,
                sent: 0,
            },
        );
    }

    /// Refuses request `psn`: the requester hears why, and this side moves to the
    /// error state too (as a responder does on an access error).
    fn nak(&self, psn: u64, status: WcStatus, rx: &mut Rx) {
        let head = Header {
            kind: K_NAK,
            psn,
            imm: status_code(status),
            ..Header::default()
        };
        let mut tx = self.tx.lock();
        // A frame half on the wire is finished first, or the peer would read the NAK
        // as the rest of its payload.
        let keep = usize::from(tx.queue.front().is_some_and(|f| f.sent > 0));
        tx.queue.truncate(keep);
        tx.queue.push_back(OutFrame {
            head: head.encode(),
            payload: Payload::None,
            sent: 0,
        });
        self.fail(None, &mut tx, Some(rx));
        self.flush(&mut tx);
    }

    fn check_held(&self, rx: &mut Rx, psn: u64) {
        if rx.held_bytes > MAX_HELD_BYTES {
            tracing::warn!(
                qp = self.num,
                "peer kept no receive posted: receiver-not-ready limit"
            );
            self.nak(psn, WcStatus::RnrRetryExceeded, rx);
            return;
        }
        self.drain_held(rx);
    }

    /// Matches held SENDs and WRITE_WITH_IMMs with posted receives, in order.
    fn drain_held(&self, rx: &mut Rx) {
        while !rx.held.is_empty() {
            let Some(r) = rx.recvs.pop_front() else {
                return;
            };
            match rx.held.pop_front().expect("checked") {
                Held::Imm { header } => {
                    self.complete_recv(
                        r.wr_id,
                        WcStatus::Success,
                        WcOpcode::RecvRdmaWithImm,
                        header.len,
                        Some(header.imm),
                    );
                    self.ack(header);
                }
                Held::Send { header, payload } => {
                    rx.held_bytes -= payload.len();
                    let imm = (header.flags & F_IMM != 0).then_some(header.imm);
                    if payload.len() > r.sge.len as usize {
                        self.complete_recv(
                            r.wr_id,
                            WcStatus::LocalLength,
                            WcOpcode::Recv,
                            header.len,
                            imm,
                        );
                        self.nak(header.psn, WcStatus::RemoteInvalidRequest, rx);
                        return;
                    }
                    match self.local(
                        r.sge.addr,
                        payload.len() as u64,
                        r.sge.lkey,
                        Access::LOCAL_WRITE,
                    ) {
                        Some((region, offset)) => {
                            let _ = region.write(offset, &payload);
                            self.complete_recv(
                                r.wr_id,
                                WcStatus::Success,
                                WcOpcode::Recv,
                                header.len,
                                imm,
                            );
                            self.ack(header);
                        }
                        None => {
                            self.complete_recv(
                                r.wr_id,
                                WcStatus::LocalProtection,
                                WcOpcode::Recv,
                                header.len,
                                imm,
                            );
                            self.nak(header.psn, WcStatus::RemoteOperation, rx);
                            return;
                        }
                    }
                }
            }
        }
    }
}

impl Drop for QpInner {
    fn drop(&mut self) {
        for cq in [&self.send_cq, &self.recv_cq] {
            let _ = epoll::delete(&cq.epoll, &self.sock);
            cq.qps.write().remove(&self.num);
        }
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
    }
}

/// A queue pair of the software fabric.
#[derive(Debug)]
pub struct SoftQp {
    inner: Arc<QpInner>,
}

impl SoftQp {
    /// The peer's address.
    pub fn peer(&self) -> SocketAddr {
        self.inner.peer
    }
}

impl QueuePair for SoftQp {
    fn qp_num(&self) -> u32 {
        self.inner.num
    }

    fn state(&self) -> QpState {
        if self.inner.error.load(Ordering::SeqCst) {
            QpState::Error
        } else {
            QpState::ReadyToSend
        }
    }

    fn post_send(&self, wr: SendWr) -> Result<(), FabricError> {
        let qp = &self.inner;
        if qp.error.load(Ordering::SeqCst) {
            return Err(FabricError::QpError(qp.num));
        }
        let mut tx = qp.tx.lock();
        if tx.outstanding.len() >= qp.caps.max_send_wr as usize {
            return Err(FabricError::QueueFull {
                qp: qp.num,
                which: "send",
                limit: qp.caps.max_send_wr,
            });
        }
        let psn = tx.next_psn;
        let len = wr.sge.len as u64;
        let need = match wr.op {
            SendOp::Read(_) => Access::LOCAL_WRITE,
            _ => Access::default(),
        };
        let opcode = match wr.op {
            SendOp::Send | SendOp::SendWithImm(_) => WcOpcode::Send,
            SendOp::Write(_) | SendOp::WriteWithImm(..) => WcOpcode::RdmaWrite,
            SendOp::Read(_) => WcOpcode::RdmaRead,
        };
        let Some((region, offset)) = qp.local(wr.sge.addr, len, wr.sge.lkey, need) else {
            // A local protection error completes the request in error and fails the
            // queue pair, as verbs does.
            let o = Outstanding {
                psn,
                wr_id: wr.wr_id,
                opcode,
                signaled: true,
                read: None,
            };
            tx.next_psn += 1;
            tx.outstanding.push_back(o);
            // Locks are always taken receive side first.
            drop(tx);
            let mut rx = qp.rx.lock();
            let mut tx = qp.tx.lock();
            qp.fail(
                Some((psn, WcStatus::LocalProtection)),
                &mut tx,
                Some(&mut rx),
            );
            return Ok(());
        };
        tx.next_psn += 1;
        let ack = if wr.signaled { F_ACK_REQ } else { 0 };
        let (head, payload, read) = match wr.op {
            SendOp::Send | SendOp::SendWithImm(_) | SendOp::Write(_) | SendOp::WriteWithImm(..) => {
                let (kind, remote, imm) = match wr.op {
                    SendOp::Send => (K_SEND, None, None),
                    SendOp::SendWithImm(i) => (K_SEND, None, Some(i)),
                    SendOp::Write(r) => (K_WRITE, Some(r), None),
                    SendOp::WriteWithImm(r, i) => (K_WRITE, Some(r), Some(i)),
                    SendOp::Read(_) => unreachable!("matched above"),
                };
                let remote = remote.unwrap_or(RemoteAddr { addr: 0, rkey: 0 });
                let head = Header {
                    kind,
                    flags: ack | if imm.is_some() { F_IMM } else { 0 },
                    len: wr.sge.len,
                    psn,
                    addr: remote.addr,
                    rkey: remote.rkey,
                    imm: imm.unwrap_or(0),
                };
                let payload = if len == 0 {
                    Payload::None
                } else if len <= INLINE {
                    let mut v = vec![0u8; len as usize];
                    let _ = region.read(offset, &mut v);
                    Payload::Inline(v)
                } else {
                    Payload::Region(region, offset, len)
                };
                (head, payload, None)
            }
            SendOp::Read(remote) => {
                let head = Header {
                    kind: K_READ_REQ,
                    flags: 0,
                    len: 0,
                    psn,
                    addr: remote.addr,
                    rkey: remote.rkey,
                    imm: wr.sge.len,
                };
                (head, Payload::None, Some((region, offset, wr.sge.len)))
            }
        };
        tx.outstanding.push_back(Outstanding {
            psn,
            wr_id: wr.wr_id,
            opcode,
            signaled: wr.signaled,
            read,
        });
        qp.enqueue(
            &mut tx,
            OutFrame {
                head: head.encode(),
                payload,
                sent: 0,
            },
        );
        Ok(())
    }

    fn post_recv(&self, wr: RecvWr) -> Result<(), FabricError> {
        let qp = &self.inner;
        if qp.error.load(Ordering::SeqCst) {
            return Err(FabricError::QpError(qp.num));
        }
        let mut rx = qp.rx.lock();
        if rx.recvs.len() >= qp.caps.max_recv_wr as usize {
            return Err(FabricError::QueueFull {
                qp: qp.num,
                which: "receive",
                limit: qp.caps.max_recv_wr,
            });
        }
        rx.recvs.push_back(wr);
        if !rx.held.is_empty() {
            qp.drain_held(&mut rx);
        }
        Ok(())
    }
}

// === the device ===

impl Default for SoftFabric {
    fn default() -> Self {
        Self::new()
    }
}

/// The software fabric device.
#[derive(Debug, Clone)]
pub struct SoftFabric {
    next_qp: Arc<AtomicU32>,
    spin: Duration,
}

impl SoftFabric {
    /// How long a completion queue's `wait` polls before sleeping, by default.
    /// Zero: on few cores a spinning poller takes the CPU the peer needs (measured:
    /// 30 µs of spin made small round trips slower on a 2-core machine).
    pub const DEFAULT_SPIN: Duration = Duration::ZERO;

    /// A device.
    pub fn new() -> Self {
        Self {
            next_qp: Arc::new(AtomicU32::new(1)),
            spin: Self::DEFAULT_SPIN,
        }
    }

    /// Completion queues created from now on poll for `spin` before sleeping (zero:
    /// sleep at once, the low-CPU mode).
    pub fn with_spin(mut self, spin: Duration) -> Self {
        self.spin = spin;
        self
    }

    fn key(&self) -> u32 {
        let mut b = [0u8; 4];
        if getrandom::fill(&mut b).is_err() {
            // Keys need not be secret to be checked; unpredictable is a bonus.
            b = (Instant::now().elapsed().subsec_nanos() ^ 0x9e37_79b9).to_le_bytes();
        }
        u32::from_le_bytes(b) | 1
    }

    fn make_qp(
        &self,
        pd: &SoftPd,
        sock: TcpStream,
        peer: SocketAddr,
        cq: &SoftCq,
        caps: QpCaps,
    ) -> Result<SoftQp, FabricError> {
        sock.set_nodelay(true)?;
        sock.set_nonblocking(true)?;
        let num = self.next_qp.fetch_add(1, Ordering::Relaxed);
        let inner = Arc::new(QpInner {
            num,
            peer,
            pd: pd.inner.clone(),
            send_cq: cq.inner.clone(),
            recv_cq: cq.inner.clone(),
            sock,
            caps,
            error: AtomicBool::new(false),
            tx: Mutex::new(Tx::default()),
            rx: Mutex::new(Rx::new()),
        });
        cq.inner.qps.write().insert(num, Arc::downgrade(&inner));
        epoll::add(
            &cq.inner.epoll,
            &inner.sock,
            epoll::EventData::new_u64(num as u64),
            epoll::EventFlags::IN | epoll::EventFlags::RDHUP,
        )
        .map_err(|e| FabricError::Io(e.into()))?;
        Ok(SoftQp { inner })
    }
}

fn hello(sock: &mut TcpStream, qp_hint: u32) -> std::io::Result<()> {
    let mut out = [0u8; 12];
    out[0..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
    out[4..8].copy_from_slice(&HELLO_VERSION.to_le_bytes());
    out[8..12].copy_from_slice(&qp_hint.to_le_bytes());
    sock.write_all(&out)?;
    let mut got = [0u8; 12];
    sock.set_read_timeout(Some(Duration::from_secs(10)))?;
    sock.read_exact(&mut got)?;
    sock.set_read_timeout(None)?;
    let magic = u32::from_le_bytes([got[0], got[1], got[2], got[3]]);
    let version = u32::from_le_bytes([got[4], got[5], got[6], got[7]]);
    if magic != HELLO_MAGIC {
        return Err(std::io::Error::other(
            "the peer is not a DPUmesh software fabric endpoint",
        ));
    }
    if version != HELLO_VERSION {
        return Err(std::io::Error::other(format!(
            "software fabric version mismatch: this side speaks {HELLO_VERSION}, the peer {version}"
        )));
    }
    Ok(())
}

/// A listener of the software fabric.
#[derive(Debug)]
pub struct SoftListener {
    fabric: SoftFabric,
    pd: SoftPd,
    cq: SoftCq,
    caps: QpCaps,
    listener: TcpListener,
    addr: SocketAddr,
}

impl QpListener for SoftListener {
    type Qp = SoftQp;

    fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    fn accept(&self, timeout: Duration) -> Result<Option<SoftQp>, FabricError> {
        let deadline = Instant::now() + timeout;
        loop {
            match self.listener.accept() {
                Ok((mut sock, peer)) => {
                    sock.set_nonblocking(false)?;
                    if let Err(e) = hello(&mut sock, 0) {
                        tracing::warn!(%peer, error = %e, "refused a fabric connection");
                        continue;
                    }
                    return self
                        .fabric
                        .make_qp(&self.pd, sock, peer, &self.cq, self.caps)
                        .map(Some);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        return Ok(None);
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
}

impl Fabric for SoftFabric {
    type Pd = SoftPd;
    type Mr = SoftMr;
    type Cq = SoftCq;
    type Qp = SoftQp;
    type Listener = SoftListener;

    fn name(&self) -> &'static str {
        "software (TCP)"
    }

    fn alloc_pd(&self) -> Result<SoftPd, FabricError> {
        Ok(SoftPd::default())
    }

    fn register(
        &self,
        pd: &SoftPd,
        region: &Arc<SharedRegion>,
        offset: u64,
        len: u64,
        access: Access,
    ) -> Result<SoftMr, FabricError> {
        if len == 0
            || offset
                .checked_add(len)
                .is_none_or(|end| end > region.len() as u64)
        {
            return Err(FabricError::Register(format!(
                "{len} bytes at offset {offset} do not fit region {} of {} bytes",
                region.name(),
                region.len()
            )));
        }
        let entry = Arc::new(MrEntry {
            region: region.clone(),
            offset,
            len,
            addr: region.base_addr() + offset,
            access,
        });
        let (mut lkey, mut rkey) = (self.key(), self.key());
        {
            let mut by_lkey = pd.inner.by_lkey.write();
            while by_lkey.contains_key(&lkey) {
                lkey = self.key();
            }
            by_lkey.insert(lkey, entry.clone());
        }
        {
            let mut by_rkey = pd.inner.by_rkey.write();
            while by_rkey.contains_key(&rkey) {
                rkey = self.key();
            }
            by_rkey.insert(rkey, entry.clone());
        }
        Ok(SoftMr {
            pd: pd.inner.clone(),
            entry,
            lkey,
            rkey,
        })
    }

    fn create_cq(&self, depth: u32) -> Result<SoftCq, FabricError> {
        let io = |e: rustix::io::Errno| FabricError::Io(e.into());
        let epoll = epoll::create(epoll::CreateFlags::CLOEXEC).map_err(io)?;
        let wake = rustix::event::eventfd(
            0,
            rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
        )
        .map_err(io)?;
        epoll::add(
            &epoll,
            wake.as_fd(),
            epoll::EventData::new_u64(WAKE_TOKEN),
            epoll::EventFlags::IN,
        )
        .map_err(io)?;
        Ok(SoftCq {
            inner: Arc::new(CqInner {
                entries: Mutex::new(VecDeque::new()),
                spin: self.spin,
                depth: depth.max(1) as usize,
                epoll,
                wake,
                sleepers: AtomicUsize::new(0),
                interrupted: AtomicBool::new(false),
                qps: RwLock::new(HashMap::new()),
                overflowed: AtomicBool::new(false),
                holding: AtomicBool::new(false),
                held: Mutex::new(Vec::new()),
            }),
        })
    }

    fn listen(
        &self,
        pd: &SoftPd,
        addr: SocketAddr,
        cq: &SoftCq,
        caps: QpCaps,
    ) -> Result<SoftListener, FabricError> {
        let listener = TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        Ok(SoftListener {
            fabric: self.clone(),
            pd: pd.clone(),
            cq: cq.clone(),
            caps,
            listener,
            addr,
        })
    }

    fn connect(
        &self,
        pd: &SoftPd,
        addr: SocketAddr,
        cq: &SoftCq,
        caps: QpCaps,
    ) -> Result<SoftQp, FabricError> {
        let connect_err = |detail: String| FabricError::Connect { addr, detail };
        let mut sock = TcpStream::connect_timeout(&addr, Duration::from_secs(10))
            .map_err(|e| connect_err(e.to_string()))?;
        hello(&mut sock, 0).map_err(|e| connect_err(e.to_string()))?;
        self.make_qp(pd, sock, addr, cq, caps)
    }
}

#[cfg(test)]
mod tests {
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
}

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
//! NIC doorbell; a completion queue's owner may hold its sends instead and flush them
//! once per pass, many frames in one write.
//!
//! Its parts: `mr` (registration and access checks), `cq` (completion queues),
//! `qp` (queue pairs and the verbs), `send` and `recv` (the two directions of a
//! connection), `device` (the fabric, connecting and listening).

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
use dpumesh_rings::shm::SharedRegion;

mod cq;
mod device;
pub use device::parse_hello;
mod mr;
mod qp;
mod recv;
mod rxstamp;
mod send;
mod ud;
pub use ud::{SoftAh, SoftUdQp, check_ud_header};
#[cfg(test)]
mod tests;

const FRAME_HEADER: usize = 32;
const HELLO_MAGIC: u32 = u32::from_le_bytes(*b"DPRF");
/// 2: the hello says whether mutual TLS follows.
const HELLO_VERSION: u32 = 2;
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

/// A completion queue of the software fabric.
#[derive(Debug, Clone)]
pub struct SoftCq {
    inner: Arc<CqInner>,
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
    /// Mutual TLS on this connection (`None`: plain TCP).
    tls: Option<dpumesh_identity::TlsSession>,
    /// Who the peer proved to be in the handshake.
    peer_id: Option<dpumesh_identity::SpiffeId>,
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

/// A queue pair of the software fabric.
#[derive(Debug)]
pub struct SoftQp {
    inner: Arc<QpInner>,
}

// === the device ===

/// The software fabric device.
#[derive(Debug, Clone)]
pub struct SoftFabric {
    next_qp: Arc<AtomicU32>,
    spin: Duration,
    /// Mutual TLS for every connection (`None`: plain TCP).
    tls: Option<Arc<dpumesh_identity::MeshTls>>,
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

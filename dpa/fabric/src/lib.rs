//! The RDMA fabric between nodes, with verbs semantics: protection domains, memory
//! regions with lkey/rkey, reliable-connected queue pairs, SEND, SEND_WITH_IMM,
//! RDMA_WRITE, RDMA_WRITE_WITH_IMM, RDMA_READ, and completion queues that one poller
//! drains for many queue pairs.
//!
//! Two backends: [`soft`] over TCP (the product on machines without RDMA NICs: one
//! connection per queue pair, remote writes land in the registered region on the
//! other side, keys and bounds checked, violations become error completions) and
//! `verbs` (feature `verbs`, libibverbs/librdmacm through `rdma-sys`).
//!
//! Semantics both follow, as in verbs:
//! - A work request completes in order on its queue pair; only signaled requests (and
//!   every failed one) produce a completion, so a sender signals now and then to let
//!   its send queue drain.
//! - A SEND or a WRITE_WITH_IMM consumes a posted receive on the other side; with none
//!   posted the sender is held back (receiver-not-ready retries), not failed.
//! - A remote access with a wrong rkey, outside the region, or without the access
//!   right completes with [`WcStatus::RemoteAccess`] at the requester and moves both
//!   queue pairs to the error state; the memory is not touched. Later and outstanding
//!   requests are flushed ([`WcStatus::WrFlush`]).
//! - Memory named in a posted request must stay untouched until its completion.
//!
//! Unreliable datagram queue pairs (probes) are in [`ud`].
//!
//! Addresses are virtual addresses in the owner's process ([`MemoryRegion::addr`] plus
//! an offset), as verbs uses them; a peer learns them with the rkey.

pub mod admission;
#[cfg(test)]
pub(crate) mod conformance;
pub mod shm;
pub mod soft;
#[cfg(any(test, feature = "test-support"))]
pub mod test_tls;
pub mod ud;
#[cfg(feature = "verbs")]
pub mod verbs;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use dpumesh_rings::shm::SharedRegion;

/// Access rights of a memory region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Access(u32);

impl Access {
    /// The local side may write (receives and read responses land here).
    pub const LOCAL_WRITE: Access = Access(1);
    /// Peers may RDMA_WRITE here.
    pub const REMOTE_WRITE: Access = Access(2);
    /// Peers may RDMA_READ from here.
    pub const REMOTE_READ: Access = Access(4);

    /// Every right.
    pub fn all() -> Access {
        Self::LOCAL_WRITE | Self::REMOTE_WRITE | Self::REMOTE_READ
    }

    /// Whether every right in `other` is granted.
    pub fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }

    pub fn bits(self) -> u32 {
        self.0
    }

    /// The rights `bits` names (unknown bits are ignored).
    pub fn from_bits(bits: u32) -> Access {
        Access(bits & Self::all().0)
    }
}

impl std::ops::BitOr for Access {
    type Output = Access;
    fn bitor(self, rhs: Access) -> Access {
        Access(self.0 | rhs.0)
    }
}

/// A local buffer: an address inside a registered region, its length and the
/// region's lkey (verbs' `ibv_sge`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sge {
    pub addr: u64,
    pub len: u32,
    /// Local key of the region it is in.
    pub lkey: u32,
}

/// A remote buffer: an address in a peer's registered region and its rkey.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct RemoteAddr {
    /// Virtual address in the peer's process.
    pub addr: u64,
    /// Remote key of the peer's region.
    pub rkey: u32,
}

impl RemoteAddr {
    /// `delta` bytes further.
    pub fn offset_by(self, delta: u64) -> Self {
        Self {
            addr: self.addr + delta,
            rkey: self.rkey,
        }
    }
}

/// The operation of a send work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOp {
    /// Two-sided: lands in the peer's next posted receive.
    Send,
    /// SEND carrying 32 bits of immediate data.
    SendWithImm(u32),
    /// One-sided write into the peer's memory.
    Write(RemoteAddr),
    /// Write, then consume a posted receive on the peer carrying the immediate data
    /// (how a receiver learns that a WRITE landed without polling memory).
    WriteWithImm(RemoteAddr, u32),
    /// One-sided read of the peer's memory into the local buffer.
    Read(RemoteAddr),
}

/// A send work request (one scatter/gather entry).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendWr {
    /// The caller's id, returned in the completion.
    pub wr_id: u64,
    /// What to do.
    pub op: SendOp,
    /// The local buffer (source, or destination for reads).
    pub sge: Sge,
    /// Whether success produces a completion.
    pub signaled: bool,
}

/// A receive work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvWr {
    /// The caller's id.
    pub wr_id: u64,
    /// Where an incoming SEND lands (length 0 for WRITE_WITH_IMM-only receives).
    pub sge: Sge,
}

/// What completed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WcOpcode {
    /// A SEND (either kind).
    Send,
    /// An RDMA_WRITE (either kind).
    RdmaWrite,
    /// An RDMA_READ.
    RdmaRead,
    /// A receive consumed by a SEND.
    Recv,
    /// A receive consumed by a WRITE_WITH_IMM.
    RecvRdmaWithImm,
}

/// How it completed (verbs' `ibv_wc_status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WcStatus {
    /// Done.
    Success,
    /// A SEND was larger than the receive it landed in.
    LocalLength,
    /// The local buffer is not in a region of this protection domain, or lacks the
    /// access it needs.
    LocalProtection,
    /// The peer refused the access (rkey, bounds or rights).
    RemoteAccess,
    /// The peer could not take the request (e.g. a SEND too large for its receive).
    RemoteInvalidRequest,
    /// The peer failed to carry out a valid request (e.g. its receive buffer is not
    /// writable).
    RemoteOperation,
    /// The queue pair is in the error state; the request was not carried out.
    WrFlush,
    /// The peer went away.
    RetryExceeded,
    /// The peer kept no receive posted for too long.
    RnrRetryExceeded,
    /// Anything else.
    General,
}

/// A completion (verbs' `ibv_wc`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkCompletion {
    /// The work request's id.
    pub wr_id: u64,
    /// How it ended.
    pub status: WcStatus,
    /// What it was.
    pub opcode: WcOpcode,
    /// Bytes received (receives and reads).
    pub byte_len: u32,
    /// Immediate data, if the peer sent some.
    pub imm: Option<u32>,
    /// The queue pair.
    pub qp_num: u32,
}

/// State of a queue pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QpState {
    /// Ready to send and receive.
    ReadyToSend,
    /// Failed: everything posted is flushed.
    Error,
}

/// Limits of a queue pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    /// Outstanding send requests.
    pub max_send_wr: u32,
    /// Posted receives.
    pub max_recv_wr: u32,
}

impl Default for QpCaps {
    fn default() -> Self {
        Self {
            max_send_wr: 256,
            max_recv_wr: 256,
        }
    }
}

/// Why a fabric call failed (a failure of the call itself; failures of posted work
/// come back as completions).
#[derive(Debug, thiserror::Error)]
pub enum FabricError {
    /// No RDMA device to open.
    #[error("no RDMA device: {0}")]
    NoDevice(String),
    /// The OS or the transport.
    #[error("fabric I/O: {0}")]
    Io(#[from] std::io::Error),
    /// Connecting or accepting failed.
    #[error("cannot connect queue pair to {addr}: {detail}")]
    Connect { addr: SocketAddr, detail: String },
    /// The region or range cannot be registered.
    #[error("cannot register memory: {0}")]
    Register(String),
    /// The send or receive queue is full.
    #[error("queue pair {qp}: {which} queue full ({limit} outstanding)")]
    QueueFull {
        /// The queue pair.
        qp: u32,
        /// "send" or "receive".
        which: &'static str,
        limit: u32,
    },
    /// The queue pair is in the error state.
    #[error("queue pair {0} is in the error state")]
    QpError(u32),
    /// The device backend failed.
    #[error("{call} failed: {detail}")]
    Device {
        call: &'static str,
        /// What it said.
        detail: String,
    },
}

/// A registered memory region.
pub trait MemoryRegion: Send + Sync {
    fn lkey(&self) -> u32;
    fn rkey(&self) -> u32;
    /// Virtual address of its first byte.
    fn addr(&self) -> u64;
    fn len(&self) -> u64;

    /// Whether it is empty (never, once registered).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A local buffer `len` bytes at `offset` into the region.
    fn sge(&self, offset: u64, len: u32) -> Sge {
        Sge {
            addr: self.addr() + offset,
            len,
            lkey: self.lkey(),
        }
    }

    /// What a peer needs to reach `offset` into the region.
    fn remote(&self, offset: u64) -> RemoteAddr {
        RemoteAddr {
            addr: self.addr() + offset,
            rkey: self.rkey(),
        }
    }
}

pub use dpumesh_rings::bell::Interrupter;

/// A completion queue. Many queue pairs may share one; one thread polls it.
pub trait CompletionQueue: Send + Sync {
    /// A handle that makes [`CompletionQueue::wait`] return early. An interrupt
    /// that comes while nobody waits makes the next wait return at once.
    fn interrupter(&self) -> Interrupter;

    /// Appends up to `max` completions to `out`; returns how many. Never blocks.
    fn poll(&self, out: &mut Vec<WorkCompletion>, max: usize) -> usize;

    /// Blocks up to `timeout` until a completion is available; true if one is.
    fn wait(&self, timeout: Duration) -> Result<bool, FabricError>;

    /// For owners that sleep in their own event loop (an async runtime, a shard's
    /// epoll set): a descriptor that turns readable when [`CompletionQueue::poll`] may
    /// find completions. `None`: such owners must poll.
    fn wait_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        None
    }

    /// Before sleeping on [`CompletionQueue::wait_fd`]: announces the sleep (so peers
    /// wake it) and returns false if completions are already there — then do not
    /// sleep, and call [`CompletionQueue::finish_sleep`] all the same.
    fn prepare_sleep(&self) -> bool {
        true
    }

    /// After such a sleep (or the decision not to): withdraws the announcement and
    /// consumes the wake-up, so the descriptor is quiet until the next one.
    fn finish_sleep(&self) {}

    /// After a sleep that ended for another reason than [`CompletionQueue::wait_fd`]
    /// turning readable: withdraws the announcement only, and leaves any wake-up that
    /// came meanwhile for the `finish_sleep` after the sleep it ends. Only for owners
    /// whose wait on the descriptor is edge-triggered (an async reactor): a wake-up left
    /// unconsumed then still ends the next sleep once, where in a level-triggered set
    /// it would end every sleep at once. Saves the system calls of consuming when
    /// nothing came (the ingress wakes its fabric task for each request it posts).
    fn end_sleep(&self) {
        self.finish_sleep()
    }

    /// For the owner that posts a batch of work at a time on the queue pairs whose
    /// sends complete here: `true` holds what they post (and acknowledgements they
    /// owe) until [`CompletionQueue::flush_sends`], so a fabric whose doorbell is a
    /// system call rings it once per connection per batch; `false` sends as posted
    /// again (flushing what was held). Only the thread that owns the queue may hold:
    /// others' posts would wait for its flush. Fabrics that post without a system
    /// call ignore it.
    fn hold_sends(&self, _on: bool) {}

    /// Sends everything held (see [`CompletionQueue::hold_sends`]).
    fn flush_sends(&self) {}
}

/// A reliable-connected queue pair.
pub trait QueuePair: Send + Sync {
    fn qp_num(&self) -> u32;
    /// Posts a send work request.
    fn post_send(&self, wr: SendWr) -> Result<(), FabricError>;
    /// Posts a receive.
    fn post_recv(&self, wr: RecvWr) -> Result<(), FabricError>;
    fn state(&self) -> QpState;
    /// Who the peer proved to be when the connection was set up (mutual TLS);
    /// `None` when the fabric runs without certificates.
    fn peer_identity(&self) -> Option<&dpumesh_identity::SpiffeId> {
        None
    }
}

/// Accepts queue pairs.
pub trait QpListener: Send + Sync {
    /// The queue pair type.
    type Qp: QueuePair;
    /// The completion queue type.
    type Cq;
    /// Where it listens.
    fn local_addr(&self) -> SocketAddr;
    /// Waits up to `timeout` for a peer to connect; the queue pair completes on the
    /// listener's queue.
    fn accept(&self, timeout: Duration) -> Result<Option<Self::Qp>, FabricError>;
    /// As [`QpListener::accept`], but the queue pair completes on `cq`: one listener
    /// spreads its peers over several threads, each polling a queue of its own (a
    /// node's proxy shards).
    fn accept_on(&self, cq: &Self::Cq, timeout: Duration) -> Result<Option<Self::Qp>, FabricError>;
}

/// An RDMA device (or its software stand-in).
pub trait Fabric: Send + Sync + 'static {
    /// Protection domain.
    type Pd: Clone + Send + Sync;
    /// Memory region.
    type Mr: MemoryRegion;
    /// Completion queue.
    type Cq: CompletionQueue + Clone;
    /// Queue pair.
    type Qp: QueuePair;
    type Listener: QpListener<Qp = Self::Qp, Cq = Self::Cq>;

    /// The backend's name.
    fn name(&self) -> &'static str;
    /// A protection domain.
    fn alloc_pd(&self) -> Result<Self::Pd, FabricError>;
    /// Registers `len` bytes of `region` at `offset` in `pd`.
    fn register(
        &self,
        pd: &Self::Pd,
        region: &Arc<SharedRegion>,
        offset: u64,
        len: u64,
        access: Access,
    ) -> Result<Self::Mr, FabricError>;
    /// A completion queue of `depth` entries.
    fn create_cq(&self, depth: u32) -> Result<Self::Cq, FabricError>;
    /// Listens at `addr`; accepted queue pairs use `cq` for both queues.
    fn listen(
        &self,
        pd: &Self::Pd,
        addr: SocketAddr,
        cq: &Self::Cq,
        caps: QpCaps,
    ) -> Result<Self::Listener, FabricError>;
    /// Connects a queue pair to a listener at `addr`.
    fn connect(
        &self,
        pd: &Self::Pd,
        addr: SocketAddr,
        cq: &Self::Cq,
        caps: QpCaps,
    ) -> Result<Self::Qp, FabricError>;
}

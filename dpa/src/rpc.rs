//! RPC on the fabric, after the classic RDMA RPC design:
//!
//! ```text
//! client                                   server
//!   post recv (for the response's imm)       pre-posted recvs for metadata
//!   SEND meta (+ the request, if small) ──▶  recv completion
//!                                            small: request is in the meta
//!                                            large: RDMA_READ the request ◀── client memory
//!                                            handler runs (off the poller thread)
//!   recv completion (imm = context) ◀──────  RDMA_WRITE_WITH_IMM the response
//! ```
//!
//! Client contexts go Vacant → SendingMeta → WaitingForResponse → Vacant; a ring of
//! them per connection keeps many calls in flight. Server contexts go
//! WaitingForMeta → (ReadingRequest →) FilledWithRequest → FilledWithResponse →
//! WritingResponse → WaitingForMeta. One server poller thread drains the completion
//! queue of every connection; handlers run on a pool. Callers on the client take turns
//! polling (the one waiting polls and hands others their completions), so a lone
//! caller pays no thread hop.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TryRecvError};
use parking_lot::{Condvar, Mutex};

use crate::fabric::{
    Access, CompletionQueue, Fabric, FabricError, MemoryRegion, QpCaps, QpListener, QueuePair,
    RecvWr, RemoteAddr, SendOp, SendWr, WcOpcode, WcStatus, WorkCompletion,
};
use crate::shm::SharedRegion;

const META_MAGIC: u16 = 0x5250; // "RP"
const META_LEN: u64 = 48;
const KIND_INLINE: u8 = 1;
const KIND_REMOTE: u8 = 2;
/// Response header: status and length.
const RESP_HEADER: u64 = 8;
const STATUS_OK: u32 = 0;
const STATUS_HANDLER: u32 = 1;
const STATUS_TOO_LARGE: u32 = 2;
/// One signaled send in this many lets the send queue drain.
const SIGNAL_EVERY: u64 = 16;

/// Sizes and behaviour of an RPC endpoint.
#[derive(Debug, Clone, Copy)]
pub struct RpcConfig {
    /// Calls in flight per connection (the ring of contexts).
    pub slots: u32,
    pub max_request: u32,
    pub max_response: u32,
    /// Requests up to this size travel inside the SEND ("accelerate small rpc");
    /// larger ones are RDMA-READ by the server.
    pub inline: u32,
    /// Handler threads on the server.
    pub handlers: usize,
    /// How long a handler thread spins for the next job before sleeping.
    pub handler_spin: Duration,
    /// How long a call waits for its response.
    pub timeout: Duration,
}

impl Default for RpcConfig {
    fn default() -> Self {
        Self {
            slots: 16,
            max_request: 1 << 20,
            max_response: 1 << 20,
            inline: 64 << 10,
            handlers: 2,
            handler_spin: Duration::from_micros(50),
            timeout: Duration::from_secs(30),
        }
    }
}

impl RpcConfig {
    fn meta_cap(&self) -> u64 {
        META_LEN + self.inline as u64
    }

    fn resp_cap(&self) -> u64 {
        RESP_HEADER + self.max_response as u64
    }

    /// Per context on either side: [meta][request][response].
    fn stride(&self) -> u64 {
        (self.meta_cap() + self.max_request as u64 + self.resp_cap()).next_multiple_of(4096)
    }

    fn meta_at(&self, ctx: u32) -> u64 {
        ctx as u64 * self.stride()
    }

    fn request_at(&self, ctx: u32) -> u64 {
        self.meta_at(ctx) + self.meta_cap()
    }

    fn response_at(&self, ctx: u32) -> u64 {
        self.request_at(ctx) + self.max_request as u64
    }

    fn region_len(&self) -> u64 {
        self.slots as u64 * self.stride()
    }
}

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum RpcError {
    /// The fabric refused a call or failed.
    #[error(transparent)]
    Fabric(#[from] FabricError),
    /// Shared memory for buffers.
    #[error(transparent)]
    Shm(#[from] crate::shm::ShmError),
    /// Starting a thread.
    #[error("cannot start an RPC thread: {0}")]
    Thread(#[from] std::io::Error),
    /// A completion came back in error.
    #[error("RPC transport failed: {0:?}")]
    Completion(WcStatus),
    /// The request is larger than the connection takes.
    #[error("request of {len} bytes exceeds the {limit}-byte limit")]
    RequestTooLarge { len: usize, limit: u32 },
    /// The response did not fit the client's buffer.
    #[error("the server's response exceeds the client's {limit}-byte response buffer")]
    ResponseTooLarge { limit: u32 },
    /// The handler failed.
    #[error("the server's handler failed: {0}")]
    Handler(String),
    /// No response in time.
    #[error("no response within {0:?}")]
    Timeout(Duration),
    /// The connection is gone.
    #[error("the RPC connection is closed")]
    Closed,
}

#[derive(Debug, Clone, Copy, Default)]
struct Meta {
    kind: u8,
    ctx: u32,
    len: u32,
    req: RemoteAddr,
    resp: RemoteAddr,
    resp_cap: u32,
}

impl Meta {
    fn encode(&self) -> [u8; META_LEN as usize] {
        let mut b = [0u8; META_LEN as usize];
        b[0..2].copy_from_slice(&META_MAGIC.to_le_bytes());
        b[2] = self.kind;
        b[4..8].copy_from_slice(&self.ctx.to_le_bytes());
        b[8..12].copy_from_slice(&self.len.to_le_bytes());
        b[12..16].copy_from_slice(&self.req.rkey.to_le_bytes());
        b[16..24].copy_from_slice(&self.req.addr.to_le_bytes());
        b[24..32].copy_from_slice(&self.resp.addr.to_le_bytes());
        b[32..36].copy_from_slice(&self.resp.rkey.to_le_bytes());
        b[36..40].copy_from_slice(&self.resp_cap.to_le_bytes());
        b
    }

    fn decode(b: &[u8]) -> Option<Self> {
        if b.len() < META_LEN as usize || u16::from_le_bytes([b[0], b[1]]) != META_MAGIC {
            return None;
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(w)
        };
        Some(Self {
            kind: b[2],
            ctx: u32_at(4),
            len: u32_at(8),
            req: RemoteAddr {
                addr: u64_at(16),
                rkey: u32_at(12),
            },
            resp: RemoteAddr {
                addr: u64_at(24),
                rkey: u32_at(32),
            },
            resp_cap: u32_at(36),
        })
    }
}

// === client ===

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    Vacant,
    /// Meta sent, response awaited.
    Waiting,
    /// The response landed.
    Done,
    /// Failed with this status.
    Failed(WcStatus),
    /// Its caller gave up; the late response frees it.
    Abandoned,
}

struct ClientState {
    slots: Vec<Slot>,
    polling: bool,
    sends: u64,
    broken: Option<WcStatus>,
}

/// An RPC client: one connection with a ring of contexts. Share it between threads
/// to keep several calls in flight.
pub struct RpcClient<F: Fabric> {
    qp: F::Qp,
    cq: F::Cq,
    mr: F::Mr,
    region: Arc<SharedRegion>,
    config: RpcConfig,
    state: Mutex<ClientState>,
    changed: Condvar,
}

impl<F: Fabric> std::fmt::Debug for RpcClient<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RpcClient")
            .field("slots", &self.config.slots)
            .finish_non_exhaustive()
    }
}

impl<F: Fabric> RpcClient<F> {
    /// Connects to an [`RpcServer`] at `addr` (the server must use the same
    /// `slots`, `inline` and size limits).
    pub fn connect(fabric: &F, addr: SocketAddr, config: RpcConfig) -> Result<Self, RpcError> {
        let pd = fabric.alloc_pd()?;
        let cq = fabric.create_cq(config.slots * 4 + 64)?;
        let region = Arc::new(SharedRegion::create_unique(
            "dpumesh-rpc-client",
            config.region_len() as usize,
        )?);
        let mr = fabric.register(&pd, &region, 0, config.region_len(), Access::all())?;
        let caps = QpCaps {
            max_send_wr: config.slots * 2 + SIGNAL_EVERY as u32 * 2,
            max_recv_wr: config.slots * 2,
        };
        let qp = fabric.connect(&pd, addr, &cq, caps)?;
        // One receive per context, for the responses' immediate data.
        for i in 0..config.slots {
            qp.post_recv(RecvWr {
                wr_id: i as u64,
                sge: mr.sge(0, 0),
            })?;
        }
        Ok(Self {
            qp,
            cq,
            mr,
            region,
            state: Mutex::new(ClientState {
                slots: vec![Slot::Vacant; config.slots as usize],
                polling: false,
                sends: 0,
                broken: None,
            }),
            changed: Condvar::new(),
            config,
        })
    }

    /// Calls the server with `request` and waits for its response.
    pub fn call(&self, request: &[u8]) -> Result<Vec<u8>, RpcError> {
        if request.len() > self.config.max_request as usize {
            return Err(RpcError::RequestTooLarge {
                len: request.len(),
                limit: self.config.max_request,
            });
        }
        let deadline = Instant::now() + self.config.timeout;
        let ctx = self.take_slot(deadline)?;
        // The response is copied out while the context is still ours: once it is
        // vacant, another call may take it and the server may write its response into
        // the same buffer.
        let result = self
            .send(ctx, request)
            .and_then(|()| self.wait(ctx, deadline))
            .and_then(|(status, len)| {
                let body = self
                    .region
                    .read_vec(self.config.response_at(ctx) + RESP_HEADER, len as usize)?;
                Ok((status, body))
            });
        let mut state = self.state.lock();
        match &result {
            Err(RpcError::Timeout(_)) => state.slots[ctx as usize] = Slot::Abandoned,
            _ => state.slots[ctx as usize] = Slot::Vacant,
        }
        drop(state);
        self.changed.notify_all();
        let (status, body) = result?;
        match status {
            STATUS_OK => Ok(body),
            STATUS_TOO_LARGE => Err(RpcError::ResponseTooLarge {
                limit: self.config.max_response,
            }),
            _ => Err(RpcError::Handler(
                String::from_utf8_lossy(&body).into_owned(),
            )),
        }
    }

    fn take_slot(&self, deadline: Instant) -> Result<u32, RpcError> {
        let mut state = self.state.lock();
        loop {
            if let Some(status) = state.broken {
                return Err(RpcError::Completion(status));
            }
            if let Some(i) = state.slots.iter().position(|s| *s == Slot::Vacant) {
                state.slots[i] = Slot::Waiting;
                return Ok(i as u32);
            }
            if self.changed.wait_until(&mut state, deadline).timed_out() {
                return Err(RpcError::Timeout(self.config.timeout));
            }
        }
    }

    fn send(&self, ctx: u32, request: &[u8]) -> Result<(), RpcError> {
        let c = &self.config;
        let mut meta = Meta {
            kind: KIND_INLINE,
            ctx,
            len: request.len() as u32,
            req: self.mr.remote(c.request_at(ctx)),
            resp: self.mr.remote(c.response_at(ctx)),
            resp_cap: c.max_response,
        };
        let meta_at = c.meta_at(ctx);
        let sge_len = if request.len() <= c.inline as usize {
            self.region.write(meta_at + META_LEN, request)?;
            META_LEN as u32 + request.len() as u32
        } else {
            meta.kind = KIND_REMOTE;
            self.region.write(c.request_at(ctx), request)?;
            META_LEN as u32
        };
        self.region.write(meta_at, &meta.encode())?;
        let signaled = {
            let mut state = self.state.lock();
            state.sends += 1;
            state.sends.is_multiple_of(SIGNAL_EVERY)
        };
        self.qp.post_send(SendWr {
            wr_id: u64::MAX,
            op: SendOp::Send,
            sge: self.mr.sge(meta_at, sge_len),
            signaled,
        })?;
        Ok(())
    }

    /// Waits for context `ctx`'s response; whoever waits takes turns polling.
    fn wait(&self, ctx: u32, deadline: Instant) -> Result<(u32, u32), RpcError> {
        let mut completions = Vec::new();
        loop {
            {
                let mut state = self.state.lock();
                loop {
                    match state.slots[ctx as usize] {
                        Slot::Done => {
                            drop(state);
                            let mut header = [0u8; RESP_HEADER as usize];
                            self.region
                                .read(self.config.response_at(ctx), &mut header)?;
                            let status =
                                u32::from_le_bytes([header[0], header[1], header[2], header[3]]);
                            let len =
                                u32::from_le_bytes([header[4], header[5], header[6], header[7]]);
                            return Ok((status, len.min(self.config.max_response)));
                        }
                        Slot::Failed(status) => return Err(RpcError::Completion(status)),
                        _ => {}
                    }
                    if Instant::now() >= deadline {
                        return Err(RpcError::Timeout(self.config.timeout));
                    }
                    if !state.polling {
                        state.polling = true;
                        break;
                    }
                    self.changed.wait_until(&mut state, deadline);
                }
            }
            // This caller polls for everyone until something changes.
            let left = deadline.saturating_duration_since(Instant::now());
            let waited = self.cq.wait(left.min(Duration::from_millis(50)));
            completions.clear();
            self.cq.poll(&mut completions, 64);
            let mut state = self.state.lock();
            state.polling = false;
            if let Err(e) = waited {
                state.broken = Some(WcStatus::General);
                drop(state);
                self.changed.notify_all();
                return Err(e.into());
            }
            self.dispatch(&mut state, &completions);
            drop(state);
            self.changed.notify_all();
        }
    }

    fn dispatch(&self, state: &mut ClientState, completions: &[WorkCompletion]) {
        for wc in completions {
            if wc.status != WcStatus::Success {
                // The connection is broken: every waiting call fails.
                state.broken = Some(wc.status);
                for s in state.slots.iter_mut() {
                    if *s == Slot::Waiting {
                        *s = Slot::Failed(wc.status);
                    }
                }
                continue;
            }
            if wc.opcode == WcOpcode::RecvRdmaWithImm {
                let _ = self.qp.post_recv(RecvWr {
                    wr_id: wc.wr_id,
                    sge: self.mr.sge(0, 0),
                });
                if let Some(ctx) = wc.imm
                    && let Some(slot) = state.slots.get_mut(ctx as usize)
                {
                    *slot = match *slot {
                        Slot::Abandoned => Slot::Vacant,
                        _ => Slot::Done,
                    };
                }
            }
        }
    }
}

// === server ===

/// What a handler gets and returns: request bytes in, response bytes (or a message
/// for the caller) out.
pub type Handler = dyn Fn(&[u8]) -> Result<Vec<u8>, String> + Send + Sync;

struct Conn<F: Fabric> {
    qp: F::Qp,
    mr: F::Mr,
    region: Arc<SharedRegion>,
    sends: AtomicU64,
}

struct Job {
    conn: u32,
    meta: Meta,
    request: Vec<u8>,
}

/// A running RPC server: an accept thread, one poller for every connection, and a
/// pool of handler threads. Dropping it stops them.
pub struct RpcServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    stats: Arc<ServerStats>,
}

/// Server counters.
#[derive(Debug, Default)]
pub struct ServerStats {
    /// Responses posted.
    pub calls: AtomicU64,
    /// Requests that arrived inline.
    pub inline: AtomicU64,
    /// Requests fetched with RDMA_READ.
    pub read: AtomicU64,
    /// Connections accepted.
    pub connections: AtomicU64,
}

impl std::fmt::Debug for RpcServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RpcServer")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl RpcServer {
    /// Listens at `addr` and serves calls with `handler`.
    pub fn start<F: Fabric>(
        fabric: F,
        addr: SocketAddr,
        config: RpcConfig,
        handler: Arc<Handler>,
    ) -> Result<Self, RpcError> {
        let pd = fabric.alloc_pd()?;
        let cq = fabric.create_cq(4096)?;
        let caps = QpCaps {
            max_send_wr: config.slots * 2 + SIGNAL_EVERY as u32 * 2,
            max_recv_wr: config.slots * 2,
        };
        let listener = fabric.listen(&pd, addr, &cq, caps)?;
        let addr = listener.local_addr();
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(ServerStats::default());
        let conns: Arc<Mutex<HashMap<u32, Arc<Conn<F>>>>> = Arc::default();
        let (jobs_tx, jobs_rx) = crossbeam_channel::unbounded::<Job>();
        let mut threads = Vec::new();

        // Accept: set up each connection's buffers and receives, hand it to the poller.
        {
            let stop = stop.clone();
            let conns = conns.clone();
            let stats = stats.clone();
            threads.push(
                std::thread::Builder::new()
                    .name("dpumesh-rpc-accept".into())
                    .spawn(move || {
                        let mut next = 0u32;
                        while !stop.load(Ordering::Relaxed) {
                            let qp = match listener.accept(Duration::from_millis(50)) {
                                Ok(Some(qp)) => qp,
                                Ok(None) => continue,
                                Err(e) => {
                                    tracing::warn!(error = %e, "RPC accept failed");
                                    continue;
                                }
                            };
                            // The poller must know the connection before its first
                            // receive is posted: a request arriving in between would
                            // complete on a queue pair it cannot place, and be lost.
                            let conn = match setup::<F>(&fabric, &pd, qp, &config) {
                                Ok(conn) => Arc::new(conn),
                                Err(e) => {
                                    tracing::warn!(error = %e, "RPC connection setup failed");
                                    continue;
                                }
                            };
                            conns.lock().insert(next, conn.clone());
                            match post_receives(&conn, &config) {
                                Ok(()) => {
                                    stats.connections.fetch_add(1, Ordering::Relaxed);
                                    next += 1;
                                }
                                Err(e) => {
                                    conns.lock().remove(&next);
                                    tracing::warn!(error = %e, "RPC connection setup failed");
                                }
                            }
                        }
                    })?,
            );
        }
        // The poller: metadata arrives, small requests go straight to a handler, large
        // ones are read first.
        {
            let stop = stop.clone();
            let conns = conns.clone();
            let stats = stats.clone();
            threads.push(
                std::thread::Builder::new()
                    .name("dpumesh-rpc-poll".into())
                    .spawn(move || {
                        poller::<F>(cq, conns, jobs_tx, config, stop, stats);
                    })?,
            );
        }
        for i in 0..config.handlers.max(1) {
            let jobs = jobs_rx.clone();
            let conns = conns.clone();
            let handler = handler.clone();
            let stop = stop.clone();
            let stats = stats.clone();
            threads.push(
                std::thread::Builder::new()
                    .name(format!("dpumesh-rpc-handler-{i}"))
                    .spawn(move || {
                        handle::<F>(jobs, conns, handler, config, stop, stats);
                    })?,
            );
        }
        Ok(Self {
            addr,
            stop,
            threads,
            stats,
        })
    }

    /// Where it listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Counters.
    pub fn stats(&self) -> &ServerStats {
        &self.stats
    }
}

impl Drop for RpcServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn setup<F: Fabric>(
    fabric: &F,
    pd: &F::Pd,
    qp: F::Qp,
    config: &RpcConfig,
) -> Result<Conn<F>, RpcError> {
    let region = Arc::new(SharedRegion::create_unique(
        "dpumesh-rpc-server",
        config.region_len() as usize,
    )?);
    let mr = fabric.register(pd, &region, 0, config.region_len(), Access::all())?;
    Ok(Conn {
        qp,
        mr,
        region,
        sends: AtomicU64::new(0),
    })
}

/// One receive per context, for the requests' metadata.
fn post_receives<F: Fabric>(conn: &Conn<F>, config: &RpcConfig) -> Result<(), RpcError> {
    for i in 0..config.slots {
        conn.qp.post_recv(RecvWr {
            wr_id: i as u64,
            sge: conn.mr.sge(config.meta_at(i), config.meta_cap() as u32),
        })?;
    }
    Ok(())
}

/// Read work requests carry the connection and context: `conn << 32 | ctx`.
fn read_id(conn: u32, ctx: u32) -> u64 {
    (conn as u64) << 32 | ctx as u64 | 1 << 63
}

fn poller<F: Fabric>(
    cq: F::Cq,
    conns: Arc<Mutex<HashMap<u32, Arc<Conn<F>>>>>,
    jobs: Sender<Job>,
    config: RpcConfig,
    stop: Arc<AtomicBool>,
    stats: Arc<ServerStats>,
) {
    let mut completions = Vec::new();
    // Requests being read, by read id: their metadata.
    let mut reading: HashMap<u64, Meta> = HashMap::new();
    let mut by_qp: HashMap<u32, u32> = HashMap::new();
    while !stop.load(Ordering::Relaxed) {
        if cq.wait(Duration::from_millis(50)).is_err() {
            continue;
        }
        completions.clear();
        cq.poll(&mut completions, 256);
        for wc in &completions {
            let conn_id = match by_qp.get(&wc.qp_num) {
                Some(&c) => c,
                None => {
                    let found = conns
                        .lock()
                        .iter()
                        .find(|(_, c)| c.qp.qp_num() == wc.qp_num)
                        .map(|(&id, _)| id);
                    match found {
                        Some(id) => {
                            by_qp.insert(wc.qp_num, id);
                            id
                        }
                        None => continue,
                    }
                }
            };
            let Some(conn) = conns.lock().get(&conn_id).cloned() else {
                continue;
            };
            if wc.status != WcStatus::Success {
                // The client went away or broke the protocol: drop the connection.
                if wc.status != WcStatus::WrFlush {
                    tracing::debug!(conn = conn_id, status = ?wc.status, "RPC connection failed");
                }
                conns.lock().remove(&conn_id);
                by_qp.remove(&wc.qp_num);
                continue;
            }
            match wc.opcode {
                WcOpcode::Recv => {
                    let slot = wc.wr_id as u32;
                    let at = config.meta_at(slot);
                    let Ok(bytes) = conn
                        .region
                        .read_vec(at, wc.byte_len.min(config.meta_cap() as u32) as usize)
                    else {
                        continue;
                    };
                    // The receive is free again as soon as its bytes are copied out.
                    let _ = conn.qp.post_recv(RecvWr {
                        wr_id: wc.wr_id,
                        sge: conn.mr.sge(at, config.meta_cap() as u32),
                    });
                    let Some(meta) = Meta::decode(&bytes) else {
                        tracing::warn!(
                            conn = conn_id,
                            "malformed RPC metadata; dropping the connection"
                        );
                        conns.lock().remove(&conn_id);
                        continue;
                    };
                    if meta.ctx >= config.slots || meta.len > config.max_request {
                        tracing::warn!(
                            conn = conn_id,
                            ctx = meta.ctx,
                            len = meta.len,
                            "RPC metadata out of range; dropping the connection"
                        );
                        conns.lock().remove(&conn_id);
                        continue;
                    }
                    if meta.kind == KIND_INLINE {
                        let end = (META_LEN as usize + meta.len as usize).min(bytes.len());
                        stats.inline.fetch_add(1, Ordering::Relaxed);
                        let mut request = bytes;
                        request.truncate(end);
                        request.drain(..META_LEN as usize);
                        let _ = jobs.send(Job {
                            conn: conn_id,
                            meta,
                            request,
                        });
                    } else {
                        // ReadingRequest: fetch it into this context's request buffer.
                        let id = read_id(conn_id, meta.ctx);
                        reading.insert(id, meta);
                        let posted = conn.qp.post_send(SendWr {
                            wr_id: id,
                            op: SendOp::Read(meta.req),
                            sge: conn.mr.sge(config.request_at(meta.ctx), meta.len),
                            signaled: true,
                        });
                        if posted.is_err() {
                            reading.remove(&id);
                        }
                    }
                }
                WcOpcode::RdmaRead => {
                    let Some(meta) = reading.remove(&wc.wr_id) else {
                        continue;
                    };
                    let Ok(request) = conn
                        .region
                        .read_vec(config.request_at(meta.ctx), meta.len as usize)
                    else {
                        continue;
                    };
                    stats.read.fetch_add(1, Ordering::Relaxed);
                    let _ = jobs.send(Job {
                        conn: conn_id,
                        meta,
                        request,
                    });
                }
                _ => {}
            }
        }
    }
}

fn handle<F: Fabric>(
    jobs: Receiver<Job>,
    conns: Arc<Mutex<HashMap<u32, Arc<Conn<F>>>>>,
    handler: Arc<Handler>,
    config: RpcConfig,
    stop: Arc<AtomicBool>,
    stats: Arc<ServerStats>,
) {
    while !stop.load(Ordering::Relaxed) {
        // Spin briefly: back-to-back calls then never pay a sleep and a wake-up.
        let started = Instant::now();
        let job = loop {
            match jobs.try_recv() {
                Ok(job) => break Some(job),
                Err(TryRecvError::Disconnected) => return,
                Err(TryRecvError::Empty) if started.elapsed() < config.handler_spin => {
                    std::hint::spin_loop()
                }
                Err(TryRecvError::Empty) => {
                    break jobs.recv_timeout(Duration::from_millis(50)).ok();
                }
            }
        };
        let Some(job) = job else { continue };
        let Some(conn) = conns.lock().get(&job.conn).cloned() else {
            continue;
        };
        let (status, body) = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            handler(&job.request)
        })) {
            Ok(Ok(body))
                if body.len() <= job.meta.resp_cap as usize
                    && body.len() <= config.max_response as usize =>
            {
                (STATUS_OK, body)
            }
            Ok(Ok(_)) => (STATUS_TOO_LARGE, Vec::new()),
            Ok(Err(message)) => (STATUS_HANDLER, message.into_bytes()),
            Err(_) => (STATUS_HANDLER, b"the handler panicked".to_vec()),
        };
        let body = if status == STATUS_HANDLER {
            body[..body.len().min(job.meta.resp_cap as usize)].to_vec()
        } else {
            body
        };
        let at = config.response_at(job.meta.ctx);
        let mut header = [0u8; RESP_HEADER as usize];
        header[0..4].copy_from_slice(&status.to_le_bytes());
        header[4..8].copy_from_slice(&(body.len() as u32).to_le_bytes());
        if conn.region.write(at, &header).is_err()
            || conn.region.write(at + RESP_HEADER, &body).is_err()
        {
            continue;
        }
        // FilledWithResponse → WritingResponse: header and body in one write, the
        // context in the immediate data.
        let n = conn.sends.fetch_add(1, Ordering::Relaxed) + 1;
        // Counted before posting: the caller may see the response before this thread
        // runs again.
        stats.calls.fetch_add(1, Ordering::Relaxed);
        let written = conn.qp.post_send(SendWr {
            wr_id: u64::MAX,
            op: SendOp::WriteWithImm(job.meta.resp, job.meta.ctx),
            sge: conn.mr.sge(at, (RESP_HEADER as usize + body.len()) as u32),
            signaled: n.is_multiple_of(SIGNAL_EVERY),
        });
        if written.is_err() {
            stats.calls.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fabric::soft::SoftFabric;

    fn echo_server(config: RpcConfig) -> RpcServer {
        RpcServer::start(
            SoftFabric::new(),
            "127.0.0.1:0".parse().unwrap(),
            config,
            Arc::new(|req: &[u8]| {
                if req == b"fail" {
                    return Err("asked to fail".to_owned());
                }
                if req == b"panic" {
                    panic!("handler panic");
                }
                let mut out = req.to_vec();
                out.reverse();
                Ok(out)
            }),
        )
        .unwrap()
    }

    #[test]
    fn small_and_large_calls_round_trip() {
        let config = RpcConfig {
            max_request: 4 << 20,
            max_response: 4 << 20,
            ..RpcConfig::default()
        };
        let server = echo_server(config);
        let client = RpcClient::connect(&SoftFabric::new(), server.local_addr(), config).unwrap();
        for len in [0usize, 1, 100, 4096, 65536, 65537, (3 << 20) + 7] {
            let req: Vec<u8> = (0..len).map(|i| (i * 7 + len) as u8).collect();
            let mut want = req.clone();
            want.reverse();
            let got = client.call(&req).unwrap();
            assert_eq!(crc32fast::hash(&got), crc32fast::hash(&want), "len {len}");
            assert_eq!(got.len(), len);
        }
        // 5 inline (up to 64 KiB), 2 read.
        assert_eq!(server.stats().inline.load(Ordering::Relaxed), 5);
        assert_eq!(server.stats().read.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn handler_errors_and_panics_reach_the_caller_and_the_server_lives_on() {
        let server = echo_server(RpcConfig::default());
        let client = RpcClient::connect(
            &SoftFabric::new(),
            server.local_addr(),
            RpcConfig::default(),
        )
        .unwrap();
        let err = client.call(b"fail").unwrap_err().to_string();
        assert!(err.contains("asked to fail"), "{err}");
        let err = client.call(b"panic").unwrap_err().to_string();
        assert!(err.contains("panicked"), "{err}");
        assert_eq!(client.call(b"abc").unwrap(), b"cba");
        let big = vec![0u8; (1 << 20) + 1];
        assert!(matches!(
            client.call(&big),
            Err(RpcError::RequestTooLarge { .. })
        ));
    }

    #[test]
    fn many_threads_keep_many_calls_in_flight_on_one_connection_and_many_connections_share_a_poller()
     {
        let config = RpcConfig {
            max_request: 2 << 20,
            max_response: 2 << 20,
            ..RpcConfig::default()
        };
        let server = echo_server(config);
        let clients: Vec<_> = (0..3)
            .map(|_| {
                Arc::new(
                    RpcClient::connect(&SoftFabric::new(), server.local_addr(), config).unwrap(),
                )
            })
            .collect();
        let threads: Vec<_> = (0..12)
            .map(|t| {
                let client = clients[t % 3].clone();
                std::thread::spawn(move || {
                    for i in 0..60usize {
                        // Every tenth call carries more than a megabyte.
                        let len = if i % 10 == 0 {
                            (1 << 20) + t * 1000 + i
                        } else {
                            16 + i
                        };
                        let req: Vec<u8> = (0..len).map(|k| (k ^ t ^ i) as u8).collect();
                        let got = client.call(&req).unwrap();
                        assert_eq!(got.len(), len);
                        assert!(got.iter().rev().eq(req.iter()), "thread {t} call {i}");
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(server.stats().calls.load(Ordering::Relaxed), 12 * 60);
        assert_eq!(server.stats().connections.load(Ordering::Relaxed), 3);
    }

    #[test]
    fn a_server_that_goes_away_fails_calls_instead_of_hanging() {
        let config = RpcConfig {
            timeout: Duration::from_secs(5),
            ..RpcConfig::default()
        };
        let server = echo_server(config);
        let client = RpcClient::connect(&SoftFabric::new(), server.local_addr(), config).unwrap();
        assert_eq!(client.call(b"x").unwrap(), b"x");
        drop(server);
        let started = Instant::now();
        let err = client.call(b"y").unwrap_err();
        assert!(
            !matches!(err, RpcError::Timeout(_)),
            "failed fast, not by timing out: {err}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
    }
}

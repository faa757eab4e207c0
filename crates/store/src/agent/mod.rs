//! The DPU agent: one DMA context and progress loop, a staging buffer registered once,
//! a slot pool sized by `queue_depth`, a storage backend, the catalog (capacity and
//! LRU eviction), and the handling of the control protocol's requests.
//!
//! Metadata requests (register, info, delete, list) are answered at once; batches of
//! PUSH and PULL go to `io_threads` transfer workers and are answered when done, so
//! the connection that carried them keeps being read: a client that goes away
//! ([`Agent::disconnected`]) cancels its transfers at their next chunk (their slots
//! come back, their partial objects are removed).

mod hot;
mod progress;
mod slots;
mod transfer;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::thread::JoinHandle;

use crossbeam_channel::Sender;
use dpumesh_dpa::SharedRegion;
use dpumesh_dpa::dma::DmaEngine;
use parking_lot::Mutex;

use crate::backend::{Backend, StorageError};
use crate::catalog::Catalog;
use crate::namespace::Namespace;
use crate::protocol::{
    self, MAX_SEGMENTS, Message, ObjectInfo, ProtocolError, Request, Response, Segment,
    SegmentResult, Status,
};
use progress::Progress;
use slots::Slots;

/// How the agent runs.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Bytes the store may hold; past it the least recently used objects go.
    pub capacity: u64,
    /// Staging slots (chunks in flight across all transfers).
    pub queue_depth: usize,
    /// Bytes per slot (one DMA per chunk of this size).
    pub slot_size: usize,
    /// Transfer workers (batches served at once).
    pub io_threads: usize,
    /// Overlap storage I/O with DMA (off: each chunk waits for the one before).
    pub pipelined: bool,
    /// Check each pulled object's CRC against the one stored with it.
    pub verify_reads: bool,
    /// DPU memory for small objects the node reads itself (each ≤ 64 KiB), in front
    /// of storage.
    pub memory: u64,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            capacity: 1 << 30,
            queue_depth: 16,
            // Measured: 256 KiB slots pull 8 MiB objects 1.6× faster than 1 MiB
            // slots (the chunk in flight stays in cache between read and DMA).
            slot_size: 256 << 10,
            io_threads: 2,
            pipelined: true,
            verify_reads: true,
            memory: 64 << 20,
        }
    }
}

/// Why the agent could not start.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("BlueCache agent: {0}")]
    Storage(#[from] StorageError),
    #[error("BlueCache agent: the staging buffer: {0}")]
    Staging(#[from] dpumesh_dpa::ShmError),
    #[error("BlueCache agent: {0}")]
    Config(String),
    #[error("BlueCache agent: cannot start a thread: {0}")]
    Thread(#[from] std::io::Error),
}

/// Where an answer goes (the connection that asked).
pub type Reply = Box<dyn FnOnce(Vec<u8>) + Send>;

/// Counters.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pushed: AtomicU64,
    pulled: AtomicU64,
    evictions: AtomicU64,
    cancelled: AtomicU64,
}

/// What the agent holds and did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentStats {
    pub objects: usize,
    pub bytes: u64,
    pub capacity: u64,
    pub slots: usize,
    pub free_slots: usize,
    pub pushed_bytes: u64,
    pub pulled_bytes: u64,
    pub evictions: u64,
    pub cancelled: u64,
    /// Bytes of small objects held in memory in front of storage.
    pub memory_bytes: u64,
    pub backend: &'static str,
    pub engine: &'static str,
}

/// A client's buffers and whether it went away.
#[derive(Default)]
pub(crate) struct PeerState {
    buffers: Mutex<HashMap<u32, Arc<SharedRegion>>>,
    cancelled: AtomicBool,
}

pub(crate) struct Inner {
    backend: Box<dyn Backend>,
    catalog: Mutex<Catalog>,
    staging: Arc<SharedRegion>,
    slots: Slots,
    progress: Progress,
    /// Chunks in flight per transfer.
    window: usize,
    verify_reads: bool,
    hot: hot::Hot,
    peers: Mutex<HashMap<u64, Arc<PeerState>>>,
    next_buffer: AtomicU32,
    stats: Counters,
}

struct Job {
    peer: Arc<PeerState>,
    id: u32,
    push: bool,
    segments: Vec<Segment>,
    reply: Reply,
}

/// What the transfer workers do.
enum Work {
    /// A client's batch.
    Batch(Job),
    /// Bytes the node itself stores (the HTTP cache's bodies).
    Local {
        key: String,
        bytes: Vec<u8>,
        done: LocalDone,
    },
}

/// Told how a local put went.
pub type LocalDone = Box<dyn FnOnce(Result<crate::ObjectMeta, PutError>) + Send>;

/// Why the node's own put failed.
#[derive(Debug, thiserror::Error)]
pub enum PutError {
    #[error("bad key: {0}")]
    BadKey(String),
    #[error(transparent)]
    TooLarge(#[from] crate::catalog::TooLarge),
    #[error(transparent)]
    Storage(#[from] StorageError),
    /// The commit was refused (its status and why).
    #[error("{status:?}: {message}")]
    Refused { status: Status, message: String },
    #[error("the agent is stopping")]
    Stopping,
}

/// The running agent.
pub struct Agent {
    inner: Arc<Inner>,
    jobs: Option<Sender<Work>>,
    workers: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("stats", &self.stats())
            .finish()
    }
}

impl Agent {
    /// Recovers the store's objects from `backend` and starts the progress loop and
    /// the transfer workers.
    pub fn start(
        config: AgentConfig,
        backend: Box<dyn Backend>,
        engine: Box<dyn DmaEngine>,
    ) -> Result<Self, AgentError> {
        if config.queue_depth == 0 || config.slot_size == 0 || config.io_threads == 0 {
            return Err(AgentError::Config(
                "queue_depth, slot_size and io_threads must be at least 1".into(),
            ));
        }
        let mut catalog = Catalog::new(config.capacity);
        for meta in backend.recover()? {
            let key = meta.key.clone();
            match catalog.admit(meta) {
                Ok(evicted) => {
                    for k in evicted {
                        backend.remove(&k)?;
                    }
                }
                Err(_) => backend.remove(&key)?,
            }
        }
        tracing::info!(
            objects = catalog.len(),
            bytes = catalog.bytes(),
            backend = backend.name(),
            "BlueCache store recovered"
        );
        let staging_len = config
            .queue_depth
            .checked_mul(config.slot_size)
            .ok_or_else(|| AgentError::Config("queue_depth × slot_size overflows".into()))?;
        // Registered once, for the agent's life (with DOCA: one mmap, one export).
        let staging = Arc::new(SharedRegion::create_unique(
            "dpumesh-bluecache",
            staging_len,
        )?);
        let window = if config.pipelined {
            (config.queue_depth / config.io_threads).max(2)
        } else {
            1
        };
        let inner = Arc::new(Inner {
            backend,
            catalog: Mutex::new(catalog),
            staging,
            slots: Slots::new(config.queue_depth, config.slot_size),
            progress: Progress::start(engine)?,
            window,
            verify_reads: config.verify_reads,
            hot: hot::Hot::new(config.memory),
            peers: Mutex::new(HashMap::new()),
            next_buffer: AtomicU32::new(1),
            stats: Counters::default(),
        });
        let (tx, rx) = crossbeam_channel::unbounded::<Work>();
        let mut workers = Vec::new();
        for i in 0..config.io_threads {
            let (inner, rx) = (inner.clone(), rx.clone());
            workers.push(
                std::thread::Builder::new()
                    .name(format!("bluecache-io-{i}"))
                    .spawn(move || {
                        while let Ok(work) = rx.recv() {
                            match work {
                                Work::Batch(job) => run_job(&inner, job),
                                Work::Local { key, bytes, done } => {
                                    done(transfer::put_local(&inner, &key, bytes));
                                }
                            }
                        }
                    })?,
            );
        }
        Ok(Self {
            inner,
            jobs: Some(tx),
            workers,
        })
    }

    /// Handles one message from client `peer`, which acts in `namespace` (its keys
    /// are that namespace's: see [`crate::namespace`]), with the descriptors that came
    /// with it (a buffer's memory to register); `reply` gets the answer (at once, or
    /// when its transfers are done).
    pub fn handle(
        &self,
        peer: u64,
        namespace: &Namespace,
        bytes: &[u8],
        fds: Vec<std::os::fd::OwnedFd>,
        reply: Reply,
    ) {
        let id = protocol::peek_id(bytes).unwrap_or(0);
        let answer = |response: Response| protocol::encode(&Message::Response(id, response));
        let (id, request) = match protocol::decode(bytes) {
            Ok(Message::Request(id, request)) => (id, request),
            Ok(Message::Response(..)) => {
                return reply(answer(error(
                    Status::BadRequest,
                    "a response sent to the agent",
                )));
            }
            Err(ProtocolError::Version { theirs, .. }) => {
                tracing::warn!(theirs, "a BlueCache client of another protocol version");
                return reply(protocol::encode_version_mismatch(id, theirs));
            }
            Err(e) => return reply(answer(error(Status::BadRequest, e.to_string()))),
        };
        let request = namespace.request(request);
        let state = self.peer(peer);
        let response = match request {
            Request::PushBatch { segments } | Request::PullBatch { segments }
                if segments.len() > MAX_SEGMENTS =>
            {
                error(
                    Status::BadRequest,
                    format!(
                        "a batch of {} segments (at most {MAX_SEGMENTS})",
                        segments.len()
                    ),
                )
            }
            Request::PushBatch { segments } => return self.queue(state, id, true, segments, reply),
            Request::PullBatch { segments } => {
                return self.queue(state, id, false, segments, reply);
            }
            Request::Register { len, .. } => self.register(&state, fds, len),
            Request::Deregister { buffer } => match state.buffers.lock().remove(&buffer) {
                Some(_) => Response::Ok,
                None => error(Status::BadBuffer, format!("no buffer {buffer}")),
            },
            Request::PullInfo { keys } => Response::Info {
                objects: keys.iter().map(|k| self.info(k)).collect(),
            },
            Request::Delete { keys } => Response::Batch {
                results: keys.iter().map(|k| self.delete(k)).collect(),
            },
            Request::List {
                prefix,
                after,
                limit,
            } => {
                let limit = (limit as usize).clamp(1, 256);
                let (objects, more) =
                    self.inner
                        .catalog
                        .lock()
                        .list(&prefix, after.as_deref(), limit);
                Response::Listed {
                    objects: objects.into_iter().map(info).collect(),
                    more,
                }
            }
        };
        let response = namespace.response(response);
        reply(protocol::encode(&Message::Response(id, response)));
    }

    /// Client `peer` went away: its transfers stop at their next chunk and its
    /// buffers are forgotten.
    pub fn disconnected(&self, peer: u64) {
        if let Some(state) = self.inner.peers.lock().remove(&peer) {
            state.cancelled.store(true, Ordering::Release);
            state.buffers.lock().clear();
        }
    }

    /// Removes the object `key`; how many went (0 or 1).
    pub fn purge_key(&self, key: &str) -> usize {
        let mut catalog = self.inner.catalog.lock();
        if !catalog.remove(key) {
            return 0;
        }
        self.inner.hot.remove(key);
        let _ = self.inner.backend.remove(key);
        1
    }

    /// Removes every object whose key starts with `prefix`; how many.
    pub fn purge_prefix(&self, prefix: &str) -> usize {
        let mut catalog = self.inner.catalog.lock();
        let keys = catalog.keys_with_prefix(prefix);
        for key in &keys {
            catalog.remove(key);
            self.inner.hot.remove(key);
            let _ = self.inner.backend.remove(key);
        }
        keys.len()
    }

    pub fn stats(&self) -> AgentStats {
        let catalog = self.inner.catalog.lock();
        let s = &self.inner.stats;
        AgentStats {
            objects: catalog.len(),
            bytes: catalog.bytes(),
            capacity: catalog.capacity(),
            slots: self.inner.slots.count,
            free_slots: self.inner.slots.free(),
            pushed_bytes: s.pushed.load(Ordering::Relaxed),
            pulled_bytes: s.pulled.load(Ordering::Relaxed),
            evictions: s.evictions.load(Ordering::Relaxed),
            cancelled: s.cancelled.load(Ordering::Relaxed),
            memory_bytes: self.inner.hot.bytes(),
            backend: self.inner.backend.name(),
            engine: self.inner.progress.engine(),
        }
    }

    fn peer(&self, peer: u64) -> Arc<PeerState> {
        self.inner.peers.lock().entry(peer).or_default().clone()
    }

    fn queue(
        &self,
        peer: Arc<PeerState>,
        id: u32,
        push: bool,
        segments: Vec<Segment>,
        reply: Reply,
    ) {
        let job = Job {
            peer,
            id,
            push,
            segments,
            reply,
        };
        if let Some(jobs) = &self.jobs
            && let Err(e) = jobs.send(Work::Batch(job))
            && let Work::Batch(job) = e.0
        {
            (job.reply)(protocol::encode(&Message::Response(
                id,
                error(Status::Cancelled, "the agent is stopping"),
            )));
        }
    }

    /// Stores `bytes` the node holds itself as `key`, on a transfer worker (storage
    /// I/O never runs on the caller's thread); `done` is told how it went.
    pub fn put_bytes(&self, key: String, bytes: Vec<u8>, done: LocalDone) {
        let work = Work::Local { key, bytes, done };
        if let Some(jobs) = &self.jobs
            && let Err(e) = jobs.send(work)
            && let Work::Local { done, .. } = e.0
        {
            done(Err(PutError::Stopping));
        }
    }

    /// Reads object `key` whole (checked against its CRC when `verify_reads`);
    /// `Ok(None)` when there is none. Storage I/O on the caller's thread: for small
    /// objects (the HTTP cache's bodies, mostly in the page cache).
    pub fn get_bytes(&self, key: &str) -> Result<Option<Vec<u8>>, StorageError> {
        transfer::get_local(&self.inner, key)
    }

    /// Registers the client's buffer from the one descriptor that came with the
    /// message: its own memory, never a file the agent would open by a name (which
    /// could name another's region, or a symlink). It must be sealed against
    /// shrinking, so the client cannot truncate it under a transfer (SIGBUS).
    fn register(&self, state: &PeerState, fds: Vec<std::os::fd::OwnedFd>, len: u64) -> Response {
        let mut fds = fds.into_iter();
        let (Some(fd), None) = (fds.next(), fds.next()) else {
            return error(
                Status::BadBuffer,
                "a buffer is registered with exactly one descriptor of its memory (the node's Unix control socket)",
            );
        };
        match SharedRegion::from_fd(fd, "store buffer") {
            Ok(region) if region.len() as u64 == len => {
                let buffer = self.inner.next_buffer.fetch_add(1, Ordering::Relaxed);
                state.buffers.lock().insert(buffer, Arc::new(region));
                Response::Registered { buffer }
            }
            Ok(region) => error(
                Status::BadBuffer,
                format!(
                    "the buffer's memory holds {} bytes, not the {len} the client said",
                    region.len()
                ),
            ),
            Err(e) => error(Status::BadBuffer, e.to_string()),
        }
    }

    fn info(&self, key: &str) -> Option<ObjectInfo> {
        self.inner.catalog.lock().get(key).cloned().map(info)
    }

    fn delete(&self, key: &str) -> SegmentResult {
        let mut catalog = self.inner.catalog.lock();
        let Some(meta) = catalog.get(key).cloned() else {
            return SegmentResult::failed(Status::NotFound, format!("no object {key:?}"));
        };
        catalog.remove(key);
        self.inner.hot.remove(key);
        match self.inner.backend.remove(key) {
            Ok(()) => SegmentResult::ok(meta.size, meta.crc32),
            Err(e) => SegmentResult::failed(Status::Storage, e.to_string()),
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        for state in self.inner.peers.lock().values() {
            state.cancelled.store(true, Ordering::Release);
        }
        self.jobs = None;
        let me = std::thread::current().id();
        for w in self.workers.drain(..) {
            // The last handle may go on a worker itself (a local put's callback held
            // it): that worker ends on its own once this returns.
            if w.thread().id() != me {
                let _ = w.join();
            }
        }
    }
}

fn info(meta: crate::backend::ObjectMeta) -> ObjectInfo {
    ObjectInfo {
        key: meta.key,
        size: meta.size,
        crc32: meta.crc32,
    }
}

fn error(status: Status, message: impl Into<String>) -> Response {
    Response::Error {
        status,
        message: message.into(),
    }
}

fn run_job(inner: &Inner, job: Job) {
    let mut results = Vec::with_capacity(job.segments.len());
    for seg in &job.segments {
        let result = if job.peer.cancelled.load(Ordering::Acquire) {
            transfer::cancelled(inner)
        } else if job.push {
            transfer::push(inner, &job.peer, seg)
        } else {
            transfer::pull(inner, &job.peer, seg)
        };
        results.push(result);
    }
    (job.reply)(protocol::encode(&Message::Response(
        job.id,
        Response::Batch { results },
    )));
}

impl dpumesh_dpa::control::transport::StoreService for Agent {
    fn handle(
        &self,
        peer: u64,
        service: &str,
        message: Vec<u8>,
        fds: Vec<std::os::fd::OwnedFd>,
        reply: dpumesh_dpa::control::transport::StoreReply,
    ) {
        let namespace = match Namespace::service(service) {
            Ok(namespace) => namespace,
            Err(e) => {
                return reply.refuse(dpumesh_dpa::control::ErrorCode::BadRequest, &e.to_string());
            }
        };
        Agent::handle(
            self,
            peer,
            &namespace,
            &message,
            fds,
            Box::new(move |answer| reply.send(answer)),
        );
    }

    fn disconnected(&self, peer: u64) {
        Agent::disconnected(self, peer);
    }
}

#[cfg(test)]
mod tests;

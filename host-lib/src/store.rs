//! The BlueCache host client: register a buffer (its export descriptor goes to the
//! DPU agent), then PUSH ranges of it into objects on the DPU or PULL objects into
//! it. The bytes move by DMA between the buffer and the agent's staging buffer; only
//! metadata travels on the control channel.
//!
//! Transfers are asynchronous, like the seed's `prepXfer`/`postXfer`/`checkXfer`:
//! [`StoreClient::put_batch`] and [`StoreClient::get_batch`] return a [`Transfer`] at
//! once, which you [`Transfer::check`], [`Transfer::wait`] for, or `.await`. A worker
//! thread of the client drives the control channel, one message at a time, in the
//! order they were posted.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::thread::JoinHandle;

use crossbeam_channel::Sender;
use dpumesh_dpa::SharedRegion;
use dpumesh_dpa::control::transport::{ControlClient, Endpoint};
use dpumesh_dpa::control::{ControlError, Role};
use dpumesh_store::protocol::{
    self, MAX_SEGMENTS, Message, ProtocolError, Request, Response, Segment, Status,
};
use parking_lot::{Condvar, Mutex};

pub use dpumesh_store::protocol::{ObjectInfo, SegmentResult};

/// Why a store call failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The control channel failed (or the node runs no store).
    #[error(transparent)]
    Control(#[from] ControlError),
    /// The agent's answer did not decode, or speaks another version.
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    /// The agent refused the whole request.
    #[error("the BlueCache agent refused: {status:?}: {message}")]
    Refused {
        /// Its class.
        status: Status,
        /// Why.
        message: String,
    },
    /// The buffer could not be created.
    #[error("the buffer: {0}")]
    Buffer(#[from] dpumesh_dpa::ShmError),
    /// The client's worker is gone (the connection closed).
    #[error("the store client's connection is closed")]
    Closed,
    /// An answer of the wrong kind.
    #[error("unexpected answer from the agent: {0}")]
    Unexpected(String),
}

type Done = Box<dyn FnOnce(Result<Response, StoreError>) + Send>;

struct Work {
    request: Request,
    /// A buffer whose memory goes with the request (a registration).
    memory: Option<Arc<SharedRegion>>,
    done: Done,
}

/// A connection to a node's BlueCache agent.
pub struct StoreClient {
    work: Option<Sender<Work>>,
    worker: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for StoreClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreClient").finish_non_exhaustive()
    }
}

/// A host buffer registered with the agent: what PUSH reads and PULL writes.
#[derive(Debug, Clone)]
pub struct StoreBuffer {
    region: Arc<SharedRegion>,
    id: u32,
}

impl StoreBuffer {
    /// Its size in bytes.
    pub fn len(&self) -> usize {
        self.region.len()
    }

    /// Whether it has no bytes (never: buffers have at least one).
    pub fn is_empty(&self) -> bool {
        self.region.is_empty()
    }

    /// Writes `bytes` at `offset`.
    pub fn write(&self, offset: u64, bytes: &[u8]) -> Result<(), StoreError> {
        Ok(self.region.write(offset, bytes)?)
    }

    /// Reads `len` bytes at `offset`.
    pub fn read_vec(&self, offset: u64, len: usize) -> Result<Vec<u8>, StoreError> {
        Ok(self.region.read_vec(offset, len)?)
    }

    /// The memory itself (to read or write it in place, e.g. from a file).
    pub fn region(&self) -> &SharedRegion {
        &self.region
    }
}

/// One object of a batch: its key and the range of a buffer it comes from or goes to.
#[derive(Debug, Clone)]
pub struct Item<'a> {
    /// The object's key.
    pub key: &'a str,
    /// The buffer.
    pub buffer: &'a StoreBuffer,
    /// Where in it.
    pub offset: u64,
    /// How many bytes (PUSH: the object's size; PULL: room for it).
    pub len: u64,
}

#[derive(Default)]
struct State {
    result: Option<Result<Vec<SegmentResult>, StoreError>>,
    waker: Option<Waker>,
}

/// A transfer under way.
pub struct Transfer {
    shared: Arc<(Mutex<State>, Condvar)>,
    /// The buffers stay mapped until the transfer ends.
    _buffers: Vec<Arc<SharedRegion>>,
}

impl std::fmt::Debug for Transfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transfer")
            .field("done", &self.is_done())
            .finish()
    }
}

impl Transfer {
    /// Whether it finished (`checkXfer`).
    pub fn is_done(&self) -> bool {
        self.shared.0.lock().result.is_some()
    }

    /// Its results if it finished, without waiting; `None` while in progress.
    pub fn check(&self) -> Option<Result<Vec<SegmentResult>, StoreError>> {
        let state = self.shared.0.lock();
        state.result.as_ref().map(|r| match r {
            Ok(results) => Ok(results.clone()),
            Err(e) => Err(StoreError::Unexpected(e.to_string())),
        })
    }

    /// Waits for it: one result per item, in order.
    pub fn wait(self) -> Result<Vec<SegmentResult>, StoreError> {
        let (lock, cond) = &*self.shared;
        let mut state = lock.lock();
        while state.result.is_none() {
            cond.wait(&mut state);
        }
        state.result.take().expect("checked")
    }
}

impl Future for Transfer {
    type Output = Result<Vec<SegmentResult>, StoreError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut state = self.shared.0.lock();
        match state.result.take() {
            Some(result) => Poll::Ready(result),
            None => {
                state.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

impl StoreClient {
    /// Connects to the node's control channel at `endpoint` as `name`, acting for the
    /// service in `DPUMESH_SERVICE` with the token in `DPUMESH_TOKEN` (what `dpumesh
    /// up` and the service's Secret give a pod): the objects it sees are that
    /// service's.
    pub fn connect(endpoint: &Endpoint, name: &str) -> Result<Self, StoreError> {
        let service = std::env::var("DPUMESH_SERVICE").map_err(|_| {
            StoreError::Unexpected(
                "DPUMESH_SERVICE is not set: a store client acts for a service (its keys are that service's)".into(),
            )
        })?;
        let token = std::env::var("DPUMESH_TOKEN").ok();
        Self::connect_as(endpoint, name, &service, token.as_deref())
    }

    /// [`Self::connect`] for `service`, with its registration `token`.
    pub fn connect_as(
        endpoint: &Endpoint,
        name: &str,
        service: &str,
        token: Option<&str>,
    ) -> Result<Self, StoreError> {
        let mut control = ControlClient::connect(endpoint, Role::Host, name)?;
        control.request(dpumesh_dpa::control::Request::Authenticate {
            service: service.to_owned(),
            token: token.map(str::to_owned),
        })?;
        let (tx, rx) = crossbeam_channel::unbounded::<Work>();
        let worker = std::thread::Builder::new()
            .name("dpumesh-store-client".into())
            .spawn(move || {
                let mut next_id = 1u32;
                while let Ok(work) = rx.recv() {
                    let id = next_id;
                    next_id = next_id.wrapping_add(1).max(1);
                    let result = exchange(&mut control, id, work.request, work.memory.as_deref());
                    (work.done)(result);
                }
            })
            .map_err(|e| StoreError::Control(ControlError::Io(e)))?;
        Ok(Self {
            work: Some(tx),
            worker: Some(worker),
        })
    }

    fn post(&self, request: Request, done: Done) {
        self.post_with(request, None, done);
    }

    fn post_with(&self, request: Request, memory: Option<Arc<SharedRegion>>, done: Done) {
        let work = Work {
            request,
            memory,
            done,
        };
        match &self.work {
            Some(tx) => {
                if let Err(e) = tx.send(work) {
                    (e.0.done)(Err(StoreError::Closed));
                }
            }
            None => (work.done)(Err(StoreError::Closed)),
        }
    }

    fn call(&self, request: Request) -> Result<Response, StoreError> {
        self.call_with(request, None)
    }

    fn call_with(
        &self,
        request: Request,
        memory: Option<Arc<SharedRegion>>,
    ) -> Result<Response, StoreError> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.post_with(
            request,
            memory,
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
        );
        rx.recv().map_err(|_| StoreError::Closed)?
    }

    /// Creates a buffer of `len` bytes and registers it with the agent: its memory
    /// (a sealed memfd here, passed as a descriptor; a DOCA mmap export on BlueField).
    pub fn register(&self, len: usize) -> Result<StoreBuffer, StoreError> {
        let region = Arc::new(SharedRegion::create_sealed("dpumesh-store", len.max(1))?);
        match self.call_with(
            Request::Register {
                len: region.len() as u64,
                hw_export: Vec::new(),
            },
            Some(region.clone()),
        )? {
            Response::Registered { buffer } => Ok(StoreBuffer { region, id: buffer }),
            other => Err(refused_or_unexpected(other)),
        }
    }

    /// Forgets a buffer at the agent.
    pub fn deregister(&self, buffer: StoreBuffer) -> Result<(), StoreError> {
        match self.call(Request::Deregister { buffer: buffer.id })? {
            Response::Ok => Ok(()),
            other => Err(refused_or_unexpected(other)),
        }
    }

    /// PUSH: each item's range becomes the object of its key (`postXfer` of a write).
    pub fn put_batch(&self, items: &[Item<'_>]) -> Transfer {
        self.transfer(items, true)
    }

    /// PULL: each object lands in its item's range (`postXfer` of a read).
    pub fn get_batch(&self, items: &[Item<'_>]) -> Transfer {
        self.transfer(items, false)
    }

    fn transfer(&self, items: &[Item<'_>], push: bool) -> Transfer {
        let shared = Arc::new((Mutex::new(State::default()), Condvar::new()));
        let buffers = items.iter().map(|i| i.buffer.region.clone()).collect();
        let segments: Vec<Segment> = items
            .iter()
            .map(|i| Segment {
                key: i.key.to_owned(),
                buffer: i.buffer.id,
                offset: i.offset,
                len: i.len,
            })
            .collect();
        // Batches of at most MAX_SEGMENTS; the results are joined in order.
        let chunks: Vec<Vec<Segment>> = if segments.is_empty() {
            vec![Vec::new()]
        } else {
            segments.chunks(MAX_SEGMENTS).map(<[_]>::to_vec).collect()
        };
        let parts = chunks.len();
        let collected = Arc::new(Mutex::new((Vec::new(), 0usize, None::<StoreError>)));
        for segments in chunks {
            let request = if push {
                Request::PushBatch { segments }
            } else {
                Request::PullBatch { segments }
            };
            let (shared, collected) = (shared.clone(), collected.clone());
            self.post(
                request,
                Box::new(move |result| {
                    let mut c = collected.lock();
                    match result {
                        Ok(Response::Batch { results }) => c.0.extend(results),
                        Ok(other) => c.2 = Some(refused_or_unexpected(other)),
                        Err(e) => c.2 = Some(e),
                    }
                    c.1 += 1;
                    if c.1 == parts {
                        let result = match c.2.take() {
                            Some(e) => Err(e),
                            None => Ok(std::mem::take(&mut c.0)),
                        };
                        finish(&shared, result);
                    }
                }),
            );
        }
        Transfer {
            shared,
            _buffers: buffers,
        }
    }

    /// Sizes and checksums of objects (`None`: no such object).
    pub fn stat(&self, keys: &[&str]) -> Result<Vec<Option<ObjectInfo>>, StoreError> {
        match self.call(Request::PullInfo {
            keys: keys.iter().map(|k| (*k).to_owned()).collect(),
        })? {
            Response::Info { objects } => Ok(objects),
            other => Err(refused_or_unexpected(other)),
        }
    }

    /// Removes objects: one result per key (`NotFound` for one that was not there).
    pub fn delete(&self, keys: &[&str]) -> Result<Vec<SegmentResult>, StoreError> {
        match self.call(Request::Delete {
            keys: keys.iter().map(|k| (*k).to_owned()).collect(),
        })? {
            Response::Batch { results } => Ok(results),
            other => Err(refused_or_unexpected(other)),
        }
    }

    /// Every object whose key starts with `prefix`, in key order.
    pub fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>, StoreError> {
        let mut all: Vec<ObjectInfo> = Vec::new();
        loop {
            let after = all.last().map(|o| o.key.clone());
            match self.call(Request::List {
                prefix: prefix.to_owned(),
                after,
                limit: 256,
            })? {
                Response::Listed { objects, more } => {
                    all.extend(objects);
                    if !more {
                        return Ok(all);
                    }
                }
                other => return Err(refused_or_unexpected(other)),
            }
        }
    }
}

impl Drop for StoreClient {
    fn drop(&mut self) {
        self.work = None;
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

fn finish(shared: &(Mutex<State>, Condvar), result: Result<Vec<SegmentResult>, StoreError>) {
    let waker = {
        let mut state = shared.0.lock();
        state.result = Some(result);
        state.waker.take()
    };
    shared.1.notify_all();
    if let Some(w) = waker {
        w.wake();
    }
}

fn refused_or_unexpected(response: Response) -> StoreError {
    match response {
        Response::Error { status, message } => StoreError::Refused { status, message },
        other => StoreError::Unexpected(format!("{other:?}")),
    }
}

/// One request and its answer, with the store protocol's checks.
fn exchange(
    control: &mut ControlClient,
    id: u32,
    request: Request,
    memory: Option<&SharedRegion>,
) -> Result<Response, StoreError> {
    let message = protocol::encode(&Message::Request(id, request));
    let answer = match memory {
        Some(region) => control.store_with_fds(message, &[region.fd()])?,
        None => control.store(message)?,
    };
    match protocol::decode(&answer)? {
        Message::Response(got, response) if got == id => Ok(response),
        Message::Response(got, _) => Err(StoreError::Unexpected(format!(
            "answer to request {got}, expected {id}"
        ))),
        Message::Request(..) => Err(StoreError::Unexpected("a request from the agent".into())),
    }
}

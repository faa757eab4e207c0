//! One thread's side of the fabric as a client: its links to every node, its
//! registered request and response buffers (slots), and the pump that turns
//! completions into answers.
//!
//! Everything here lives on the owning thread, a current-thread runtime: a request's
//! task writes its body into a slot, posts its frame on the link itself and awaits the
//! answer that the pump — a task on the same thread, woken by the completion queue's
//! descriptor through the runtime's reactor — hands it. No request crosses threads.
//!
//! A request holds its slot (a request buffer the node READs, a response buffer the
//! node WRITEs) until its answer came or its link failed: only then can nothing write
//! into it any more.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use dpumesh_dpa::fabric::{Access, CompletionQueue, Fabric, MemoryRegion, QpCaps, WorkCompletion};
use dpumesh_dpa::frame::{Message, RemoteBuf, Request, RequestFlags, ResponseBody};
use dpumesh_dpa::link::{Link, LinkEvent};
use dpumesh_dpa::reconnect::Reconnect;

use crate::health::Health;
use crate::stream::{Piece, StreamBody, StreamSource};
use crate::upload::{UpNews, UpSink, Upload};
use dpumesh_dpa::frame::{Chunk, ChunkEnd, StreamWindows};
use dpumesh_dpa::shm::SharedRegion;
use dpumesh_error::{ErrorKind, ProxyError};
use dpumesh_supervise::{RestartPolicy, Supervisor};
use tokio::io::unix::AsyncFd;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, mpsc, oneshot};

/// An answer from a node.
#[derive(Debug)]
pub struct Answer {
    /// The response head (wire form).
    pub head: Vec<u8>,
    /// The body (empty when it streams).
    pub body: Bytes,
    /// The body, streamed: its parts as the node sends them. Dropping it before its
    /// end cancels the stream.
    pub stream: Option<StreamBody>,
}

/// A streamed answer being received: where its parts go, or (cancelled) the slot it
/// holds until the node's last frame.
struct Receiving {
    qp: u32,
    windows: StreamWindows,
    /// To the body; `None` once the reader gave the stream up.
    tx: Option<mpsc::UnboundedSender<Piece>>,
    /// The slot of a cancelled stream, freed by the node's last frame.
    held: Option<Slot>,
}

/// A request body being sent in parts: where the node's news go, or (ended) the slot
/// it holds until the node handed back the windows it was lent.
struct Sending {
    qp: u32,
    /// To the upload; `None` once it ended.
    tx: Option<mpsc::UnboundedSender<UpNews>>,
    /// The slot of an ended upload and the windows still with the node.
    held: Option<(Slot, u8)>,
}

/// A request slot: its index names a request body buffer and a response buffer. It
/// goes back to the free list when its last clone is dropped (a request whose body
/// streams holds it from its sender and from its answer: whichever ends last frees
/// it).
#[derive(Clone)]
pub struct Slot(Rc<Held>);

struct Held {
    index: u32,
    free: Rc<RefCell<Vec<u32>>>,
    _permit: OwnedSemaphorePermit,
}

impl Slot {
    /// Its index.
    pub fn index(&self) -> u32 {
        self.0.index
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.free.borrow_mut().push(self.index);
    }
}

struct Pending {
    qp: u32,
    slot: Slot,
    reply: oneshot::Sender<Result<Answer, ProxyError>>,
}

struct Links<F: Fabric> {
    links: HashMap<u32, (SocketAddr, Link<F>)>,
    by_node: HashMap<SocketAddr, u32>,
    /// Nodes whose connect failed (not tried again for a while) or whose link went
    /// down.
    reconnect: Reconnect<SocketAddr>,
    pending: HashMap<u32, Pending>,
    /// Streamed answers being received, by xid.
    streams: HashMap<u32, Receiving>,
    /// Request bodies being sent in parts, by xid.
    uploads: HashMap<u32, Sending>,
}

/// A client's slots: request bodies are written into `requests` for the node to READ,
/// responses are written into `responses` by the node; a slot is free while its index
/// is on `free` (a permit stands for each).
struct Slots<F: Fabric> {
    req_mr: F::Mr,
    resp_mr: F::Mr,
    requests: Arc<SharedRegion>,
    responses: Arc<SharedRegion>,
    size: u64,
    free: Rc<RefCell<Vec<u32>>>,
    permits: Arc<Semaphore>,
}

/// One thread's fabric client: its fabric resources and requests in flight.
pub struct Client<F: Fabric> {
    fabric: F,
    pd: F::Pd,
    cq: F::Cq,
    /// The request and response buffers, a slot each way per request in flight.
    slots: Slots<F>,
    state: RefCell<Links<F>>,
    completions: RefCell<Vec<WorkCompletion>>,
    /// Makes the pump panic at its next turn (tests of supervision).
    panic_next: Cell<bool>,
    /// Rung by a call that posted a frame: the pump sends what the tasks of this turn
    /// posted, together.
    posted: Notify,
    supervisor: Arc<Supervisor>,
    /// Where link events are told (for `/readyz` and the prober).
    health: Arc<Health>,
    /// The pump's thread name in supervision reports (`dpumesh-<role>-pump`).
    pump_name: String,
    reconnects: metrics::Counter,
    links_lost: metrics::Counter,
    /// Itself, for the bodies of streamed answers.
    me: std::rc::Weak<Self>,
    /// Windows read by streamed bodies, to hand back (link, xid), and streams their
    /// readers gave up: sent by the pump at its next turn (a body may be dropped
    /// while the pump holds the links).
    stream_news: RefCell<Vec<StreamNews>>,
}

enum StreamNews {
    Window { qp: u32, xid: u32 },
    Cancel { qp: u32, xid: u32, slot: Slot },
}

impl<F: Fabric> StreamSource for Client<F> {
    fn read_window(&self, slot: &Slot, window: u8, len: u32) -> Result<Bytes, ProxyError> {
        let windows = StreamWindows::of(self.slots.size as u32);
        if window >= windows.count || len > windows.size {
            return Err(ProxyError::new(
                ErrorKind::BadResponse,
                format!("the node named window {window} of {len} bytes, past the reply buffer"),
            ));
        }
        let at = u64::from(slot.index()) * self.slots.size + windows.offset(window);
        self.slots
            .responses
            .read_vec(at, len as usize)
            .map(Bytes::from)
            .map_err(|e| {
                ProxyError::new(
                    ErrorKind::Internal,
                    format!("cannot read the stream's part: {e}"),
                )
            })
    }

    fn window_done(&self, qp: u32, xid: u32) {
        self.stream_news
            .borrow_mut()
            .push(StreamNews::Window { qp, xid });
        self.posted.notify_one();
    }

    fn cancel(&self, qp: u32, xid: u32, slot: Slot) {
        self.stream_news
            .borrow_mut()
            .push(StreamNews::Cancel { qp, xid, slot });
        self.posted.notify_one();
    }
}

impl<F: Fabric> UpSink for Client<F> {
    fn write_at(&self, slot: &Slot, at: u64, bytes: &[u8]) -> Result<(), ProxyError> {
        self.write(slot, at, bytes)
    }

    fn send_up(&self, qp: u32, message: Message) -> Result<(), ProxyError> {
        let mut state = self.state.borrow_mut();
        let Some((_, link)) = state.links.get_mut(&qp) else {
            return Err(ProxyError::new(
                ErrorKind::LinkLost,
                "the link carrying the request body was lost",
            ));
        };
        if let Err(e) = link.send(message) {
            if link.is_down() {
                self.down(&mut state, qp, &e.to_string());
            }
            return Err(ProxyError::new(
                ErrorKind::LinkLost,
                format!("cannot send the request body's part: {e}"),
            ));
        }
        drop(state);
        self.posted.notify_one();
        Ok(())
    }

    fn release(&self, qp: u32, xid: u32, slot: Slot, busy: u8) {
        let mut state = self.state.borrow_mut();
        match state.uploads.get_mut(&xid) {
            Some(s) if s.qp == qp && busy > 0 => {
                s.tx = None;
                s.held = Some((slot, busy));
            }
            // Nothing of the buffer is with the node (or the link is gone): the
            // slot goes with the upload.
            Some(s) if s.qp == qp => {
                state.uploads.remove(&xid);
            }
            _ => {}
        }
    }
}

impl<F: Fabric> Client<F> {
    /// A client with `slots` request slots of `slot_size` bytes each way; it reports
    /// its links' events to `health`. `role` names its regions, its pump and its
    /// metrics (`dpumesh-ingress-pump`, `dpumesh_ingress_links_lost_total`).
    pub fn new(
        role: &str,
        fabric: F,
        slots: u32,
        slot_size: u64,
        health: Arc<Health>,
    ) -> anyhow::Result<Rc<Self>> {
        let pd = fabric.alloc_pd()?;
        let cq = fabric.create_cq(8192)?;
        // Frames leave when the pump flushes them: every request a turn of the
        // owning thread's tasks posts goes out in one write per link (TCP fabric).
        cq.hold_sends(true);
        let len = u64::from(slots.max(1)) * slot_size;
        let requests = Arc::new(SharedRegion::create_unique(
            &format!("dpumesh-{role}-req"),
            len as usize,
        )?);
        let responses = Arc::new(SharedRegion::create_unique(
            &format!("dpumesh-{role}-resp"),
            len as usize,
        )?);
        let req_mr = fabric.register(&pd, &requests, 0, len, Access::all())?;
        let resp_mr = fabric.register(&pd, &responses, 0, len, Access::all())?;
        Ok(Rc::new_cyclic(|me| Self {
            me: me.clone(),
            stream_news: RefCell::new(Vec::new()),
            fabric,
            pd,
            cq,
            slots: Slots {
                req_mr,
                resp_mr,
                requests,
                responses,
                size: slot_size,
                free: Rc::new(RefCell::new((0..slots.max(1)).rev().collect())),
                permits: Arc::new(Semaphore::new(slots.max(1) as usize)),
            },
            state: RefCell::new(Links {
                links: HashMap::new(),
                by_node: HashMap::new(),
                reconnect: Reconnect::default(),
                pending: HashMap::new(),
                streams: HashMap::new(),
                uploads: HashMap::new(),
            }),
            completions: RefCell::new(Vec::with_capacity(64)),
            panic_next: Cell::new(false),
            posted: Notify::new(),
            supervisor: Supervisor::new(),
            health,
            pump_name: format!("dpumesh-{role}-pump"),
            reconnects: metrics::counter!(format!("dpumesh_{role}_reconnects_total")),
            links_lost: metrics::counter!(format!("dpumesh_{role}_links_lost_total")),
        }))
    }

    /// The pump's supervision, for readiness.
    pub fn supervisor(&self) -> &Arc<Supervisor> {
        &self.supervisor
    }

    /// Makes the pump panic at its next turn (tests of supervision).
    #[cfg(feature = "fault-injection")]
    pub fn inject_panic(&self) {
        self.panic_next.set(true);
        self.cq.interrupter().interrupt();
    }

    /// Waits for a free slot.
    pub async fn acquire(&self) -> Slot {
        let permit = self
            .slots
            .permits
            .clone()
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        let index = self
            .slots
            .free
            .borrow_mut()
            .pop()
            .expect("a permit guarantees a free slot");
        Slot(Rc::new(Held {
            index,
            free: self.slots.free.clone(),
            _permit: permit,
        }))
    }

    /// Writes body bytes at `at` in `slot`'s request buffer.
    pub fn write(&self, slot: &Slot, at: u64, bytes: &[u8]) -> Result<(), ProxyError> {
        if at + bytes.len() as u64 > self.slots.size {
            return Err(ProxyError::new(
                ErrorKind::BodyTooLarge,
                format!("request body exceeds the {}-byte slot", self.slots.size),
            ));
        }
        self.slots
            .requests
            .write(u64::from(slot.index()) * self.slots.size + at, bytes)
            .map_err(|e| {
                ProxyError::new(
                    ErrorKind::Internal,
                    format!("cannot write the body into its slot: {e}"),
                )
            })
    }

    /// Sends a request to `node` (its head, its body of `body_len` bytes in `slot`) and
    /// returns where its answer will come. The frame is posted here, on the caller's
    /// thread.
    pub fn call(
        &self,
        node: SocketAddr,
        slot: Slot,
        head: Vec<u8>,
        body_len: u32,
        deadline: Duration,
    ) -> oneshot::Receiver<Result<Answer, ProxyError>> {
        self.call_with(
            node,
            slot,
            head,
            body_len,
            deadline,
            RequestFlags::default(),
        )
    }

    /// [`Self::call`] with the request's `flags` (a node's call to a mesh service).
    pub fn call_with(
        &self,
        node: SocketAddr,
        slot: Slot,
        head: Vec<u8>,
        body_len: u32,
        deadline: Duration,
        flags: RequestFlags,
    ) -> oneshot::Receiver<Result<Answer, ProxyError>> {
        self.send_request(node, slot, head, body_len, deadline, flags)
            .0
    }

    /// The most bytes one window of a streamed body takes (what a caller may read
    /// ahead into window 0 before [`Self::call_streamed`]).
    pub fn stream_window(&self) -> u32 {
        StreamWindows::of(self.slots.size as u32).size
    }

    /// Sends a request whose body streams: its first `first` bytes are in the slot's
    /// request buffer already (window 0); the returned [`Upload`] sends the rest, as
    /// it comes, while the answer is awaited (it may come, and stream, before the
    /// body ends). No upload when the request could not be sent (the answer says
    /// why).
    pub fn call_streamed(
        &self,
        node: SocketAddr,
        slot: Slot,
        head: Vec<u8>,
        first: u32,
        deadline: Duration,
    ) -> (
        oneshot::Receiver<Result<Answer, ProxyError>>,
        Option<Upload>,
    ) {
        let flags = RequestFlags {
            stream: true,
            ..RequestFlags::default()
        };
        let (answer, qp) = self.send_request(node, slot.clone(), head, 0, deadline, flags);
        let upload = qp.and_then(|qp| {
            let sink = self.me.upgrade()?;
            let (tx, news) = mpsc::unbounded_channel();
            self.state.borrow_mut().uploads.insert(
                slot.index(),
                Sending {
                    qp,
                    tx: Some(tx),
                    held: None,
                },
            );
            let windows = StreamWindows::of(self.slots.size as u32);
            Some(Upload::new(sink, qp, slot, windows, first, news))
        });
        (answer, upload)
    }

    /// Posts a request frame; the link it went on, when it went.
    fn send_request(
        &self,
        node: SocketAddr,
        slot: Slot,
        head: Vec<u8>,
        body_len: u32,
        deadline: Duration,
        flags: RequestFlags,
    ) -> (oneshot::Receiver<Result<Answer, ProxyError>>, Option<u32>) {
        let (reply, answer) = oneshot::channel();
        if let Err(why) = self.ready() {
            // Nobody would hand the answer over: say so now.
            let _ = reply.send(Err(ProxyError::new(ErrorKind::ThreadLost, why)));
            return (answer, None);
        }
        let mut state = self.state.borrow_mut();
        let qp = match self.link(&mut state, node) {
            Ok(qp) => qp,
            Err(e) => {
                let _ = reply.send(Err(e));
                return (answer, None);
            }
        };
        let offset = u64::from(slot.index()) * self.slots.size;
        let xid = slot.index();
        // A streamed body's buffer is the whole request buffer (its windows).
        let body_len = if flags.stream {
            self.slots.size as u32
        } else {
            body_len
        };
        let request = Request {
            xid,
            flags,
            deadline_ms: deadline.as_millis().clamp(1, u128::from(u32::MAX)) as u32,
            body: (body_len > 0).then(|| RemoteBuf {
                at: self.slots.req_mr.remote(offset),
                len: body_len,
            }),
            reply: RemoteBuf {
                at: self.slots.resp_mr.remote(offset),
                len: self.slots.size as u32,
            },
            head,
        };
        let (_, link) = state.links.get_mut(&qp).expect("just made");
        if let Err(e) = link.send(Message::Request(request)) {
            let _ = reply.send(Err(ProxyError::new(
                ErrorKind::LinkLost,
                format!("cannot send to the node: {e}"),
            )));
            if link.is_down() {
                self.down(&mut state, qp, &e.to_string());
            }
            return (answer, None);
        }
        state.pending.insert(xid, Pending { qp, slot, reply });
        self.posted.notify_one();
        (answer, Some(qp))
    }

    /// Whether `node` is worth sending to now (not waiting out a failed connect).
    pub fn reachable(&self, node: SocketAddr) -> bool {
        self.state.borrow().reconnect.may_try(&node, Instant::now()) || self.health.is_up(node)
    }

    fn link(&self, state: &mut Links<F>, node: SocketAddr) -> Result<u32, ProxyError> {
        if let Some(&qp) = state.by_node.get(&node)
            && state.links.get(&qp).is_some_and(|(_, l)| !l.is_down())
        {
            return Ok(qp);
        }
        // Waiting out a failed connect, unless the prober has since seen the node
        // answer.
        if !state.reconnect.may_try(&node, Instant::now()) && !self.health.is_up(node) {
            return Err(ProxyError::new(
                ErrorKind::Unreachable,
                format!("the node at {node} was unreachable moments ago"),
            ));
        }
        // Connecting blocks this thread for a moment (local: a Unix handshake; remote:
        // a TCP connect); it happens once per node, and a failure is remembered.
        let connected = self
            .fabric
            .connect(&self.pd, node, &self.cq, QpCaps::default())
            .and_then(|qp| {
                Link::new(&self.fabric, &self.pd, qp).map_err(|e| {
                    dpumesh_dpa::fabric::FabricError::Io(std::io::Error::other(e.to_string()))
                })
            });
        let link = match connected {
            Ok(link) => link,
            Err(e) => {
                state.reconnect.failed(&node, Instant::now());
                self.health.down(node, &e.to_string(), Instant::now());
                return Err(ProxyError::new(
                    ErrorKind::Unreachable,
                    format!("cannot reach the node at {node}: {e}"),
                ));
            }
        };
        self.health.up(node);
        if state.reconnect.connected(&node) {
            tracing::info!(%node, "link to node back");
            self.reconnects.increment(1);
        }
        let num = link.qp_num();
        state.links.insert(num, (node, link));
        state.by_node.insert(node, num);
        Ok(num)
    }

    fn down(&self, state: &mut Links<F>, qp: u32, why: &str) {
        let Some((node, _)) = state.links.remove(&qp) else {
            return;
        };
        tracing::warn!(%node, why, "link to node down");
        self.health
            .down(node, &format!("link lost ({why})"), Instant::now());
        self.links_lost.increment(1);
        state.by_node.remove(&node);
        state.reconnect.lost(&node);
        let lost: Vec<u32> = state
            .pending
            .iter()
            .filter(|(_, p)| p.qp == qp)
            .map(|(x, _)| *x)
            .collect();
        for xid in lost {
            let p = state.pending.remove(&xid).expect("listed");
            let _ = p.reply.send(Err(ProxyError::new(
                ErrorKind::LinkLost,
                format!("lost the link to the node at {node} ({why})"),
            )));
        }
        // Streams over it end: their bodies fail, held slots are free (nothing can
        // write into them any more).
        state.streams.retain(|_, s| s.qp != qp);
        // Uploads over it end (nothing reads their buffers any more).
        state.uploads.retain(|_, s| s.qp != qp);
    }

    /// Sends what streamed bodies did since the last turn: windows handed back,
    /// streams given up.
    fn stream_news(&self, state: &mut Links<F>) {
        let news = std::mem::take(&mut *self.stream_news.borrow_mut());
        for n in news {
            let (qp, message) = match n {
                StreamNews::Window { qp, xid } => (qp, Message::Window { xid, count: 1 }),
                StreamNews::Cancel { qp, xid, slot } => {
                    match state.streams.get_mut(&xid) {
                        Some(s) if s.qp == qp => {
                            s.tx = None;
                            s.held = Some(slot);
                        }
                        // The stream already ended: nothing writes into the slot.
                        _ => continue,
                    }
                    (qp, Message::Cancel { xid })
                }
            };
            if let Some((_, link)) = state.links.get_mut(&qp)
                && let Err(e) = link.send(message)
                && link.is_down()
            {
                self.down(state, qp, &e.to_string());
            }
        }
    }

    /// A streamed answer's head came: its body reads the parts that follow.
    fn receive_stream(&self, state: &mut Links<F>, p: Pending, xid: u32, head: Vec<u8>) {
        let Some(source) = self.me.upgrade() else {
            // Only while the client is dropped, when nobody waits for answers.
            return;
        };
        let (tx, rx) = mpsc::unbounded_channel();
        state.streams.insert(
            xid,
            Receiving {
                qp: p.qp,
                windows: StreamWindows::of(self.slots.size as u32),
                tx: Some(tx),
                held: None,
            },
        );
        let body = StreamBody {
            source,
            qp: p.qp,
            xid,
            slot: Some(p.slot),
            rx,
        };
        // A caller that left drops the body here: its cancel waits in the news for
        // the next turn.
        let _ = p.reply.send(Ok(Answer {
            head,
            body: Bytes::new(),
            stream: Some(body),
        }));
    }

    /// A part of a streamed answer.
    fn chunk(&self, state: &mut Links<F>, qp: u32, c: Chunk) {
        let Some(s) = state.streams.get_mut(&c.xid) else {
            return;
        };
        if s.qp != qp {
            return;
        }
        let piece = match c.end {
            ChunkEnd::More if c.window < s.windows.count && c.len <= s.windows.size => {
                Piece::Data {
                    window: c.window,
                    len: c.len,
                }
            }
            ChunkEnd::More => {
                // The node breaks the protocol: it may write anywhere in the buffer,
                // so nothing it lent is safe to reuse until the link is gone.
                let why = format!(
                    "the node named window {} of {} bytes, past the reply buffer",
                    c.window, c.len
                );
                self.down(state, qp, &why);
                return;
            }
            ChunkEnd::Last(trailers) => Piece::Last(trailers),
            ChunkEnd::Abort(why) => Piece::Abort(why),
        };
        let ends = !matches!(piece, Piece::Data { .. });
        if let Some(tx) = &s.tx {
            let _ = tx.send(piece);
        }
        if ends {
            // The body holds its slot until it has read the windows before this;
            // a cancelled stream's slot is free now.
            state.streams.remove(&c.xid);
        }
    }

    /// Handles what completed; returns how many completions there were.
    fn progress(&self) -> usize {
        if self.panic_next.replace(false) {
            panic!("injected fabric pump panic");
        }
        let mut completions = self.completions.borrow_mut();
        completions.clear();
        self.cq.poll(&mut completions, 64);
        let n = completions.len();
        let mut state = self.state.borrow_mut();
        self.stream_news(&mut state);
        for wc in completions.iter() {
            let Some((_, link)) = state.links.get_mut(&wc.qp_num) else {
                continue;
            };
            match link.on_completion(wc) {
                Ok(Some(LinkEvent::Message(Message::Response(r)))) => {
                    let Some(p) = state.pending.remove(&r.xid) else {
                        continue;
                    };
                    if p.qp != wc.qp_num {
                        // Another node answered for this slot: not ours to take.
                        state.pending.insert(r.xid, p);
                        continue;
                    }
                    let body = match r.body {
                        ResponseBody::Stream => {
                            self.receive_stream(&mut state, p, r.xid, r.head);
                            continue;
                        }
                        ResponseBody::None => Ok(Bytes::new()),
                        ResponseBody::Inline(b) => Ok(Bytes::from(b)),
                        ResponseBody::Written(len) if u64::from(len) <= self.slots.size => self
                            .slots
                            .responses
                            .read_vec(u64::from(p.slot.index()) * self.slots.size, len as usize)
                            .map(Bytes::from)
                            .map_err(|e| {
                                ProxyError::new(
                                    ErrorKind::Internal,
                                    format!("cannot read the response body: {e}"),
                                )
                            }),
                        ResponseBody::Written(len) => Err(ProxyError::new(
                            ErrorKind::BadResponse,
                            format!(
                                "node wrote a {len}-byte body into a {}-byte buffer",
                                self.slots.size
                            ),
                        )),
                    };
                    let _ = p.reply.send(body.map(|body| Answer {
                        head: r.head,
                        body,
                        stream: None,
                    }));
                    drop(p.slot);
                }
                Ok(Some(LinkEvent::Message(Message::Chunk(c)))) => {
                    self.chunk(&mut state, wc.qp_num, c);
                }
                Ok(Some(LinkEvent::Message(Message::UpWindow { xid, count }))) => {
                    up_news(&mut state.uploads, wc.qp_num, xid, UpNews::Window(count));
                }
                Ok(Some(LinkEvent::Message(Message::UpCancel { xid }))) => {
                    up_news(&mut state.uploads, wc.qp_num, xid, UpNews::Cancel);
                }
                Ok(Some(LinkEvent::Message(_))) | Ok(None) | Ok(Some(LinkEvent::OpDone(_))) => {}
                Ok(Some(LinkEvent::OpFailed(_, status))) => {
                    self.down(&mut state, wc.qp_num, &format!("{status:?}"));
                }
                Err(e) => self.down(&mut state, wc.qp_num, &e.to_string()),
            }
        }
        n
    }

    /// After a pump panic: every request in flight is answered (503) and every link
    /// dropped (nodes free what those requests held when they see it go); links are
    /// made again on the next call.
    fn recover(&self) {
        let mut state = self.state.borrow_mut();
        for (_, p) in state.pending.drain() {
            let _ = p.reply.send(Err(ProxyError::new(
                ErrorKind::ThreadLost,
                "the fabric pump restarted after a panic",
            )));
        }
        state.links.clear();
        state.by_node.clear();
        state.streams.clear();
        state.uploads.clear();
    }

    /// Requests waiting for their answer.
    pub fn in_flight(&self) -> usize {
        self.state.borrow().pending.len()
    }

    /// Fails every request in flight with `e` (its owner stops).
    pub fn fail_all(&self, e: &ProxyError) {
        let mut state = self.state.borrow_mut();
        for (_, p) in state.pending.drain() {
            let _ = p.reply.send(Err(e.clone()));
        }
    }

    /// Drives completions until the owner stops: polls while there is work, then
    /// sleeps on the completion queue's descriptor in the runtime's reactor.
    async fn pump(self: Rc<Self>, fd: Option<Rc<AsyncFd<OwnedFd>>>) {
        loop {
            let done = self.progress();
            // What this turn's tasks posted, and what the completions owe (credits).
            self.cq.flush_sends();
            if done > 0 {
                // Let the tasks just answered (and new requests) run before more.
                tokio::task::yield_now().await;
                continue;
            }
            let Some(fd) = &fd else {
                // A completion queue with no descriptor to sleep on: poll gently.
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_micros(200)) => {}
                    () = self.posted.notified() => {}
                }
                continue;
            };
            // Whether the queue's descriptor turned readable: only then is there a
            // wake-up (or a closed peer socket) to consume. A task posting a request
            // ends the sleep too, and that needs no system call.
            let readable = self.cq.prepare_sleep()
                && tokio::select! {
                    ready = fd.readable() => {
                        match ready {
                            Ok(mut guard) => guard.clear_ready(),
                            Err(_) => tokio::time::sleep(Duration::from_millis(1)).await,
                        }
                        true
                    }
                    () = self.posted.notified() => false,
                };
            if readable {
                self.cq.finish_sleep();
            } else {
                self.cq.end_sleep();
            }
        }
    }

    /// Runs the pump on this thread's local task set, restarted after a panic (up to
    /// the supervision policy's limit; then calls are answered 503 and readiness says
    /// why).
    pub fn spawn_pump(self: &Rc<Self>) {
        let fd = self
            .cq
            .wait_fd()
            .and_then(|fd| fd.try_clone_to_owned().ok())
            .and_then(|fd| {
                // `AsyncFd::new` is deprecated because it takes any `AsRawFd`, whose
                // descriptor may close while registered; an `OwnedFd` (our own
                // duplicate of the queue's descriptor) is owned by the `AsyncFd` for as
                // long as it is registered, which is what `register` asks of callers.
                #[allow(deprecated)]
                let registered = AsyncFd::new(fd);
                registered.ok()
            })
            .map(Rc::new);
        let me = self.clone();
        let mut tracked = self
            .supervisor
            .track(self.pump_name.clone(), RestartPolicy::default());
        tokio::task::spawn_local(async move {
            loop {
                let pump = tokio::task::spawn_local(me.clone().pump(fd.clone()));
                match pump.await {
                    Err(e) if e.is_panic() => {
                        let message = dpumesh_supervise::panic_message(e.into_panic().as_ref());
                        let again = tracked.panicked(&message);
                        me.recover();
                        if !again {
                            me.fail_all(&ProxyError::new(
                                ErrorKind::ThreadLost,
                                "the fabric pump is down after repeated panics",
                            ));
                            return;
                        }
                    }
                    _ => {
                        tracked.stopped();
                        return;
                    }
                }
            }
        });
    }

    /// Whether the pump is down (after repeated panics): calls are answered 503.
    pub fn ready(&self) -> Result<(), String> {
        self.supervisor.ready()
    }
}

/// The node's news of upload `xid` over link `qp`: to the upload while it runs; for
/// one that ended, windows coming back free its slot once all are back.
fn up_news(uploads: &mut HashMap<u32, Sending>, qp: u32, xid: u32, news: UpNews) {
    let Some(s) = uploads.get_mut(&xid) else {
        return;
    };
    if s.qp != qp {
        return;
    }
    let done = match (&news, &mut s.held) {
        (UpNews::Cancel, _) => true,
        (UpNews::Window(n), Some((_, busy))) => {
            *busy = busy.saturating_sub(*n);
            *busy == 0
        }
        (UpNews::Window(_), None) => false,
    };
    if let Some(tx) = &s.tx {
        let _ = tx.send(news);
    }
    if done {
        // An upload still running keeps its own clone of the slot.
        uploads.remove(&xid);
    }
}

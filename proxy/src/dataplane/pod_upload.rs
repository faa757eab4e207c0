//! Streamed request bodies of pods' calls: an upload of any size or a gRPC client
//! stream that a pod of this node sends to another service, relayed part by part.
//!
//! The caller opens the stream with the head alone (`STREAM`, status 5, in the
//! request's direction); its chain runs on the head as for any call. Its parts
//! (status 0, then 1 with the trailers, or 2) wait here, in the caller's TX slots,
//! until the call is at its callee:
//!
//! - **A pod of this node** (case 3): the DMA manager copies each part from the
//!   caller's TX slot into one of the callee's RX slots; the caller gets its slot
//!   back under its own ids (its window of parts in flight moves), the copy is
//!   delivered under the try's. At most [`UPLOAD_PARTS`] parts are at the callee and
//!   not taken (its `Taken`).
//! - **Another node** (case 1): the call goes with `stream` and a request buffer, one
//!   of the caller's RX slots that the fabric holds (the caller allocates its TX
//!   slots itself), cut into windows. Each part is
//!   copied into a free window and announced (`UpChunk`); the peer reads it and hands
//!   the window back (`UpWindow`). The buffer goes back once the peer said
//!   `UpCancel`, or after the end when every window came back, or with the link.
//!
//! Parts beyond what the callee has room for wait here, and the caller sends no more
//! than its own window, so a callee that reads slowly slows the caller and nothing
//! grows in between. An upload ends with its last part; with the callee's `Stop`;
//! when its exchange ends without a streamed answer (a denial, an error, a timeout, a
//! whole answer), or with the answer's stream otherwise (gRPC's bidirectional calls);
//! when the caller, the callee or the link goes; or after the route's idle limit.
//! Ended early, the caller hears `Cancelled`, the callee an abort part, a peer an
//! abort `UpChunk`.

use std::collections::VecDeque;

use dpumesh_dpa::StreamPart;
use dpumesh_dpa::frame::{Chunk, ChunkEnd, StreamWindows};

use super::stream::STREAM_IDLE;
use super::upload::UPLOAD_PARTS;
use super::*;
use exchange::PodKey;

/// The caller's key: its pod, and the ids its call was sent with.
type CallKey = (u32, u32, u32);

/// Where the parts go.
#[derive(Debug, Clone, Copy)]
enum Sink {
    /// Nowhere yet (the chain runs, or the call is on its way to a callee).
    Waiting,
    /// Pod `pod` of this node, which got the opening under `(req_id, step_id)`;
    /// `at_pod` parts delivered and not taken.
    Pod {
        pod: u32,
        req_id: u32,
        step_id: u32,
        at_pod: u8,
    },
    /// A peer over link `qp` reads windows of `buffer` (a slot of the caller's RX
    /// pool the fabric holds) under the call's exchange id `xid`; `busy` windows are
    /// announced and not handed back, the next one written is `next`.
    Peer {
        qp: u32,
        xid: u32,
        buffer: Buffer,
        windows: StreamWindows,
        next: u8,
        busy: u8,
    },
}

/// One streamed request body on its way from a pod's call.
#[derive(Debug)]
pub(super) struct PodUpload {
    /// The caller's opening (its pod, ids and lane; its buffers are gone).
    caller: Descriptor,
    /// Its exchange, once admitted.
    exchange: Option<u32>,
    sink: Sink,
    /// The caller's parts not passed on yet, in order.
    queue: VecDeque<Descriptor>,
    /// Its end was passed on: for a peer, the buffer waits for its windows.
    ended: bool,
    last_moved: Instant,
    idle: Duration,
}

/// The uploads of this shard's pods' calls: by caller, by the key the callee pod
/// acknowledges under, and by link and exchange id.
#[derive(Debug, Default)]
pub(super) struct PodUploads {
    by_caller: HashMap<CallKey, PodUpload>,
    by_pod: HashMap<PodKey, CallKey>,
    by_link: HashMap<(u32, u32), CallKey>,
}

impl PodUploads {
    fn remove(&mut self, key: CallKey) -> Option<PodUpload> {
        let u = self.by_caller.remove(&key)?;
        match u.sink {
            Sink::Pod {
                req_id, step_id, ..
            } => {
                self.by_pod.remove(&(key.0, req_id, step_id));
            }
            Sink::Peer { qp, xid, .. } => {
                self.by_link.remove(&(qp, xid));
            }
            Sink::Waiting => {}
        }
        Some(u)
    }

    /// Uploads open.
    pub fn len(&self) -> usize {
        self.by_caller.len()
    }

    /// Whether the callee pod's acknowledgement under `key` is for one of these.
    pub fn has_pod_ack(&self, key: &PodKey) -> bool {
        self.by_pod.contains_key(key)
    }
}

/// The caller's key of a descriptor it sent.
fn caller_key(d: &Descriptor) -> CallKey {
    (d.src_pod, d.req_id, d.step_id)
}

impl<F: Fabric> Reactor<F> {
    /// A pod's call opened with a streamed body (before its chain runs): its parts
    /// wait here until the call is at its callee.
    pub(super) fn pod_upload_open(&mut self, d: &Descriptor) {
        let mut caller = *d;
        caller.header = Buffer::NONE;
        caller.body = Buffer::NONE;
        self.pod_uploads.by_caller.insert(
            caller_key(d),
            PodUpload {
                caller,
                exchange: None,
                sink: Sink::Waiting,
                queue: VecDeque::new(),
                ended: false,
                last_moved: Instant::now(),
                idle: STREAM_IDLE,
            },
        );
    }

    /// The exchange the upload of call `d` belongs to, once admitted (`None`: it
    /// was answered at once, and its body is not wanted).
    pub(super) fn pod_upload_admitted(&mut self, d: &Descriptor, exchange: Option<u32>) {
        let key = caller_key(d);
        match exchange.filter(|x| self.table.get(*x).is_some()) {
            Some(x) => {
                if let Some(u) = self.pod_uploads.by_caller.get_mut(&key) {
                    u.exchange = Some(x);
                    u.idle = self
                        .table
                        .get(x)
                        .and_then(|e| e.policy.stream_idle)
                        .unwrap_or(STREAM_IDLE);
                }
            }
            None => self.pod_upload_cancel(key, "the call was answered before its body moved"),
        }
    }

    /// A part of a call's streamed body came from the caller.
    pub(super) fn pod_upload_part(&mut self, d: Descriptor) {
        let key = caller_key(&d);
        let Some(u) = self.pod_uploads.by_caller.get_mut(&key) else {
            // Its upload ended (or never opened): the caller is told to stop.
            self.hand_back(&d);
            self.forward(upload_cancel_notice(&d));
            return;
        };
        if u.ended
            || u.queue
                .back()
                .is_some_and(|p| p.stream_part() != Some(StreamPart::Data))
        {
            // Nothing comes after an end.
            self.hand_back(&d);
            return;
        }
        if d.stream_part() == Some(StreamPart::Abort) {
            // The caller gave its body up: the exchange is over (its local reply
            // counts against no upstream, as a client's abort does) and the callee
            // hears the end.
            let exchange = u.exchange;
            self.hand_back(&d);
            if let Some(x) = exchange.filter(|x| self.table.get(*x).is_some()) {
                let e = ProxyError::new(
                    ErrorKind::DownstreamLost,
                    "the call's body did not arrive whole: the caller gave it up",
                );
                self.fail(x, e);
            }
            self.pod_upload_cancel(key, "the caller gave its body up");
            return;
        }
        u.last_moved = Instant::now();
        u.queue.push_back(d);
        self.pod_upload_pump(key);
    }

    /// Case 3 for a call whose body streams (`caller`, as the caller sent it): the
    /// head goes to `pod` as the stream's opening (`out`, the call as it is
    /// delivered, under the try's ids); the parts follow.
    pub(super) fn deliver_pod_upload(
        &mut self,
        xid: u32,
        pod: u32,
        caller: &Descriptor,
        out: Descriptor,
    ) {
        let key = caller_key(caller);
        let mut opening = out;
        opening.kind.stream = true;
        opening.status = StreamPart::OPEN_REQUEST;
        opening.body = Buffer::NONE;
        self.table
            .at_pod(xid, (key.0, out.req_id, out.step_id), pod);
        self.forward(opening);
        let Some(u) = self.pod_uploads.by_caller.get_mut(&key) else {
            // Given up while the chain ran: the callee hears the end.
            let mut abort = opening;
            abort.header = Buffer::NONE;
            abort.status = StreamPart::Abort.code();
            self.forward(abort);
            return;
        };
        u.sink = Sink::Pod {
            pod,
            req_id: out.req_id,
            step_id: out.step_id,
            at_pod: 0,
        };
        u.last_moved = Instant::now();
        self.pod_uploads
            .by_pod
            .insert((key.0, out.req_id, out.step_id), key);
        self.pod_upload_pump(key);
    }

    /// Case 1 for a call whose body streams: a request buffer for the peer to read
    /// windows of (a slot of the caller's RX pool, held by the fabric), or why none.
    pub(super) fn pod_upload_buffer(
        &mut self,
        caller: u32,
    ) -> Result<(Buffer, RemoteBuf), ProxyError> {
        let Some(info) = self.pods.get(caller).cloned() else {
            return Err(ProxyError::new(ErrorKind::Internal, "the caller is gone"));
        };
        // One of its RX slots: those are this side's to allocate (the pod allocates
        // its TX slots itself, and across PCIe the host's words would not know).
        let slot = info.rx_body.alloc(OwnerId::FABRIC).map_err(|e| {
            ProxyError::new(
                ErrorKind::CallerOutOfBuffers,
                format!("no buffer for the call's body: {e}"),
            )
        })?;
        let buffer = Buffer::new(info.rx_body.addr(slot), info.rx_body.layout().slot_size);
        let at = self
            .pods
            .regions(caller, &self.links.fabric, &self.links.pd)
            .and_then(|r| {
                Some(r.rx.remote(r.rx_pool.offset_of(Buffer::new(buffer.addr, 0)).ok()?))
            });
        let Some(at) = at else {
            let _ = info.rx_body.release(slot, OwnerId::FABRIC);
            return Err(ProxyError::new(
                ErrorKind::Internal,
                "the caller's memory cannot be registered",
            ));
        };
        Ok((
            buffer,
            RemoteBuf {
                at,
                len: buffer.len,
            },
        ))
    }

    /// The call went to a peer over `qp` as exchange `xid`, its body to be read from
    /// `buffer`'s windows.
    pub(super) fn pod_upload_to_peer(
        &mut self,
        caller: &Descriptor,
        (qp, xid): (u32, u32),
        buffer: Buffer,
    ) {
        let key = caller_key(caller);
        let Some(u) = self.pod_uploads.by_caller.get_mut(&key) else {
            // Given up meanwhile: the peer hears the end, then gives the buffer back.
            self.send_link(
                qp,
                up_end(xid, ChunkEnd::Abort("the caller gave its body up".into())),
            );
            self.release_rx(caller.src_pod, buffer);
            return;
        };
        u.sink = Sink::Peer {
            qp,
            xid,
            buffer,
            windows: StreamWindows::of(buffer.len),
            next: 0,
            busy: 0,
        };
        u.last_moved = Instant::now();
        self.pod_uploads.by_link.insert((qp, xid), key);
        self.pod_upload_pump(key);
    }

    /// Passes on what waits while the callee has room; passes the end on last.
    fn pod_upload_pump(&mut self, key: CallKey) {
        loop {
            let Some(u) = self.pod_uploads.by_caller.get_mut(&key) else {
                return;
            };
            let Some(&d) = u.queue.front() else {
                return;
            };
            let part = d.stream_part();
            let caller = u.caller;
            match u.sink {
                Sink::Waiting => return,
                Sink::Pod {
                    pod,
                    req_id,
                    step_id,
                    at_pod,
                } => {
                    let mut out = Descriptor::request(
                        Case::PodToPod,
                        req_id,
                        step_id,
                        caller.src_pod,
                        Destination::Pod(pod),
                    );
                    out.kind.stream = true;
                    out.status = d.status;
                    if part == Some(StreamPart::Data) {
                        if d.body.is_none() {
                            u.queue.pop_front();
                            self.hand_back(&d);
                            continue;
                        }
                        if at_pod >= UPLOAD_PARTS {
                            return;
                        }
                        let body = match self.stream_part_into(&d, pod) {
                            Ok(b) => b,
                            Err(dpumesh_dpa::dma::manager::WindowCopyError::Pool(
                                dpumesh_dpa::PoolError::Exhausted { .. },
                            )) => return, // tried again when the callee takes one
                            Err(e) => {
                                tracing::warn!(error = %e, "a call's body part could not be copied to its callee");
                                self.pod_upload_cancel(key, "its part could not be copied");
                                return;
                            }
                        };
                        if let Some(u) = self.pod_uploads.by_caller.get_mut(&key) {
                            u.queue.pop_front();
                            if let Sink::Pod { at_pod, .. } = &mut u.sink {
                                *at_pod += 1;
                            }
                        }
                        self.forward(out.with_body(body));
                        continue;
                    }
                    // The end (its trailers in the header) or an abort: the last.
                    self.pod_uploads.remove(key);
                    if !d.body.is_none() {
                        let mut back = d;
                        back.header = Buffer::NONE;
                        self.hand_back(&back);
                    }
                    self.forward(out.with_header(d.header));
                    return;
                }
                Sink::Peer {
                    qp,
                    xid,
                    buffer,
                    windows,
                    next,
                    busy,
                } => {
                    if part == Some(StreamPart::Data) {
                        if d.body.is_none() {
                            u.queue.pop_front();
                            self.hand_back(&d);
                            continue;
                        }
                        if busy >= windows.count {
                            return;
                        }
                        if d.body.len > windows.size {
                            self.pod_upload_cancel(key, "a part larger than a window");
                            return;
                        }
                        let at = windows.offset(next);
                        if let Err(e) =
                            self.pods
                                .port
                                .copy_into_window(caller.src_pod, d.body, buffer, at)
                        {
                            tracing::warn!(error = %e, "a call's body part could not be copied into its window");
                            self.pod_upload_cancel(key, "its part could not be copied");
                            return;
                        }
                        if let Some(u) = self.pod_uploads.by_caller.get_mut(&key) {
                            u.queue.pop_front();
                            if let Sink::Peer { next, busy, .. } = &mut u.sink {
                                *next = (*next + 1) % windows.count;
                                *busy += 1;
                            }
                        }
                        // The caller's slot goes back under its own ids.
                        self.hand_back(&d);
                        let len = d.body.len;
                        self.send_link(
                            qp,
                            Message::UpChunk(Chunk {
                                xid,
                                window: next,
                                len,
                                end: ChunkEnd::More,
                            }),
                        );
                        continue;
                    }
                    let end = match part {
                        Some(StreamPart::End) if !d.header.is_none() => {
                            ChunkEnd::Last(self.pods.port.header(&d).unwrap_or_default())
                        }
                        Some(StreamPart::End) => ChunkEnd::Last(Vec::new()),
                        _ => ChunkEnd::Abort("the caller gave its body up".into()),
                    };
                    self.hand_back(&d);
                    self.send_link(qp, up_end(xid, end));
                    if let Some(u) = self.pod_uploads.by_caller.get_mut(&key) {
                        u.queue.pop_front();
                        u.ended = true;
                    }
                    self.pod_upload_settle(key);
                    return;
                }
            }
        }
    }

    /// An upload whose end went to a peer leaves once every window came back.
    fn pod_upload_settle(&mut self, key: CallKey) {
        let done = self
            .pod_uploads
            .by_caller
            .get(&key)
            .is_some_and(|u| u.ended && matches!(u.sink, Sink::Peer { busy: 0, .. }));
        if done
            && let Some(u) = self.pod_uploads.remove(key)
            && let Sink::Peer { buffer, .. } = u.sink
        {
            self.release_rx(u.caller.src_pod, buffer);
        }
    }

    /// The callee pod took a part of a call's body, or wants no more.
    pub(super) fn pod_upload_ack(&mut self, d: Descriptor) {
        let Destination::Pod(to) = d.dst else {
            return;
        };
        let Some(&key) = self.pod_uploads.by_pod.get(&(to, d.req_id, d.step_id)) else {
            return;
        };
        let Some(u) = self.pod_uploads.by_caller.get_mut(&key) else {
            return;
        };
        let Sink::Pod { pod, at_pod, .. } = &mut u.sink else {
            return;
        };
        if *pod != d.src_pod {
            tracing::warn!(
                pod = d.src_pod,
                "a pod spoke of a request body it is not sent"
            );
            return;
        }
        u.last_moved = Instant::now();
        match d.stream_part() {
            Some(StreamPart::Taken) => {
                *at_pod = at_pod.saturating_sub(1);
                self.pod_upload_pump(key);
            }
            Some(StreamPart::Stop) => self.pod_upload_cancel(key, "the callee wants no more"),
            _ => {}
        }
    }

    /// The peer read `count` windows of call `xid`'s body.
    pub(super) fn pod_upload_window(&mut self, qp: u32, xid: u32, count: u8) {
        let Some(&key) = self.pod_uploads.by_link.get(&(qp, xid)) else {
            return;
        };
        if let Some(u) = self.pod_uploads.by_caller.get_mut(&key) {
            u.last_moved = Instant::now();
            if let Sink::Peer { busy, .. } = &mut u.sink {
                *busy = busy.saturating_sub(count);
            }
        }
        self.pod_upload_settle(key);
        self.pod_upload_pump(key);
    }

    /// The peer wants no more of call `xid`'s body and reads nothing more of its
    /// buffer.
    pub(super) fn pod_upload_refused(&mut self, qp: u32, xid: u32) {
        let Some(&key) = self.pod_uploads.by_link.get(&(qp, xid)) else {
            return;
        };
        let Some(u) = self.pod_uploads.remove(key) else {
            return;
        };
        if let Sink::Peer { buffer, .. } = u.sink {
            self.release_rx(u.caller.src_pod, buffer);
        }
        self.pod_upload_stop_caller(&u);
    }

    /// Gives an upload up: the caller hears `Cancelled`; a callee pod an abort part;
    /// a peer an abort frame (the buffer goes back at its `UpCancel`).
    pub(super) fn pod_upload_cancel(&mut self, key: CallKey, why: &str) {
        let Some(u) = self.pod_uploads.by_caller.get(&key) else {
            return;
        };
        tracing::debug!(pod = key.0, why, "a call's streamed body ended early");
        match u.sink {
            Sink::Peer { qp, xid, .. } if !u.ended => {
                // Kept (under its link) until the peer's `UpCancel` says nothing more
                // of the buffer is read; nothing more is sent.
                let caller = u.caller;
                let queued: Vec<Descriptor> = u.queue.iter().copied().collect();
                if let Some(u) = self.pod_uploads.by_caller.get_mut(&key) {
                    u.queue.clear();
                    u.ended = true;
                }
                for d in queued {
                    self.hand_back(&d);
                }
                self.forward(upload_cancel_notice(&caller));
                self.send_link(qp, up_end(xid, ChunkEnd::Abort(why.to_owned())));
                self.pod_upload_settle(key);
                return;
            }
            Sink::Peer { .. } => return,
            _ => {}
        }
        let Some(u) = self.pod_uploads.remove(key) else {
            return;
        };
        if let Sink::Pod {
            pod,
            req_id,
            step_id,
            ..
        } = u.sink
        {
            let mut abort = Descriptor::request(
                Case::PodToPod,
                req_id,
                step_id,
                key.0,
                Destination::Pod(pod),
            );
            abort.kind.stream = true;
            abort.status = StreamPart::Abort.code();
            self.forward(abort);
        }
        self.pod_upload_stop_caller(&u);
    }

    /// The caller stops sending; what it sent and is still here goes back.
    fn pod_upload_stop_caller(&mut self, u: &PodUpload) {
        for d in &u.queue {
            self.hand_back(d);
        }
        if !u.ended {
            self.forward(upload_cancel_notice(&u.caller));
        }
    }

    /// Exchange `xid` (a pod's call with a streamed body) ended; its body goes on
    /// only while a streamed answer runs (`answer_streams`).
    pub(super) fn pod_upload_exchange_over(&mut self, caller: &Descriptor, answer_streams: bool) {
        if !answer_streams {
            self.pod_upload_cancel(caller_key(caller), "the call was answered");
        }
    }

    /// The streamed answer to the call `key` ended: what is left of its body is not
    /// wanted.
    pub(super) fn pod_upload_answer_over(&mut self, key: CallKey) {
        if self.pod_uploads.len() > 0 {
            self.pod_upload_cancel(key, "the answer ended");
        }
    }

    /// Link `qp` is gone: its uploads end (their callers hear it); nothing reads the
    /// buffers any more.
    pub(super) fn pod_uploads_link_down(&mut self, qp: u32) {
        let keys: Vec<CallKey> = self
            .pod_uploads
            .by_link
            .iter()
            .filter(|((q, _), _)| *q == qp)
            .map(|(_, k)| *k)
            .collect();
        for key in keys {
            if let Some(u) = self.pod_uploads.remove(key) {
                if let Sink::Peer { buffer, .. } = u.sink {
                    self.release_rx(u.caller.src_pod, buffer);
                }
                self.pod_upload_stop_caller(&u);
            }
        }
    }

    /// Housekeeping: uploads whose caller or callee left, or idle past their limit,
    /// end; the others try again for callee slots that were all in use.
    pub(super) fn expire_pod_uploads(&mut self, live: impl Fn(u32) -> bool) {
        if self.pod_uploads.len() == 0 {
            return;
        }
        let now = Instant::now();
        let mut ended = Vec::new();
        let mut waiting = Vec::new();
        for (k, u) in &self.pod_uploads.by_caller {
            let callee_left = matches!(u.sink, Sink::Pod { pod, .. } if !live(pod));
            if !live(k.0) || callee_left {
                ended.push((*k, "the caller or the callee left"));
            } else if now.duration_since(u.last_moved) >= u.idle {
                ended.push((*k, "the body sat idle too long"));
            } else if !u.queue.is_empty() {
                waiting.push(*k);
            }
        }
        for (key, why) in ended {
            if let Some(x) = self
                .pod_uploads
                .by_caller
                .get(&key)
                .and_then(|u| u.exchange)
                && self.table.get(x).is_some()
            {
                let e = ProxyError::new(
                    ErrorKind::DownstreamLost,
                    format!("the call's body did not arrive whole: {why}"),
                );
                self.fail(x, e);
            }
            self.pod_upload_cancel(key, why);
        }
        for key in waiting {
            self.pod_upload_pump(key);
        }
    }
}

/// The frame that ends a call's body over a link.
fn up_end(xid: u32, end: ChunkEnd) -> Message {
    Message::UpChunk(Chunk {
        xid,
        window: 0,
        len: 0,
        end,
    })
}

/// What tells the pod that sent a call's streamed body (any part of it: its ids and
/// lane) to send no more: an error with `Cancelled` and no buffers, in the request's
/// direction, which the DMA manager delivers to the pod.
fn upload_cancel_notice(part: &Descriptor) -> Descriptor {
    let mut notice = super::stream::cancel_notice(part);
    notice.kind.response = false;
    notice
}

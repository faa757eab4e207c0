//! Streamed answers to pods' calls: a download, server-sent events or a gRPC server
//! stream that a pod of this node asked another service for, relayed part by part
//! into the caller's RX body pool.
//!
//! - **From a pod of this node** (case 3): the callee's parts, each in one of its TX
//!   body slots, are handed to the DMA manager with the caller's ids; it copies each
//!   straight into one of the caller's RX body slots and gives the callee its slot
//!   back (which opens the callee's own window of parts in flight).
//! - **From another node** (case 1): the peer writes each part into a window of the
//!   reply slot the call lent it (one of the caller's RX body slots) and announces it
//!   (`Chunk`). The window is copied into a slot of its own, delivered, and handed
//!   back to the peer (`Window`), which may then write it again.
//!
//! Either way at most [`AT_CALLER`] parts are at the caller and not yet taken (the
//! caller's host library says `Taken` when its reader takes one): the rest wait
//! where they are, in the callee's slots or the peer's windows, so a caller that
//! reads slowly slows the callee and nothing grows in between.
//!
//! A stream ends with its last part (trailers with it) or abort; with the caller's
//! `Stop` (its reader left, or the answer grew past what it collects whole); when the
//! caller, the callee or the link goes; after the route's `stream_idle_timeout` with
//! nothing moving; or, for a gRPC call, at its deadline (DEADLINE_EXCEEDED in the
//! trailers). The caller hears an end or an abort part; the callee `Cancelled`; the
//! peer `Cancel`, after which the reply slot is kept as an orphan until the peer's
//! last frame for the stream says nothing more is written into it.

use std::collections::VecDeque;

use dpumesh_dpa::StreamPart;
use dpumesh_dpa::frame::{Chunk, ChunkEnd, StreamWindows};

use super::stream::{STREAM_IDLE, cancel_notice};
use super::*;
use exchange::PodKey;

/// Parts of one stream at its caller, delivered and not taken.
pub(super) const AT_CALLER: u8 = 4;

/// The caller's key: its pod, and the ids its call was sent with.
type CallKey = (u32, u32, u32);

/// Where the answer comes from.
#[derive(Debug)]
enum Source {
    /// Pod `pod` of this node, whose parts name the stream by `key`; `opening` tells
    /// it to stop.
    Pod {
        pod: u32,
        key: PodKey,
        opening: Descriptor,
    },
    /// A peer proxy over link `qp`, writing into windows of `reply` (a slot of the
    /// caller's RX body pool the fabric holds) under the call's exchange id `xid`.
    Peer {
        qp: u32,
        xid: u32,
        reply: Buffer,
        windows: StreamWindows,
    },
}

/// A part waiting for room at the caller, in order.
#[derive(Debug)]
enum Waiting {
    /// A part of a pod's stream (its body still in the pod's TX pool).
    Pod(Descriptor),
    /// `len` bytes the peer wrote into window `window`.
    Window { window: u8, len: u32 },
    /// The peer's end of the stream.
    End(ChunkEnd),
}

/// One streamed answer on its way to a pod's call.
#[derive(Debug)]
pub(super) struct CallStream {
    /// The call as the shard took it (its pod, ids and lane; its buffers are gone).
    caller: Descriptor,
    source: Source,
    /// Parts delivered to the caller and not taken yet.
    at_caller: u8,
    queue: VecDeque<Waiting>,
    last_moved: Instant,
    idle: Duration,
    /// A gRPC call's deadline (`grpc-timeout`).
    deadline: Option<Instant>,
    /// Counted by gRPC status when it ends (a gRPC call's service).
    grpc_service: Option<String>,
}

/// The streams this shard relays to pods' calls: by the caller, by the callee pod's
/// key, and by link and exchange id.
#[derive(Debug, Default)]
pub(super) struct CallStreams {
    by_caller: HashMap<CallKey, CallStream>,
    by_pod: HashMap<PodKey, CallKey>,
    by_link: HashMap<(u32, u32), CallKey>,
}

impl CallStreams {
    fn insert(&mut self, key: CallKey, s: CallStream) {
        match &s.source {
            Source::Pod { key: pod_key, .. } => {
                self.by_pod.insert(*pod_key, key);
            }
            Source::Peer { qp, xid, .. } => {
                self.by_link.insert((*qp, *xid), key);
            }
        }
        self.by_caller.insert(key, s);
    }

    fn remove(&mut self, key: CallKey) -> Option<CallStream> {
        let s = self.by_caller.remove(&key)?;
        match &s.source {
            Source::Pod { key: pod_key, .. } => {
                self.by_pod.remove(pod_key);
            }
            Source::Peer { qp, xid, .. } => {
                self.by_link.remove(&(*qp, *xid));
            }
        }
        Some(s)
    }

    /// Streams open.
    pub fn len(&self) -> usize {
        self.by_caller.len()
    }

    /// Whether a pod's stream part under `key` belongs to one of these streams.
    pub fn has_pod_stream(&self, key: &PodKey) -> bool {
        self.by_pod.contains_key(key)
    }

    /// Whether link `qp`'s stream `xid` is one of these.
    pub fn has_link_stream(&self, qp: u32, xid: u32) -> bool {
        self.by_link.contains_key(&(qp, xid))
    }
}

/// What the caller is told when its stream ends early.
enum Close {
    /// An abort part: the body is incomplete.
    Abort,
    /// The end, with these trailers (a head's trailer section): a gRPC deadline.
    End(Vec<u8>),
    /// Nothing (the caller left, or said `Stop`).
    Nothing,
}

impl<F: Fabric> Reactor<F> {
    /// A pod of this node opened a streamed answer to `exchange`, a call pod
    /// `request.src_pod` made (case 3): the head goes to the caller now, the body
    /// follows part by part.
    pub(super) fn open_call_stream_from_pod(
        &mut self,
        request: Descriptor,
        exchange: &Exchange,
        d: Descriptor,
    ) {
        let Destination::Pod(to) = d.dst else {
            self.refuse_stream(&d);
            return;
        };
        // What the body had ready goes with the head, in a slot of the caller's.
        let body = match self.stream_part_into(&d, request.src_pod) {
            Ok(body) => body,
            Err(e) => {
                tracing::warn!(error = %e, "a streamed answer's first part could not be copied to its caller");
                self.refuse_stream(&d);
                let e = ProxyError::new(
                    ErrorKind::CallerOutOfBuffers,
                    format!("no buffer for the answer: {e}"),
                );
                self.reply_pod(&request, &e.response_head(), e.body());
                return;
            }
        };
        let key = (request.src_pod, request.req_id, request.step_id);
        let source = Source::Pod {
            pod: d.src_pod,
            key: (to, d.req_id, d.step_id),
            opening: d,
        };
        self.call_streams
            .insert(key, call_stream(request, source, exchange));
        let mut opening = to_caller(&request, StreamPart::Open)
            .with_header(d.header)
            .with_body(body);
        opening.status = d.status;
        self.forward(opening);
    }

    /// A stream part's body (in its sender's TX pool) copied into a slot of pod
    /// `to`'s RX pool (none without one); the sender gets the part's slot back under
    /// its own ids (its window of parts in flight counts them).
    pub(super) fn stream_part_into(
        &mut self,
        d: &Descriptor,
        to: u32,
    ) -> Result<Buffer, dpumesh_dpa::dma::manager::WindowCopyError> {
        if d.body.is_none() {
            return Ok(Buffer::NONE);
        }
        let body = self.pods.port.copy_tx_to_rx(d.src_pod, d.body, to)?;
        let mut back = *d;
        back.header = Buffer::NONE;
        self.hand_back(&back);
        Ok(body)
    }

    /// A peer answered a call pod `request.src_pod` made with a streamed body (case
    /// 1): its head, `status`, goes to the caller now (`header`, in a DPU pool); the
    /// peer writes the body into windows of `reply`.
    pub(super) fn open_call_stream_from_peer(
        &mut self,
        (qp, xid, reply): (u32, u32, Buffer),
        request: Descriptor,
        exchange: &Exchange,
        (status, header): (u16, Buffer),
    ) {
        let windows = StreamWindows::of(reply.len);
        let key = (request.src_pod, request.req_id, request.step_id);
        let source = Source::Peer {
            qp,
            xid,
            reply,
            windows,
        };
        // The peer's frames name the exchange's id until the stream ends.
        self.table.hold_xid(xid);
        self.call_streams
            .insert(key, call_stream(request, source, exchange));
        let mut opening = to_caller(&request, StreamPart::Open).with_header(header);
        opening.status = status;
        self.forward(opening);
    }

    /// A part of a stream to a pod's call came from the callee pod.
    pub(super) fn call_stream_part(&mut self, pod_key: PodKey, d: Descriptor) {
        let Some(&key) = self.call_streams.by_pod.get(&pod_key) else {
            self.hand_back(&d);
            return;
        };
        let from_callee = matches!(
            self.call_streams.by_caller.get(&key).map(|s| &s.source),
            Some(Source::Pod { pod, .. }) if *pod == d.src_pod
        );
        if !from_callee {
            tracing::warn!(
                pod = d.src_pod,
                "a pod sent a part of a stream it does not send"
            );
            self.hand_back(&d);
            return;
        }
        self.call_stream_enqueue(key, Waiting::Pod(d));
    }

    /// A frame of a stream to a pod's call came from the peer.
    pub(super) fn call_stream_chunk(&mut self, qp: u32, c: Chunk) {
        let Some(&key) = self.call_streams.by_link.get(&(qp, c.xid)) else {
            return;
        };
        let Some(Source::Peer { windows, .. }) =
            self.call_streams.by_caller.get(&key).map(|s| &s.source)
        else {
            return;
        };
        if c.len > 0 {
            if c.window >= windows.count || c.len > windows.size {
                // The peer broke the protocol: nothing it was lent is reused until
                // its link is gone (as the ingress does with such a node).
                tracing::warn!(
                    qp,
                    window = c.window,
                    len = c.len,
                    "a peer's stream part lies outside its windows"
                );
                self.link_down(qp, "a stream part outside its windows".into());
                return;
            }
            self.call_stream_enqueue(
                key,
                Waiting::Window {
                    window: c.window,
                    len: c.len,
                },
            );
        }
        if !matches!(c.end, ChunkEnd::More) {
            self.call_stream_enqueue(key, Waiting::End(c.end));
        }
    }

    /// The caller said what it did with a part (`Taken`) or that it wants no more
    /// (`Stop`).
    pub(super) fn call_stream_ack(&mut self, d: Descriptor) {
        let key = (d.src_pod, d.req_id, d.step_id);
        match d.stream_part() {
            Some(StreamPart::Taken) => {
                if let Some(s) = self.call_streams.by_caller.get_mut(&key) {
                    s.at_caller = s.at_caller.saturating_sub(1);
                    s.last_moved = Instant::now();
                }
                self.call_stream_pump(key);
            }
            Some(StreamPart::Stop) => {
                self.call_stream_close(key, Close::Nothing, "the caller wants no more");
            }
            // The DMA manager lets nothing else through in this direction.
            _ => {}
        }
    }

    fn call_stream_enqueue(&mut self, key: CallKey, w: Waiting) {
        if let Some(s) = self.call_streams.by_caller.get_mut(&key) {
            s.last_moved = Instant::now();
            s.queue.push_back(w);
        }
        self.call_stream_pump(key);
    }

    /// Delivers what waits, in order, while the caller has room; ends the stream at
    /// its end.
    fn call_stream_pump(&mut self, key: CallKey) {
        loop {
            let Some(s) = self.call_streams.by_caller.get_mut(&key) else {
                return;
            };
            let Some(front) = s.queue.front() else {
                return;
            };
            let caller = s.caller;
            match *front {
                Waiting::Pod(d) => {
                    let part = d.stream_part();
                    let data = matches!(part, Some(StreamPart::Data));
                    if data && d.body.is_none() {
                        // Nothing to deliver: its slots go back.
                        s.queue.pop_front();
                        self.hand_back(&d);
                        continue;
                    }
                    if data && s.at_caller >= AT_CALLER {
                        return;
                    }
                    if data {
                        let copied = self.stream_part_into(&d, caller.src_pod);
                        if !self.deliver_copy(key, &caller, copied) {
                            return;
                        }
                        continue;
                    }
                    s.queue.pop_front();
                    // Its end (trailers in its header) or abort: the last part.
                    let ended = matches!(part, Some(StreamPart::End));
                    let trailers = (ended && !d.header.is_none())
                        .then(|| self.pods.port.header(&d).ok())
                        .flatten();
                    if let Some(s) = self.call_streams.remove(key) {
                        self.count_grpc(&s, ended.then(|| trailers.unwrap_or_default()));
                    }
                    self.pod_upload_answer_over(key);
                    let out = if ended {
                        if !d.body.is_none() {
                            // An end carries no body: what it named goes back.
                            let mut back = d;
                            back.header = Buffer::NONE;
                            self.hand_back(&back);
                        }
                        to_caller(&caller, StreamPart::End).with_header(d.header)
                    } else {
                        self.hand_back(&d);
                        to_caller(&caller, StreamPart::Abort)
                    };
                    self.forward(out);
                    return;
                }
                Waiting::Window { window, len } => {
                    if s.at_caller >= AT_CALLER {
                        return;
                    }
                    let Source::Peer {
                        qp,
                        xid,
                        reply,
                        windows,
                    } = s.source
                    else {
                        return;
                    };
                    let copied = self.pods.port.copy_rx_window(
                        caller.src_pod,
                        reply,
                        windows.offset(window),
                        len,
                    );
                    if !self.deliver_copy(key, &caller, copied) {
                        return;
                    }
                    self.send_link(qp, Message::Window { xid, count: 1 });
                }
                Waiting::End(ref end) => {
                    let end = end.clone();
                    let Some(s) = self.call_streams.remove(key) else {
                        return;
                    };
                    self.pod_upload_answer_over(key);
                    let Source::Peer { xid, reply, .. } = s.source else {
                        return;
                    };
                    // The peer's last frame: nothing more is written into the reply
                    // slot.
                    self.table.release_xid(xid);
                    self.release_rx(caller.src_pod, reply);
                    let out = match end {
                        ChunkEnd::Last(trailers) => {
                            self.count_grpc(&s, Some(trailers.clone()));
                            self.end_part(&caller, &trailers)
                        }
                        _ => {
                            self.count_grpc(&s, None);
                            to_caller(&caller, StreamPart::Abort)
                        }
                    };
                    self.forward(out);
                    return;
                }
            }
        }
    }

    /// Delivers a part copied into a slot of the caller's (the queue's front) and
    /// counts it at the caller; whether it did. A caller whose pool is full is tried
    /// again when it takes a part, or at housekeeping; any other failure ends the
    /// stream.
    fn deliver_copy(
        &mut self,
        key: CallKey,
        caller: &Descriptor,
        copied: Result<Buffer, dpumesh_dpa::dma::manager::WindowCopyError>,
    ) -> bool {
        let body = match copied {
            Ok(body) => body,
            Err(dpumesh_dpa::dma::manager::WindowCopyError::Pool(
                dpumesh_dpa::PoolError::Exhausted { .. },
            )) => return false,
            Err(e) => {
                tracing::warn!(error = %e, "a streamed answer's part could not be copied to its caller");
                self.call_stream_close(key, Close::Abort, "its part could not be copied");
                return false;
            }
        };
        if let Some(s) = self.call_streams.by_caller.get_mut(&key) {
            s.queue.pop_front();
            s.at_caller += 1;
        }
        self.forward(to_caller(caller, StreamPart::Data).with_body(body));
        true
    }

    /// The end part for `caller`, with `trailers` (a head's trailer section; empty:
    /// none) in a DPU header slot; an abort if they cannot be carried.
    fn end_part(&mut self, caller: &Descriptor, trailers: &[u8]) -> Descriptor {
        if trailers.is_empty() {
            return to_caller(caller, StreamPart::End);
        }
        match self.pods.port.alloc_header(trailers) {
            Ok(h) => to_caller(caller, StreamPart::End).with_header(h),
            Err(e) => {
                tracing::warn!(error = %e, "a streamed answer's trailers found no header slot");
                to_caller(caller, StreamPart::Abort)
            }
        }
    }

    /// Counts a gRPC call's stream by the status its trailers carry (`None`: it
    /// ended without them, as UNKNOWN).
    fn count_grpc(&mut self, s: &CallStream, trailers: Option<Vec<u8>>) {
        let Some(service) = &s.grpc_service else {
            return;
        };
        let status = trailers
            .and_then(|t| wire::decode_response(&t).ok())
            .map_or(2, |h| dpumesh_head::grpc::status_of(&h));
        self.meter.response_metrics.record_grpc(service, status);
    }

    /// Ends a stream that did not end by itself: the caller hears `close`, the callee
    /// pod `Cancelled`, the peer `Cancel` (its reply slot kept until its last frame).
    fn call_stream_close(&mut self, key: CallKey, close: Close, why: &str) {
        let Some(s) = self.call_streams.remove(key) else {
            return;
        };
        tracing::debug!(
            pod = s.caller.src_pod,
            why,
            "a streamed answer to a call ended early"
        );
        self.pod_upload_answer_over(key);
        self.call_stream_stop_source(&s);
        let grpc = match &close {
            Close::End(trailers) => Some(trailers.clone()),
            _ => None,
        };
        self.count_grpc(&s, grpc);
        match close {
            Close::Abort => self.forward(to_caller(&s.caller, StreamPart::Abort)),
            Close::End(trailers) => {
                let end = self.end_part(&s.caller, &trailers);
                self.forward(end);
            }
            Close::Nothing => {}
        }
    }

    /// Tells a stream's source to stop and gives back what waited of it.
    fn call_stream_stop_source(&mut self, s: &CallStream) {
        match s.source {
            Source::Pod { opening, .. } => {
                for w in &s.queue {
                    if let Waiting::Pod(d) = w {
                        self.hand_back(d);
                    }
                }
                self.forward(cancel_notice(&opening));
            }
            Source::Peer { qp, xid, reply, .. } => {
                self.table.release_xid(xid);
                if s.queue.iter().any(|w| matches!(w, Waiting::End(_))) {
                    // Its last frame came already: nothing more is written.
                    self.release_rx(s.caller.src_pod, reply);
                    return;
                }
                if !self.links.by_qp.contains_key(&qp) {
                    self.release_rx(s.caller.src_pod, reply);
                    return;
                }
                self.send_link(qp, Message::Cancel { xid });
                self.table.orphan(
                    xid,
                    Orphan {
                        qp,
                        d: s.caller,
                        reply_slot: reply,
                    },
                );
            }
        }
    }

    /// A part could not reach its caller (it left, its ring stays full): the stream
    /// ends.
    pub(super) fn call_stream_undelivered(&mut self, d: &Descriptor) {
        let Destination::Pod(pod) = d.dst else {
            return;
        };
        let key = (pod, d.req_id, d.step_id);
        self.call_stream_close(key, Close::Nothing, "a part could not reach the caller");
    }

    /// Link `qp` is gone: the streams it brought end (their callers hear an abort).
    pub(super) fn call_streams_link_down(&mut self, qp: u32) {
        let keys: Vec<CallKey> = self
            .call_streams
            .by_link
            .iter()
            .filter(|((q, _), _)| *q == qp)
            .map(|(_, k)| *k)
            .collect();
        for key in keys {
            self.pod_upload_answer_over(key);
            if let Some(s) = self.call_streams.remove(key)
                && let Source::Peer { xid, reply, .. } = s.source
            {
                // Nothing writes into the reply slot any more.
                self.table.release_xid(xid);
                self.release_rx(s.caller.src_pod, reply);
                self.count_grpc(&s, None);
                self.forward(to_caller(&s.caller, StreamPart::Abort));
            }
        }
    }

    /// Housekeeping: streams whose caller or callee left, idle past their limit, or
    /// past a gRPC call's deadline; and parts waiting for room in a caller's pool.
    pub(super) fn expire_call_streams(&mut self, live: impl Fn(u32) -> bool) {
        if self.call_streams.len() == 0 {
            return;
        }
        let now = Instant::now();
        let mut ended = Vec::new();
        let mut waiting = Vec::new();
        for (k, s) in &self.call_streams.by_caller {
            let callee_left = matches!(s.source, Source::Pod { pod, .. } if !live(pod));
            if !live(s.caller.src_pod) {
                ended.push((*k, Close::Nothing, "the caller left mid-stream"));
            } else if callee_left {
                ended.push((*k, Close::Abort, "the service left mid-stream"));
            } else if s.deadline.is_some_and(|d| now >= d) {
                ended.push((
                    *k,
                    Close::End(deadline_trailers()),
                    "the call's deadline passed",
                ));
            } else if now.duration_since(s.last_moved) >= s.idle {
                ended.push((*k, Close::Abort, "the stream sat idle too long"));
            } else if !s.queue.is_empty() {
                waiting.push(*k);
            }
        }
        for (key, close, why) in ended {
            self.call_stream_close(key, close, why);
        }
        for key in waiting {
            self.call_stream_pump(key);
        }
    }
}

/// A new stream to `caller` from `source`, for `exchange`'s route.
fn call_stream(caller: Descriptor, source: Source, exchange: &Exchange) -> CallStream {
    // What the call named was handed back (or moved on) already.
    let mut caller = caller;
    caller.header = Buffer::NONE;
    caller.body = Buffer::NONE;
    CallStream {
        caller,
        source,
        at_caller: 0,
        queue: VecDeque::new(),
        last_moved: Instant::now(),
        idle: exchange.policy.stream_idle.unwrap_or(STREAM_IDLE),
        deadline: exchange.traits.grpc_timeout.map(|t| exchange.started + t),
        grpc_service: exchange.traits.grpc.then(|| exchange.service.clone()),
    }
}

/// A part of kind `part` for `caller`'s stream (no buffers yet).
fn to_caller(caller: &Descriptor, part: StreamPart) -> Descriptor {
    let mut d = Descriptor::request(
        Case::ExternalToHost,
        caller.req_id,
        caller.step_id,
        0,
        Destination::Pod(caller.src_pod),
    );
    d.kind.response = true;
    d.kind.stream = true;
    d.status = part.code();
    d
}

/// The trailers a gRPC stream ends with at its deadline: DEADLINE_EXCEEDED.
fn deadline_trailers() -> Vec<u8> {
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", HeaderValue::from_static("4"));
    trailers.insert(
        "grpc-message",
        HeaderValue::from_static("the call's deadline passed mid-stream"),
    );
    let head = ResponseHead {
        status: 200,
        headers: HeaderMap::new(),
        trailers,
    };
    wire::encode_response(&head).unwrap_or_default()
}

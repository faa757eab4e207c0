//! Streamed answers relayed from a pod to a link (the ingress): the pod's parts, each
//! in one of its TX body slots, are RDMA-written into the windows of the request's
//! reply buffer and announced with a `Chunk` frame each; a window is written again
//! once the receiver hands it back (`Window`). The parts waiting for a window stay in
//! the pod's slots, and the pod sends no more than its own window of parts, so a
//! client that reads slowly slows the pod and nothing grows in between.
//!
//! A stream ends with the pod's last part (its trailers go in the `Chunk` that ends
//! it), with an abort (the pod's, or the proxy's when the pod leaves or the stream
//! sits idle past its route's `stream_idle_timeout`, [`STREAM_IDLE`] by default), or
//! with the receiver's `Cancel` (its client
//! left): the pod hears `Cancelled` and drops the body, and the receiver gets a last
//! abort frame, after which nothing writes into its reply buffer any more.

use std::collections::VecDeque;

use dpumesh_dpa::frame::{Chunk, ChunkEnd, StreamWindows};
use dpumesh_dpa::{DescriptorStatus, StreamPart};

use super::*;

/// How long a stream may go with nothing moving (no part from the pod, no window
/// handed back) before it is aborted, when its route does not say (Envoy's
/// `stream_idle_timeout` default).
pub(super) const STREAM_IDLE: Duration = Duration::from_secs(300);

/// Why a gRPC call's stream ended at its deadline.
const DEADLINE: &str = "the call's deadline passed";

/// A pod's part waiting for (or being written into) the receiver's windows.
#[derive(Debug)]
struct Waiting {
    d: Descriptor,
    /// Bytes of its body written so far.
    written: u32,
}

/// One streamed answer on its way to a link.
#[derive(Debug)]
pub(super) struct RelayStream {
    qp: u32,
    /// The receiver's id for the stream (its request's exchange id).
    xid: u32,
    reply: RemoteBuf,
    windows: StreamWindows,
    /// The next window to write, and how many are written and not handed back.
    next: u8,
    busy: u8,
    /// The pod sending it (its parts must come from it).
    pod: u32,
    /// The opening (its ids and lane), for the pod's cancel notice.
    opening: Descriptor,
    queue: VecDeque<Waiting>,
    last_moved: Instant,
    /// Its route's idle limit.
    idle: Duration,
    /// A gRPC call's deadline (`grpc-timeout`): past it, the stream ends with
    /// DEADLINE_EXCEEDED in its trailers.
    deadline: Option<Instant>,
    /// Counted by gRPC status when it ends (a gRPC call's service).
    grpc_service: Option<String>,
}

/// The streams this shard relays: by the pod's answer key, and by link and xid.
#[derive(Debug, Default)]
pub(super) struct Streams {
    by_pod: HashMap<PodKey, RelayStream>,
    by_link: HashMap<(u32, u32), PodKey>,
}

impl Streams {
    fn remove(&mut self, key: PodKey) -> Option<RelayStream> {
        let s = self.by_pod.remove(&key)?;
        self.by_link.remove(&(s.qp, s.xid));
        Some(s)
    }

    /// Streams open.
    pub fn len(&self) -> usize {
        self.by_pod.len()
    }
}

use exchange::PodKey;

impl<F: Fabric> Reactor<F> {
    /// A pod opened a streamed answer to `exchange`, whose request came over link
    /// `qp`: the head goes now, the body follows part by part.
    pub(super) fn open_stream(
        &mut self,
        (qp, peer_xid, reply): (u32, u32, RemoteBuf),
        exchange: &Exchange,
        d: Descriptor,
        header: Vec<u8>,
    ) {
        let grpc_service = exchange.traits.grpc.then(|| exchange.service.clone());
        let idle = exchange.policy.stream_idle.unwrap_or(STREAM_IDLE);
        let deadline = exchange.traits.grpc_timeout.map(|t| exchange.started + t);
        let windows = StreamWindows::of(reply.len);
        let Destination::Pod(to) = d.dst else {
            self.refuse_stream(&d);
            return;
        };
        if windows.count == 0 {
            self.refuse_stream(&d);
            let e = ProxyError::new(
                ErrorKind::BadResponse,
                "the caller left no room for a streamed answer",
            );
            self.send_local(qp, peer_xid, &e.response_head(), e.body());
            return;
        }
        self.send_link(
            qp,
            Message::Response(Response {
                xid: peer_xid,
                body: ResponseBody::Stream,
                head: header,
            }),
        );
        let key = (to, d.req_id, d.step_id);
        self.streams.by_link.insert((qp, peer_xid), key);
        self.streams.by_pod.insert(
            key,
            RelayStream {
                qp,
                xid: peer_xid,
                reply,
                windows,
                next: 0,
                busy: 0,
                pod: d.src_pod,
                opening: d,
                queue: VecDeque::new(),
                last_moved: Instant::now(),
                idle,
                deadline,
                grpc_service,
            },
        );
        if d.body.is_none() {
            // Its header slot (the head) goes back now; there is no body to write.
            self.hand_back(&d);
        } else {
            self.stream_enqueue(key, d);
        }
    }

    /// A part of a streamed answer came from a pod.
    pub(super) fn stream_part(&mut self, d: Descriptor) {
        let key = match d.dst {
            Destination::Pod(to) => (to, d.req_id, d.step_id),
            Destination::External(_) => {
                self.hand_back(&d);
                return;
            }
        };
        match self.streams.by_pod.get(&key) {
            Some(s) if s.pod == d.src_pod => self.stream_enqueue(key, d),
            None if self.call_streams.has_pod_stream(&key) => self.call_stream_part(key, d),
            Some(_) => {
                tracing::warn!(
                    pod = d.src_pod,
                    "a pod sent a part of a stream it does not send"
                );
                self.hand_back(&d);
            }
            // Its stream ended (cancelled, timed out): the pod heard it, or will.
            None => self.hand_back(&d),
        }
    }

    fn stream_enqueue(&mut self, key: PodKey, d: Descriptor) {
        if let Some(s) = self.streams.by_pod.get_mut(&key) {
            s.last_moved = Instant::now();
            s.queue.push_back(Waiting { d, written: 0 });
        }
        self.stream_pump(key);
    }

    /// Writes what waits into free windows, in order; ends the stream at its end.
    fn stream_pump(&mut self, key: PodKey) {
        loop {
            let Some(s) = self.streams.by_pod.get_mut(&key) else {
                return;
            };
            let Some(front) = s.queue.front_mut() else {
                return;
            };
            let d = front.d;
            let left = d.body.len - front.written;
            if left > 0 {
                if s.busy >= s.windows.count {
                    return;
                }
                let piece = left.min(s.windows.size);
                let window = s.next;
                let at = dpumesh_dpa::fabric::RemoteAddr {
                    addr: s.reply.at.addr + s.windows.offset(window),
                    rkey: s.reply.at.rkey,
                };
                let from = front.written;
                front.written += piece;
                let whole = front.written == d.body.len;
                s.next = (s.next + 1) % s.windows.count;
                s.busy += 1;
                s.last_moved = Instant::now();
                let (qp, xid) = (s.qp, s.xid);
                // The part's slots go back when its last piece is written.
                let part = d.stream_part();
                let done = whole.then_some(d);
                if let Err(e) = self.stream_write(qp, &d, from, piece, at, done) {
                    self.stream_abort(key, &e.to_string(), true);
                    return;
                }
                self.send_link(
                    qp,
                    Message::Chunk(Chunk {
                        xid,
                        window,
                        len: piece,
                        end: ChunkEnd::More,
                    }),
                );
                if !whole {
                    continue;
                }
                if !matches!(part, Some(StreamPart::End | StreamPart::Abort)) {
                    if let Some(s) = self.streams.by_pod.get_mut(&key) {
                        s.queue.pop_front();
                    }
                    continue;
                }
            }
            // The part's body is written (or it had none): an end or an abort ends
            // the stream; an empty data part is only handed back.
            match d.stream_part() {
                Some(StreamPart::End) => {
                    let trailers = self.pods.port.header(&d).unwrap_or_default();
                    self.stream_finish(key, ChunkEnd::Last(trailers), &d);
                    return;
                }
                Some(StreamPart::Abort) => {
                    let why = "the service gave the stream up".to_owned();
                    self.stream_finish(key, ChunkEnd::Abort(why), &d);
                    return;
                }
                _ => {
                    if let Some(s) = self.streams.by_pod.get_mut(&key) {
                        s.queue.pop_front();
                    }
                    // A part with no body (one with a body left above).
                    self.hand_back(&d);
                }
            }
        }
    }

    /// RDMA-WRITEs `len` bytes of `d`'s body (from `from`) to `at`; `done` is handed
    /// back when the write completes.
    fn stream_write(
        &mut self,
        qp: u32,
        d: &Descriptor,
        from: u32,
        len: u32,
        at: dpumesh_dpa::fabric::RemoteAddr,
        done: Option<Descriptor>,
    ) -> Result<(), ProxyError> {
        // Across PCIe the fabric reads the part from the node's staging copy.
        self.pods
            .port
            .stage_tx(d.src_pod, d.body, from, len)
            .map_err(|e| {
                ProxyError::new(
                    ErrorKind::Internal,
                    format!("the service's stream part could not be staged: {e}"),
                )
            })?;
        let Some(regions) = self
            .pods
            .regions(d.src_pod, &self.links.fabric, &self.links.pd)
        else {
            return Err(ProxyError::new(
                ErrorKind::Internal,
                "the service's memory cannot be registered",
            ));
        };
        let Ok(offset) = regions.tx_pool.offset_of(d.body) else {
            return Err(ProxyError::new(
                ErrorKind::BadResponse,
                "the service's stream part is not in its pool",
            ));
        };
        let sge = regions.tx.sge(offset + u64::from(from), len);
        let token = self.table.next_token();
        let Some(state) = self.links.by_qp.get_mut(&qp) else {
            return Err(ProxyError::new(
                ErrorKind::DownstreamLost,
                "the link the request came on is gone",
            ));
        };
        if state.link.write(sge, at, token).is_err() {
            return Err(ProxyError::new(
                ErrorKind::DownstreamLost,
                "the stream's part could not be written",
            ));
        }
        self.table.track(token, Transfer::StreamWrite { qp, done });
        Ok(())
    }

    /// The pod's last part (or abort) is through: the frame that ends the stream
    /// goes, the part's slots go back (after their write), the stream leaves.
    fn stream_finish(&mut self, key: PodKey, end: ChunkEnd, last: &Descriptor) {
        let Some(s) = self.streams.remove(key) else {
            return;
        };
        self.upload_answer_over(s.qp, s.xid);
        if let Some(service) = &s.grpc_service {
            let status = match &end {
                ChunkEnd::Last(trailers) => {
                    wire::decode_response(trailers).map_or(2, |h| dpumesh_head::grpc::status_of(&h))
                }
                _ => 2,
            };
            self.meter.response_metrics.record_grpc(service, status);
        }
        self.send_end(s.qp, s.xid, end);
        // A part with a body goes back when its last piece is written (its write
        // holds it); one without goes back now.
        if last.body.is_none() {
            self.hand_back(last);
        }
    }

    /// The receiver handed `count` windows of stream `xid` back.
    pub(super) fn stream_window(&mut self, qp: u32, xid: u32, count: u8) {
        let Some(&key) = self.streams.by_link.get(&(qp, xid)) else {
            return;
        };
        if let Some(s) = self.streams.by_pod.get_mut(&key) {
            s.busy = s.busy.saturating_sub(count);
            s.last_moved = Instant::now();
        }
        self.stream_pump(key);
    }

    /// The receiver gave stream `xid` up (its client left).
    pub(super) fn stream_cancel(&mut self, qp: u32, xid: u32) {
        let Some(&key) = self.streams.by_link.get(&(qp, xid)) else {
            return;
        };
        self.stream_abort(key, "cancelled by the receiver", true);
    }

    /// Ends a stream that did not end by itself: the pod hears `Cancelled`; the
    /// receiver gets a last abort frame when `tell_link` (its link is still up).
    fn stream_abort(&mut self, key: PodKey, why: &str, tell_link: bool) {
        let Some(s) = self.streams.remove(key) else {
            return;
        };
        tracing::debug!(pod = s.pod, why, "a streamed answer ended early");
        if tell_link {
            self.upload_answer_over(s.qp, s.xid);
        }
        for w in s.queue {
            self.hand_back(&w.d);
        }
        self.forward(cancel_notice(&s.opening));
        if let Some(service) = &s.grpc_service {
            self.meter.response_metrics.record_grpc(service, 2);
        }
        if tell_link {
            self.send_end(s.qp, s.xid, ChunkEnd::Abort(why.to_owned()));
        }
    }

    /// A stream opening nobody takes (its exchange ended, or it came for a caller
    /// that cannot take streams): handed back, and the pod told to stop.
    pub(super) fn refuse_stream(&mut self, d: &Descriptor) {
        self.hand_back(d);
        self.forward(cancel_notice(d));
    }

    /// The frame after which stream `xid` writes nothing more into its receiver's
    /// buffer.
    fn send_end(&mut self, qp: u32, xid: u32, end: ChunkEnd) {
        let chunk = Chunk {
            xid,
            window: 0,
            len: 0,
            end,
        };
        self.send_link(qp, Message::Chunk(chunk));
    }

    /// Link `qp` is gone: its streams end (their pods hear it).
    pub(super) fn streams_link_down(&mut self, qp: u32) {
        let keys: Vec<PodKey> = self
            .streams
            .by_pod
            .iter()
            .filter(|(_, s)| s.qp == qp)
            .map(|(k, _)| *k)
            .collect();
        for key in keys {
            self.stream_abort(key, "the link to the receiver is gone", false);
        }
    }

    /// Housekeeping: streams whose pod left, and streams idle past their limit.
    pub(super) fn expire_streams(&mut self, live: impl Fn(u32) -> bool) {
        if self.streams.len() == 0 {
            return;
        }
        let now = Instant::now();
        let ended: Vec<(PodKey, &'static str)> = self
            .streams
            .by_pod
            .iter()
            .filter_map(|(k, s)| {
                if !live(s.pod) {
                    Some((*k, "the service left mid-stream"))
                } else if s.deadline.is_some_and(|d| now >= d) {
                    Some((*k, DEADLINE))
                } else if now.duration_since(s.last_moved) >= s.idle {
                    Some((*k, "the stream sat idle too long"))
                } else {
                    None
                }
            })
            .collect();
        for (key, why) in ended {
            if why == DEADLINE {
                self.stream_deadline(key);
            } else {
                self.stream_abort(key, why, true);
            }
        }
    }

    /// A gRPC call's deadline passed mid-stream: the pod is told to stop, and the
    /// client gets the end of the stream with DEADLINE_EXCEEDED, as its deadline
    /// says (the head went already: the status rides in the trailers).
    fn stream_deadline(&mut self, key: PodKey) {
        let Some(s) = self.streams.remove(key) else {
            return;
        };
        self.upload_answer_over(s.qp, s.xid);
        for w in s.queue {
            self.hand_back(&w.d);
        }
        self.forward(cancel_notice(&s.opening));
        if let Some(service) = &s.grpc_service {
            self.meter.response_metrics.record_grpc(service, 4);
        }
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
        let end = match wire::encode_response(&head) {
            Ok(t) => ChunkEnd::Last(t),
            Err(_) => ChunkEnd::Abort(DEADLINE.to_owned()),
        };
        self.send_end(s.qp, s.xid, end);
    }
}

/// What tells the pod that sent `part` (any part of a stream: its ids and lane) that
/// the stream is over: an error with `Cancelled` and no buffers, which the DMA
/// manager delivers to the pod instead of freeing anything.
pub(super) fn cancel_notice(part: &Descriptor) -> Descriptor {
    let mut notice = *part;
    notice.header = Buffer::NONE;
    notice.body = Buffer::NONE;
    notice.kind.completion = true;
    notice.kind.error = true;
    notice.kind.stream = true;
    notice.kind.response = true;
    notice.status = DescriptorStatus::Cancelled as u16;
    notice.dst = Destination::Pod(part.src_pod);
    notice
}

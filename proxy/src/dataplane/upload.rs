//! Streamed request bodies relayed from a link (the ingress) to a pod: the requester
//! writes each part into a window of its request buffer and announces it
//! (`UpChunk`); once the request is at a pod, the part is RDMA-READ straight into one
//! of the pod's RX body slots and delivered as a stream part, and the window goes
//! back to the requester (`UpWindow`). The pod says when it passed a part on
//! (`Taken`); no more than [`UPLOAD_PARTS`] of a stream's parts are at the pod or on
//! their way there, so a service that reads slowly slows the client, and nothing
//! grows in between: announced parts wait in the requester's windows.
//!
//! An upload ends with its requester's last part (trailers with it) or abort, with the
//! pod's `Stop`, when its exchange ends without a streamed answer (a denial, an
//! error, a timeout, the pod's whole answer), when the streamed answer ends, when its
//! link or pod goes, or after its idle limit with nothing moving. Ended early, the
//! pod hears an abort part and the requester `UpCancel`, sent only once no read of
//! its buffer is in flight: after it, nothing of the buffer is read.

use std::collections::VecDeque;

use dpumesh_dpa::StreamPart;
use dpumesh_dpa::frame::{Chunk, ChunkEnd, StreamWindows};

use super::stream::STREAM_IDLE;
use super::*;
use exchange::PodKey;

/// Parts of one upload at its pod (delivered and not taken) or being read for it.
pub(super) const UPLOAD_PARTS: u8 = 4;

/// Where an upload's parts go: the pod and the ids its request was delivered under.
#[derive(Debug, Clone, Copy)]
struct Target {
    pod: u32,
    req_id: u32,
    step_id: u32,
}

/// One streamed request body on its way from a link to a pod.
#[derive(Debug)]
pub(super) struct Upload {
    /// The requester's buffer and its windows.
    body: RemoteBuf,
    windows: StreamWindows,
    /// Parts announced and not read yet: (window, bytes).
    announced: VecDeque<(u8, u32)>,
    /// How the requester ended the body, once it did.
    end: Option<ChunkEnd>,
    /// Where the parts go, once the request is at a pod.
    to: Option<Target>,
    /// Its exchange, once admitted.
    exchange: Option<u32>,
    /// Reads in flight, and parts at the pod not taken yet.
    reading: u8,
    in_pod: u8,
    /// Given up: `UpCancel` goes once the reads in flight are done.
    cancelling: bool,
    last_moved: Instant,
    idle: Duration,
}

/// The uploads this shard relays: by link and the requester's xid, and by the key the
/// pod answers under.
#[derive(Debug, Default)]
pub(super) struct Uploads {
    by_link: HashMap<(u32, u32), Upload>,
    by_pod: HashMap<PodKey, (u32, u32)>,
}

impl Uploads {
    fn remove(&mut self, key: (u32, u32)) -> Option<Upload> {
        let u = self.by_link.remove(&key)?;
        if let Some(t) = u.to {
            self.by_pod.remove(&(0, t.req_id, t.step_id));
        }
        Some(u)
    }

    /// Uploads open.
    pub fn len(&self) -> usize {
        self.by_link.len()
    }
}

impl<F: Fabric> Reactor<F> {
    /// A request over link `qp` says its body streams through `body`'s windows;
    /// whether it can (a buffer too small for one window cannot).
    pub(super) fn upload_open(&mut self, qp: u32, xid: u32, body: RemoteBuf) -> bool {
        let windows = StreamWindows::of(body.len);
        if windows.count == 0 {
            return false;
        }
        self.uploads.by_link.insert(
            (qp, xid),
            Upload {
                body,
                windows,
                announced: VecDeque::new(),
                end: None,
                to: None,
                exchange: None,
                reading: 0,
                in_pod: 0,
                cancelling: false,
                last_moved: Instant::now(),
                idle: STREAM_IDLE,
            },
        );
        true
    }

    /// Case 2 for a request whose body streams: the head goes to `pod` as the
    /// stream's opening; the parts follow as they come.
    pub(super) fn deliver_upload(
        &mut self,
        xid: u32,
        pod: u32,
        header: Buffer,
        attempt: u32,
        link: (u32, u32),
        idle: Option<Duration>,
    ) {
        let mut d =
            Descriptor::request(Case::ExternalToHost, xid, attempt, 0, Destination::Pod(pod))
                .with_header(header);
        d.kind.stream = true;
        d.status = StreamPart::OPEN_REQUEST;
        self.table.at_pod(xid, (0, xid, attempt), pod);
        self.table.arm_try(xid, Instant::now());
        self.forward(d);
        let Some(u) = self.uploads.by_link.get_mut(&link) else {
            // Cancelled while the chain ran (its link went): the pod hears the end.
            self.deliver_part(
                Target {
                    pod,
                    req_id: xid,
                    step_id: attempt,
                },
                StreamPart::Abort,
                Buffer::NONE,
                Buffer::NONE,
            );
            return;
        };
        u.to = Some(Target {
            pod,
            req_id: xid,
            step_id: attempt,
        });
        u.idle = idle.unwrap_or(STREAM_IDLE);
        u.last_moved = Instant::now();
        self.uploads.by_pod.insert((0, xid, attempt), link);
        self.upload_pump(link);
    }

    /// The exchange upload `(qp, xid)` belongs to.
    pub(super) fn upload_admitted(&mut self, qp: u32, xid: u32, exchange: u32) {
        if let Some(u) = self.uploads.by_link.get_mut(&(qp, xid)) {
            u.exchange = Some(exchange);
        }
    }

    /// A part of a streamed request body was announced over link `qp`.
    pub(super) fn upload_chunk(&mut self, qp: u32, c: Chunk) {
        let key = (qp, c.xid);
        let Some(u) = self.uploads.by_link.get_mut(&key) else {
            // Cancelled: the requester stops once it hears it.
            return;
        };
        if u.cancelling || u.end.is_some() {
            return;
        }
        u.last_moved = Instant::now();
        let in_flight = u.announced.len() + usize::from(u.reading);
        match c.end {
            ChunkEnd::More
                if c.window < u.windows.count
                    && c.len > 0
                    && c.len <= u.windows.size
                    && in_flight < usize::from(u.windows.count) =>
            {
                u.announced.push_back((c.window, c.len));
            }
            ChunkEnd::More => {
                // Past its buffer, empty, or more windows than it has: the requester
                // breaks the protocol, and its body is given up.
                tracing::warn!(
                    qp,
                    window = c.window,
                    len = c.len,
                    "a streamed request's part names no window of its buffer"
                );
                u.end = Some(ChunkEnd::Abort(
                    "the requester named a window outside its buffer".into(),
                ));
                u.announced.clear();
            }
            ChunkEnd::Abort(why) => {
                // The client left (or failed, or stalled): the exchange is over
                // (its local reply counts against nobody) and the pod hears the end.
                u.end = Some(ChunkEnd::Abort(why.clone()));
                if let Some(x) = u.exchange.filter(|x| self.table.get(*x).is_some()) {
                    let e = ProxyError::new(
                        ErrorKind::DownstreamLost,
                        format!("the request body did not arrive whole: {why}"),
                    );
                    self.fail(x, e);
                    return;
                }
            }
            end => u.end = Some(end),
        }
        self.upload_pump(key);
    }

    /// Reads what was announced into the pod's slots while the upload's share
    /// allows; delivers the end once everything before it is in.
    fn upload_pump(&mut self, key: (u32, u32)) {
        loop {
            let Some(u) = self.uploads.by_link.get_mut(&key) else {
                return;
            };
            let Some(to) = u.to else {
                return;
            };
            if u.cancelling {
                return;
            }
            if let Some(&(window, len)) = u.announced.front() {
                if u.reading + u.in_pod >= UPLOAD_PARTS {
                    return;
                }
                let from = dpumesh_dpa::fabric::RemoteAddr {
                    addr: u.body.at.addr + u.windows.offset(window),
                    rkey: u.body.at.rkey,
                };
                let Ok(slot) = self.pods.port.reserve_body(to.pod, len) else {
                    // The pod's slots are all in use: tried again when one of its
                    // parts is taken, or at housekeeping.
                    return;
                };
                let at = self
                    .pods
                    .regions(to.pod, &self.links.fabric, &self.links.pd)
                    .and_then(|r| Some((r, r.rx_pool.offset_of(slot).ok()?)));
                let Some((regions, offset)) = at else {
                    self.release_rx(to.pod, slot);
                    self.upload_cancel(key, true);
                    return;
                };
                let sge = regions.rx.sge(offset, len);
                let token = self.table.next_token();
                let (qp, _) = key;
                let Some(state) = self.links.by_qp.get_mut(&qp) else {
                    self.release_rx(to.pod, slot);
                    return;
                };
                if state.link.read(sge, from, token).is_err() {
                    self.release_rx(to.pod, slot);
                    self.link_down(qp, "read refused".into());
                    return;
                }
                self.table.track(
                    token,
                    Transfer::UpRead {
                        qp,
                        xid: key.1,
                        pod: to.pod,
                        slot,
                    },
                );
                if let Some(u) = self.uploads.by_link.get_mut(&key) {
                    u.announced.pop_front();
                    u.reading += 1;
                }
                continue;
            }
            if u.reading > 0 {
                return;
            }
            let Some(end) = u.end.take() else {
                return;
            };
            self.uploads.remove(key);
            match end {
                ChunkEnd::Last(trailers) => {
                    let header = if trailers.is_empty() {
                        Buffer::NONE
                    } else {
                        match self.pods.port.alloc_header(&trailers) {
                            Ok(h) => h,
                            Err(e) => {
                                tracing::warn!(error = %e, "no header slot for a request's trailers");
                                self.deliver_part(
                                    to,
                                    StreamPart::Abort,
                                    Buffer::NONE,
                                    Buffer::NONE,
                                );
                                return;
                            }
                        }
                    };
                    self.deliver_part(to, StreamPart::End, header, Buffer::NONE);
                }
                _ => self.deliver_part(to, StreamPart::Abort, Buffer::NONE, Buffer::NONE),
            }
            return;
        }
    }

    /// A part of a request's streamed body for the pod.
    fn deliver_part(&mut self, to: Target, part: StreamPart, header: Buffer, body: Buffer) {
        let mut d = Descriptor::request(
            Case::ExternalToHost,
            to.req_id,
            to.step_id,
            0,
            Destination::Pod(to.pod),
        )
        .with_header(header)
        .with_body(body);
        d.kind.stream = true;
        d.status = part.code();
        self.forward(d);
    }

    /// A read of an upload's part finished (or failed: its link is going down).
    pub(super) fn upload_read(&mut self, qp: u32, xid: u32, pod: u32, slot: Buffer, ok: bool) {
        let key = (qp, xid);
        let target = self.uploads.by_link.get_mut(&key).and_then(|u| {
            u.reading = u.reading.saturating_sub(1);
            u.last_moved = Instant::now();
            u.to.filter(|_| ok && !u.cancelling)
        });
        match target {
            Some(to) if to.pod == pod => {
                if let Some(u) = self.uploads.by_link.get_mut(&key) {
                    u.in_pod += 1;
                }
                self.deliver_part(to, StreamPart::Data, Buffer::NONE, slot);
                self.send_link(qp, Message::UpWindow { xid, count: 1 });
            }
            _ => self.release_rx(pod, slot),
        }
        if self
            .uploads
            .by_link
            .get(&key)
            .is_some_and(|u| u.cancelling && u.reading == 0)
        {
            self.uploads.remove(key);
            self.send_link(qp, Message::UpCancel { xid });
            return;
        }
        self.upload_pump(key);
    }

    /// The pod said what it did with a request's streamed body: took a part, or
    /// wants no more.
    pub(super) fn upload_ack(&mut self, d: Descriptor) {
        let Destination::Pod(to) = d.dst else {
            return;
        };
        let Some(&key) = self.uploads.by_pod.get(&(to, d.req_id, d.step_id)) else {
            if self.pod_uploads.has_pod_ack(&(to, d.req_id, d.step_id)) {
                // Of a pod's call's body.
                self.pod_upload_ack(d);
            }
            return;
        };
        let Some(u) = self.uploads.by_link.get_mut(&key) else {
            return;
        };
        if u.to.is_none_or(|t| t.pod != d.src_pod) {
            tracing::warn!(
                pod = d.src_pod,
                "a pod spoke of a request body it is not sent"
            );
            return;
        }
        u.last_moved = Instant::now();
        match d.stream_part() {
            Some(StreamPart::Taken) => {
                u.in_pod = u.in_pod.saturating_sub(1);
                self.upload_pump(key);
            }
            Some(StreamPart::Stop) => self.upload_cancel(key, false),
            _ => {}
        }
    }

    /// Gives an upload up: the pod hears an abort part when `tell_pod` (and it was
    /// at one), the requester `UpCancel` once no read of its buffer is in flight.
    pub(super) fn upload_cancel(&mut self, key: (u32, u32), tell_pod: bool) {
        let Some(u) = self.uploads.by_link.get_mut(&key) else {
            return;
        };
        if u.cancelling {
            return;
        }
        u.cancelling = true;
        u.announced.clear();
        u.end = None;
        let (to, reading) = (u.to, u.reading);
        if tell_pod && let Some(to) = to {
            self.deliver_part(to, StreamPart::Abort, Buffer::NONE, Buffer::NONE);
        }
        if reading == 0 {
            self.uploads.remove(key);
            self.send_link(key.0, Message::UpCancel { xid: key.1 });
        }
    }

    /// Exchange `exchange` ended; its upload goes on only while a streamed answer
    /// to it runs (`answer_streams`), and ends with it otherwise.
    pub(super) fn upload_exchange_over(&mut self, exchange: &Exchange, answer_streams: bool) {
        if !exchange.traits.streamed || answer_streams {
            return;
        }
        match exchange.origin {
            Origin::Link { qp, xid, .. } => self.upload_cancel((qp, xid), true),
            Origin::Pod { d } => self.pod_upload_exchange_over(&d, answer_streams),
        }
    }

    /// A streamed answer to the request `xid` over link `qp` ended: what is left of
    /// its body is not wanted.
    pub(super) fn upload_answer_over(&mut self, qp: u32, xid: u32) {
        if self.uploads.len() > 0 {
            self.upload_cancel((qp, xid), true);
        }
    }

    /// Link `qp` is gone: its uploads end (their pods hear it); nothing is read from
    /// it any more.
    pub(super) fn uploads_link_down(&mut self, qp: u32) {
        let keys: Vec<(u32, u32)> = self
            .uploads
            .by_link
            .keys()
            .filter(|k| k.0 == qp)
            .copied()
            .collect();
        for key in keys {
            if let Some(to) = self.uploads.remove(key).and_then(|u| u.to) {
                self.deliver_part(to, StreamPart::Abort, Buffer::NONE, Buffer::NONE);
            }
        }
    }

    /// Housekeeping: uploads whose pod left or that sat idle past their limit end;
    /// the others try again for pod slots that were all in use.
    pub(super) fn expire_uploads(&mut self, live: impl Fn(u32) -> bool) {
        if self.uploads.len() == 0 {
            return;
        }
        let now = Instant::now();
        let mut ended = Vec::new();
        let mut stalled = Vec::new();
        for (k, u) in &self.uploads.by_link {
            if u.cancelling {
                continue;
            }
            match u.to {
                Some(t) if !live(t.pod) => ended.push((*k, false)),
                _ if now.duration_since(u.last_moved) >= u.idle => ended.push((*k, true)),
                Some(_) if !u.announced.is_empty() => stalled.push(*k),
                _ => {}
            }
        }
        for (key, tell_pod) in ended {
            tracing::debug!(qp = key.0, "a streamed request body ended early");
            self.upload_cancel(key, tell_pod);
        }
        for key in stalled {
            self.upload_pump(key);
        }
    }
}

//! Answers coming back from pods and peers, relayed to where their requests came
//! from, and the response phase.

use super::wire_head::WireHead;
use super::*;
use dispatch::encode_head;
use layers::breaker::mark_dependency_failure;
use layers::retry::Failure;

impl<F: Fabric> Reactor<F> {
    /// A pod answered (a request from outside the node, or a pod's call).
    pub(super) fn pod_response(&mut self, d: Descriptor) {
        let Destination::Pod(to) = d.dst else {
            self.hand_back(&d);
            return;
        };
        let xid = match self.table.pod_answer((to, d.req_id, d.step_id), d.src_pod) {
            PodAnswer::Current(xid) => xid,
            answer => {
                // Its request timed out or its origin is gone, or the pod answers for
                // a request it was never given: drop it, free its buffers.
                if answer == PodAnswer::Impostor {
                    tracing::warn!(pod = d.src_pod, "a pod answered a request it was not given");
                }
                self.drop_answer(&d);
                return;
            }
        };
        let header = self.pods.port.header(&d).unwrap_or_default();
        // Decoded when first read (the cache, a 5xx's cause, plugins' edits, a gRPC
        // call's status), once.
        let mut wire = WireHead::new(&header);
        let failure = match self.table.grpc_retry_on(xid) {
            Some(codes)
                if wire
                    .get()
                    .is_some_and(|h| codes.contains(dpumesh_head::grpc::status_of(h))) =>
            {
                Failure::GrpcRetryable
            }
            _ => Failure::Status(d.status),
        };
        if self.table.tries_again(xid, failure, Instant::now()) {
            self.drop_answer(&d);
            self.retry(xid, d.status);
            return;
        }
        self.meter.stats.relayed.fetch_add(1, Ordering::Relaxed);
        let Some(mut exchange) = self.table.close(xid) else {
            self.hand_back(&d);
            return;
        };
        // A streamed request body goes on while the answer streams (gRPC's
        // bidirectional calls), and is not wanted after a whole answer.
        let answer_streams = d.kind.stream;
        self.upload_exchange_over(&exchange, answer_streams);
        let upstream = pod_upstream(&exchange.service, d.src_pod);
        // A streamed gRPC answer's status comes in its trailers, at its end.
        if exchange.traits.grpc && !d.kind.stream {
            let code = wire.get().map_or(2, dpumesh_head::grpc::status_of);
            self.meter
                .response_metrics
                .record_grpc(&exchange.service, code);
            exchange.seen.grpc_status = Some(code);
        }
        // A streamed answer is not stored (the cache keeps whole bodies).
        let pending = exchange.cache.take().filter(|_| !d.kind.stream);
        if let Some(pending) = pending
            && let Some((head, body)) = self.cache_response(*pending, &d, &mut wire)
        {
            // The origin confirmed a stored response: the cache answers.
            self.hand_back(&d);
            let mut edit = self.edits_response(&exchange).then(|| head.clone());
            self.response_phase(
                &mut exchange,
                head.status,
                FailureKind::None,
                Some(upstream),
                edit.as_mut(),
            );
            self.reply_origin(&exchange.origin, edit.as_ref().unwrap_or(&head), body);
            return;
        }
        if d.status >= 500 {
            mark_dependency_failure(exchange.head.as_mut(), wire.get());
        }
        // A response going back over a link can carry a plugin's header edits (one
        // going to a pod of this node keeps its head in the pod's buffer: not edited).
        let mut edit = (matches!(exchange.origin, Origin::Link { .. })
            && self.edits_response(&exchange))
        .then(|| wire.get().cloned())
        .flatten();
        self.response_phase(
            &mut exchange,
            d.status,
            FailureKind::None,
            Some(upstream),
            edit.as_mut(),
        );
        let header = match edit.map(|h| wire::encode_response(&h)) {
            Some(Ok(edited)) => edited,
            _ => header,
        };
        match exchange.origin {
            Origin::Pod { d: request } if d.kind.stream => {
                // Case 3, streamed: part by part into the caller's pool.
                self.open_call_stream_from_pod(request, &exchange, d);
            }
            Origin::Link {
                qp,
                xid: peer_xid,
                reply,
            } if d.kind.stream => {
                self.open_stream((qp, peer_xid, reply), &exchange, d, header);
            }
            Origin::Pod { d: request } => {
                // Case 3: the DMA manager delivers B's reply to A (body B → A), under
                // the ids A sent.
                let mut d = d;
                d.req_id = request.req_id;
                d.step_id = request.step_id;
                self.forward(d);
            }
            Origin::Link {
                qp,
                xid: peer_xid,
                reply,
            } => {
                let body = if d.body.is_none() {
                    ResponseBody::None
                } else if d.body.len > reply.len {
                    self.hand_back(&d);
                    let e = ProxyError::new(
                        ErrorKind::BadResponse,
                        format!(
                            "response body of {} bytes exceeds the {}-byte reply buffer",
                            d.body.len, reply.len
                        ),
                    );
                    self.send_local(qp, peer_xid, &e.response_head(), e.body());
                    return;
                } else {
                    match self.write_body(qp, &d, reply) {
                        Ok(()) => ResponseBody::Written(d.body.len),
                        Err(e) => {
                            self.send_local(qp, peer_xid, &e.response_head(), e.body());
                            return;
                        }
                    }
                };
                if matches!(body, ResponseBody::None) {
                    self.hand_back(&d);
                }
                self.send_link(
                    qp,
                    Message::Response(Response {
                        xid: peer_xid,
                        body,
                        head: header,
                    }),
                );
            }
        }
    }

    /// An answer nobody takes: its buffers go back; a stream's pod is told to stop.
    fn drop_answer(&mut self, d: &Descriptor) {
        if d.kind.stream {
            self.refuse_stream(d);
        } else {
            self.hand_back(d);
        }
    }

    /// RDMA-WRITEs a pod's response body (in its TX pool) to `reply`; the pod gets the
    /// slot back when the write is done.
    pub(super) fn write_body(
        &mut self,
        qp: u32,
        d: &Descriptor,
        reply: RemoteBuf,
    ) -> Result<(), ProxyError> {
        // Across PCIe the fabric reads the body from the node's staging copy.
        if let Err(e) = self.pods.port.stage_tx(d.src_pod, d.body, 0, d.body.len) {
            self.hand_back(d);
            return Err(ProxyError::new(
                ErrorKind::Internal,
                format!("the service's response body could not be staged: {e}"),
            ));
        }
        let Some(regions) = self
            .pods
            .regions(d.src_pod, &self.links.fabric, &self.links.pd)
        else {
            self.hand_back(d);
            return Err(ProxyError::new(
                ErrorKind::Internal,
                "the service's memory cannot be registered",
            ));
        };
        let Ok(offset) = regions.tx_pool.offset_of(d.body) else {
            self.hand_back(d);
            return Err(ProxyError::new(
                ErrorKind::BadResponse,
                "the service's response body is not in its pool",
            ));
        };
        let sge = regions.tx.sge(offset, d.body.len);
        let token = self.table.next_token();
        let Some(state) = self.links.by_qp.get_mut(&qp) else {
            self.hand_back(d);
            return Err(ProxyError::new(
                ErrorKind::DownstreamLost,
                "the link the request came on is gone",
            ));
        };
        if state.link.write(sge, reply.at, token).is_err() {
            self.hand_back(d);
            self.link_down(qp, "write refused".into());
            return Err(ProxyError::new(
                ErrorKind::DownstreamLost,
                "the response body could not be written back",
            ));
        }
        self.table.track(token, Transfer::Write { qp, done: *d });
        Ok(())
    }

    pub(super) fn send_link(&mut self, qp: u32, message: Message) {
        let failed = match self.links.by_qp.get_mut(&qp) {
            Some(state) => state.link.send(message).err(),
            None => return,
        };
        if let Some(e) = failed {
            tracing::warn!(qp, error = %e, "mesh link send failed");
            if self.links.by_qp.get(&qp).is_some_and(|s| s.link.is_down()) {
                self.link_down(qp, e.to_string());
            }
        }
    }

    /// Runs the response phase (circuit breaker accounting, metrics) without waiting:
    /// response filters do not edit the response head, so nobody needs its result.
    pub(super) fn response_phase(
        &mut self,
        exchange: &mut Exchange,
        status: u16,
        failure: FailureKind,
        upstream: Option<String>,
        edit: Option<&mut ResponseHead>,
    ) {
        let latency = exchange.started.elapsed();
        self.meter
            .response_metrics
            .record(&exchange.service, status);
        self.observe(exchange, status, failure, upstream.as_deref(), latency);
        let info = ResponseInfo {
            status,
            latency_ns: latency.as_nanos() as u64,
            upstream,
            failure,
        };
        if let Some(park) = exchange.park.take()
            && let Some(ticket) = exchange.ticket.take()
        {
            // Answered while a filter waited for its HTTP calls (timed out, its link
            // lost): the parked request is given up where it waits.
            self.abandon_parked(ticket, park, info);
            return;
        }
        let (Some(ticket), Some(head)) = (exchange.ticket.take(), exchange.head.take()) else {
            return;
        };
        match edit {
            // Plugins may edit the response before it leaves: the phase runs here,
            // before the response is sent (inline chains only: an offloaded chain's
            // response phase runs on the pool, after).
            Some(response) if ticket.worker == SHARD_RUNNER => {
                let mut headers = ResponseHeaders {
                    fields: response
                        .headers
                        .iter()
                        .map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec()))
                        .collect(),
                    edited: false,
                };
                self.filters
                    .chains
                    .on_response_editing(&ticket, head, &info, Some(&mut headers));
                if headers.edited {
                    let mut edited = HeaderMap::with_capacity(headers.fields.len());
                    for (name, value) in headers.fields {
                        // Checked by the runtime when the plugin made the edit.
                        if let (Ok(n), Ok(v)) = (
                            HeaderName::from_bytes(name.as_bytes()),
                            HeaderValue::from_bytes(&value),
                        ) {
                            edited.append(n, v);
                        }
                    }
                    response.headers = edited;
                }
            }
            _ => self.run_response_phase(ticket, head, info),
        }
    }

    /// Whether the response to `exchange` should be handed to its response phase for
    /// editing: its chain has a plugin that may edit it and runs inline.
    pub(super) fn edits_response(&self, exchange: &Exchange) -> bool {
        exchange.ticket.as_ref().is_some_and(|t| {
            t.worker == SHARD_RUNNER && t.generation.chains()[t.chain].edits_responses()
        }) && exchange.park.is_none()
    }

    /// A peer proxy answered a call one of our pods made.
    pub(super) fn peer_response(&mut self, qp: u32, r: Response) {
        let (mut exchange, reply_slot) = match self.table.peer_answer(qp, r.xid) {
            PeerAnswer::Current {
                exchange,
                reply_slot,
            } => (exchange, reply_slot),
            PeerAnswer::Orphan(o) => {
                // The late answer to a call we gave up on: the peer is done with A's
                // body and the reply slot.
                self.release_rx(o.d.src_pod, o.reply_slot);
                self.hand_back(&o.d);
                return;
            }
            PeerAnswer::Unknown => return,
        };
        self.meter.stats.relayed.fetch_add(1, Ordering::Relaxed);
        let Origin::Pod { d } = exchange.origin else {
            return;
        };
        // Decoded once: its status is always read.
        let decoded = wire::decode_response(&r.head).ok();
        let status = decoded.as_ref().map_or(502, |h| h.status);
        // A streamed gRPC answer's status comes in its trailers, at its end.
        if exchange.traits.grpc && !matches!(r.body, ResponseBody::Stream) {
            let code = decoded.as_ref().map_or(2, dpumesh_head::grpc::status_of);
            self.meter
                .response_metrics
                .record_grpc(&exchange.service, code);
            exchange.seen.grpc_status = Some(code);
        }
        let upstream = self.links.upstream(qp);
        if status >= 500 {
            mark_dependency_failure(exchange.head.as_mut(), decoded.as_ref());
        }
        let mut edit = self
            .edits_response(&exchange)
            .then(|| decoded.clone())
            .flatten();
        self.response_phase(
            &mut exchange,
            status,
            FailureKind::None,
            upstream,
            edit.as_mut(),
        );
        let mut r = r;
        if let Some(Ok(edited)) = edit.as_ref().map(wire::encode_response) {
            r.head = edited;
        }
        // The head as it leaves (edited or not), for a reply made here.
        let head = edit.or(decoded).unwrap_or_default();
        let body = match r.body {
            ResponseBody::None => {
                self.release_rx(d.src_pod, reply_slot);
                Buffer::NONE
            }
            ResponseBody::Written(len) if len <= reply_slot.len => {
                Buffer::new(reply_slot.addr, len)
            }
            ResponseBody::Written(_) => {
                self.release_rx(d.src_pod, reply_slot);
                let e = ProxyError::new(
                    ErrorKind::BadResponse,
                    "the peer wrote past the reply buffer",
                );
                self.reply_pod(&d, &e.response_head(), e.body());
                self.hand_back(&d);
                return;
            }
            ResponseBody::Inline(bytes) => {
                self.release_rx(d.src_pod, reply_slot);
                self.reply_pod(&d, &head, bytes);
                self.hand_back(&d);
                return;
            }
            ResponseBody::Stream => {
                // The body follows in windows of the reply slot, part by part into
                // the caller's pool.
                let header = match self.pods.port.alloc_header(&r.head) {
                    Ok(h) => h,
                    Err(e) => {
                        // No room for its head: the peer is told to stop; the reply
                        // slot may be written until its last frame (an orphan).
                        tracing::warn!(error = %e, "no header slot for a streamed answer to a call");
                        self.send_link(qp, Message::Cancel { xid: r.xid });
                        self.table.orphan(r.xid, Orphan { qp, d, reply_slot });
                        let e = ProxyError::new(
                            ErrorKind::Overloaded,
                            format!("no header buffer for the answer: {e}"),
                        );
                        self.reply_pod(&d, &e.response_head(), e.body());
                        return;
                    }
                };
                self.open_call_stream_from_peer(
                    (qp, r.xid, reply_slot),
                    d,
                    &exchange,
                    (status, header),
                );
                // The peer read A's body before it answered: A's TX slot goes back.
                self.hand_back(&d);
                return;
            }
        };
        let header = match self.pods.port.alloc_header(&r.head) {
            Ok(h) => h,
            Err(_) => {
                if !body.is_none() {
                    self.release_rx(d.src_pod, body);
                }
                self.hand_back(&d);
                return;
            }
        };
        let mut out = Descriptor::request(
            Case::ExternalToHost,
            d.req_id,
            d.step_id,
            0,
            Destination::Pod(d.src_pod),
        )
        .with_header(header)
        .with_body(body);
        out.kind.response = true;
        out.status = status;
        self.forward(out);
        // The peer read A's body before it answered: A's TX slot goes back.
        self.hand_back(&d);
    }

    /// Sends a pod's call to a peer proxy (case 1): the body stays in the pod's TX
    /// pool for the peer to read, and the reply lands in a slot of its RX pool.
    pub(super) fn send_to_peer(&mut self, xid: u32, node: &str) {
        let Some(qp) = self.peer_link(node) else {
            let e = ProxyError::new(
                ErrorKind::Unreachable,
                format!("node {node:?} is unreachable"),
            );
            self.fail(xid, e);
            return;
        };
        let Some(exchange) = self.table.start_try(xid, Instant::now()) else {
            return;
        };
        let Origin::Pod { d } = exchange.origin else {
            // Only pods' calls leave the node (`dispatch` picks a peer for no other).
            let e = ProxyError::new(ErrorKind::Internal, "only a pod's call goes to a peer");
            self.fail(xid, e);
            return;
        };
        let head = match encode_head(exchange, wire::encode_request) {
            Ok(h) => h,
            Err(e) => {
                self.fail(xid, e);
                return;
            }
        };
        let deadline_ms = layers::timeout::peer_budget_ms(exchange.deadline, Instant::now());
        let streamed = exchange.traits.streamed;
        let pod = d.src_pod;
        let Some(info) = self.pods.get(pod).cloned() else {
            self.drop_exchange(xid);
            self.hand_back(&d);
            return;
        };
        let reply_slot = match info.rx_body.alloc(OwnerId::FABRIC) {
            Ok(s) => s,
            Err(e) => {
                let e = ProxyError::new(
                    ErrorKind::CallerOutOfBuffers,
                    format!("no buffer for the reply: {e}"),
                );
                self.fail(xid, e);
                return;
            }
        };
        // A whole slot: its length is the pool's slot size.
        let reply_buf = Buffer::new(
            info.rx_body.addr(reply_slot),
            info.rx_body.layout().slot_size,
        );
        // Across PCIe the peer reads a whole body from the node's staging copy (a
        // streamed one from windows of its own buffer, staged part by part).
        if !d.body.is_none()
            && !streamed
            && let Err(e) = self.pods.port.stage_tx(pod, d.body, 0, d.body.len)
        {
            self.release_rx(pod, reply_buf);
            let e = ProxyError::new(
                ErrorKind::Internal,
                format!("the call's body could not be staged: {e}"),
            );
            self.fail(xid, e);
            return;
        }
        let at = self
            .pods
            .regions(pod, &self.links.fabric, &self.links.pd)
            .and_then(|r| Some((r, r.rx_pool.offset_of(reply_buf).ok()?)));
        let Some((regions, reply_at)) = at else {
            self.release_rx(pod, reply_buf);
            let e = ProxyError::new(ErrorKind::Internal, "the pod's memory cannot be registered");
            self.fail(xid, e);
            return;
        };
        let reply = RemoteBuf {
            at: regions.rx.remote(reply_at),
            len: reply_buf.len,
        };
        let body = (!d.body.is_none()).then(|| RemoteBuf {
            at: regions
                .tx
                .remote(regions.tx_pool.offset_of(d.body).unwrap_or_default()),
            len: d.body.len,
        });
        // A body that streams is read from windows of a buffer of its own.
        let (body, upload) = if streamed {
            match self.pod_upload_buffer(pod) {
                Ok((buffer, remote)) => (Some(remote), Some(buffer)),
                Err(e) => {
                    self.release_rx(pod, reply_buf);
                    self.fail(xid, e);
                    return;
                }
            }
        } else {
            (body, None)
        };
        if let Some(exchange) = self.table.get_mut(xid) {
            exchange.stage = Stage::Peer {
                qp,
                reply_slot: reply_buf,
            };
        }
        self.send_link(
            qp,
            Message::Request(Request {
                xid,
                flags: RequestFlags {
                    policed: true,
                    stream: streamed,
                    ..RequestFlags::default()
                },
                deadline_ms,
                body,
                reply,
                head,
            }),
        );
        if let Some(buffer) = upload {
            self.pod_upload_to_peer(&d, (qp, xid), buffer);
        }
    }

    pub(super) fn peer_link(&mut self, node: &str) -> Option<u32> {
        let addr = *self.topology.peers.get(node)?;
        self.links.peer(node, addr)
    }
}

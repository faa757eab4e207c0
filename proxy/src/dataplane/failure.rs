//! Failed tries, retries, local replies, timeouts and lost links.

use super::*;

impl<F: Fabric> Reactor<F> {
    /// The DMA manager could not carry a descriptor we handed it.
    pub(super) fn delivery_failed(&mut self, d: Descriptor) {
        let status = d.error_status();
        if d.kind.response && d.kind.stream {
            // A part of an answer streaming to a pod's call.
            self.call_stream_undelivered(&d);
            return;
        }
        if d.kind.response {
            // A reply that could not reach its pod (it left, its pools are full): the
            // DMA manager freed what it held; the caller's own timeout answers it.
            tracing::warn!(?status, pod = ?d.dst, "a reply could not be delivered");
            return;
        }
        let key = match d.dst {
            Destination::Pod(_) if d.src_pod == 0 => (0, d.req_id, d.step_id),
            _ => (d.src_pod, d.req_id, d.step_id),
        };
        let Some(xid) = self.table.undelivered(key) else {
            tracing::debug!(?status, "data path error for a finished exchange");
            return;
        };
        let e = ProxyError::new(
            ErrorKind::EndpointRefused,
            format!("the service's pod could not take the request: {status:?}"),
        );
        self.fail_try(xid, e);
    }

    /// Tries again on the next pod; the failed try's reply, if it comes, is dropped.
    pub(super) fn retry(&mut self, xid: u32, status: u16) {
        let Some(e) = self.table.begin_retry(xid) else {
            return;
        };
        metrics::counter!(
            "dpumesh_retries_total",
            "service" => e.service.clone(),
            "status" => status.to_string(),
        )
        .increment(1);
        tracing::debug!(xid, attempt = e.attempt, status, "retrying");
        self.dispatch(xid);
    }

    /// Ends a try that failed with `e`: tried again on the next pod when the error and
    /// the exchange allow it, answered with `e` otherwise.
    pub(super) fn fail_try(&mut self, xid: u32, e: ProxyError) {
        let failure = layers::retry::Failure::Error {
            retryable: e.retryable(),
        };
        if self.table.tries_again(xid, failure, Instant::now()) {
            self.retry(xid, e.status());
        } else {
            self.fail(xid, e);
        }
    }

    /// Answers an exchange with the proxy's error `e`, blamed on where its try was.
    pub(super) fn fail(&mut self, xid: u32, e: ProxyError) {
        let upstream = self.table.get(xid).and_then(|x| match &x.stage {
            Stage::Pod { pod, .. } => Some(pod_upstream(&x.service, *pod)),
            Stage::Peer { qp, .. } => self.links.upstream(*qp),
            Stage::Filtering | Stage::Reading => None,
        });
        self.fail_at(xid, e, upstream);
    }

    /// Answers an exchange with the proxy's error `e`, blamed on `upstream`.
    pub(super) fn fail_at(&mut self, xid: u32, e: ProxyError, upstream: Option<String>) {
        let failure = failure_kind(&e);
        self.finish_with(xid, &e.response_head(), e.body(), failure, upstream);
    }

    /// Answers an exchange from the proxy itself: an error, or a filter's denial.
    pub(super) fn finish_with(
        &mut self,
        xid: u32,
        head: &ResponseHead,
        body: Vec<u8>,
        failure: FailureKind,
        upstream: Option<String>,
    ) {
        let Some(mut exchange) = self.table.close(xid) else {
            return;
        };
        self.upload_exchange_over(&exchange, false);
        // A gRPC caller gets the reply as gRPC: a trailers-only answer whose
        // `grpc-status` stands for the HTTP status (Envoy's local reply mapping).
        let grpc;
        let (head, body) = if exchange.traits.grpc {
            grpc = dpumesh_head::grpc::local_reply(head, &body);
            let code = dpumesh_head::grpc::status_of(&grpc);
            metrics::counter!(
                "dpumesh_grpc_local_replies_total",
                "service" => exchange.service.clone(),
                "grpc_status" => code.to_string(),
            )
            .increment(1);
            self.meter
                .response_metrics
                .record_grpc(&exchange.service, code);
            exchange.seen.grpc_status = Some(code);
            (&grpc, Vec::new())
        } else {
            (head, body)
        };
        // A local reply passes the response phase like any response (plugins may
        // edit its headers, as Envoy's encoder filters see local replies).
        let mut edit = self.edits_response(&exchange).then(|| head.clone());
        self.response_phase(&mut exchange, head.status, failure, upstream, edit.as_mut());
        let head = edit.as_ref().unwrap_or(head);
        if let Stage::Peer { qp, reply_slot } = exchange.stage
            && let Origin::Pod { d } = exchange.origin
        {
            if self.links.by_qp.contains_key(&qp) {
                // The peer may still read A's body and write into the reply slot:
                // both stay lent until its answer comes or the link goes.
                let mut lent = d;
                lent.header = Buffer::NONE;
                self.table.orphan(
                    xid,
                    Orphan {
                        qp,
                        d: lent,
                        reply_slot,
                    },
                );
                self.meter
                    .stats
                    .local_replies
                    .fetch_add(1, Ordering::Relaxed);
                self.reply_pod(&d, head, body);
                let mut header_only = d;
                header_only.body = Buffer::NONE;
                self.hand_back(&header_only);
                return;
            }
            self.release_rx(d.src_pod, reply_slot);
        }
        self.reply_origin(&exchange.origin, head, body);
    }

    pub(super) fn drop_exchange(&mut self, xid: u32) {
        if let Some(exchange) = self.table.close(xid) {
            self.upload_exchange_over(&exchange, false);
        }
    }

    pub(super) fn reply_origin_error(&mut self, origin: &Origin, e: &ProxyError) {
        self.reply_origin(origin, &e.response_head(), e.body());
    }

    pub(super) fn reply_origin(&mut self, origin: &Origin, head: &ResponseHead, body: Vec<u8>) {
        self.meter
            .stats
            .local_replies
            .fetch_add(1, Ordering::Relaxed);
        match origin {
            Origin::Link { qp, xid, .. } => self.send_local(*qp, *xid, head, body),
            Origin::Pod { d } => {
                let d = *d;
                self.reply_pod(&d, head, body);
                // Its request is over: its buffers go back.
                self.hand_back(&d);
            }
        }
    }

    /// A reply from the proxy over link `qp` to the sender's exchange `xid`.
    pub(super) fn send_local(&mut self, qp: u32, xid: u32, head: &ResponseHead, mut body: Vec<u8>) {
        // Local replies (a filter's, a cached response) travel inline in one frame: an
        // oversized body is cut rather than lost.
        let head = wire::encode_response(head).unwrap_or_default();
        let room = dpumesh_dpa::frame::MAX_FRAME.saturating_sub(head.len() + 512);
        body.truncate(MAX_LOCAL_BODY.min(room));
        let body = if body.is_empty() {
            ResponseBody::None
        } else {
            ResponseBody::Inline(body)
        };
        self.send_link(qp, Message::Response(Response { xid, body, head }));
    }

    /// A reply from the proxy to a pod's request `d`.
    pub(super) fn reply_pod(&mut self, d: &Descriptor, head: &ResponseHead, body: Vec<u8>) {
        let pod = d.src_pod;
        let Ok(bytes) = wire::encode_response(head) else {
            return;
        };
        let Ok(header) = self.pods.port.alloc_header(&bytes) else {
            tracing::warn!(pod, "no DPU header slot for a local reply");
            return;
        };
        let mut body_buf = Buffer::NONE;
        if !body.is_empty() {
            match self.pods.port.reserve_body(pod, body.len() as u32) {
                Ok(slot) => {
                    let written = self.pods.get(pod).map(|info| {
                        info.rx_body
                            .slot_of(slot)
                            .and_then(|s| info.write_rx_body(s, &body))
                    });
                    match written {
                        Some(Ok(b)) => body_buf = b,
                        _ => self.release_rx(pod, slot),
                    }
                }
                Err(e) => tracing::warn!(pod, error = %e, "no body slot for a local reply"),
            }
        }
        let mut out = Descriptor::request(
            Case::ExternalToHost,
            d.req_id,
            d.step_id,
            0,
            Destination::Pod(pod),
        )
        .with_header(header)
        .with_body(body_buf);
        out.kind.response = true;
        out.status = head.status;
        self.forward(out);
    }

    /// Answers what the timers say: a try that ran out of its time is tried again
    /// or failed; an exchange that ran out of time gets a 504.
    pub(super) fn expire(&mut self) {
        let now = Instant::now();
        while let Some(due) = self.table.due(now) {
            match due {
                Due::TryTimeout(xid) => {
                    // `due` names only exchanges in the table.
                    let Some(service) = self.table.get(xid).map(|e| &e.service) else {
                        continue;
                    };
                    let e = ProxyError::new(
                        ErrorKind::TryTimeout,
                        format!(
                            "service {service:?} did not answer a try within its per-try timeout"
                        ),
                    );
                    self.fail_try(xid, e);
                }
                Due::Timeout(xid) => {
                    let Some(exchange) = self.table.get(xid) else {
                        continue;
                    };
                    self.meter.stats.timeouts.fetch_add(1, Ordering::Relaxed);
                    let waited = now.saturating_duration_since(exchange.started);
                    let e = if exchange.park.is_some() {
                        ProxyError::new(
                            ErrorKind::Timeout,
                            format!(
                                "the request to service {:?} waited {} ms in a filter for its HTTP calls, past its timeout",
                                exchange.service,
                                waited.as_millis()
                            ),
                        )
                    } else {
                        ProxyError::new(
                            ErrorKind::Timeout,
                            format!(
                                "service {:?} did not answer within {} ms",
                                exchange.service,
                                waited.as_millis()
                            ),
                        )
                    };
                    self.fail(xid, e);
                }
            }
        }
    }

    /// A link failed: what came over it cannot be answered; what went out over it
    /// fails.
    pub(super) fn link_down(&mut self, qp: u32, why: String) {
        let Some(state) = self.links.remove(qp) else {
            return;
        };
        tracing::warn!(qp, node = ?state.node, why, "mesh link down");
        let upstream = state.node.as_deref().map(node_upstream);
        // The queue pair is gone: none of its operations will complete. What they
        // held goes back now (nothing can write into it any more).
        drop(state);
        let loss = self.table.link_down(qp);
        for op in loss.transfers {
            match op {
                Transfer::Read {
                    pod, slot, header, ..
                } => {
                    self.release_rx(pod, slot);
                    let _ = self.pods.port.release_header(header);
                }
                Transfer::Write { done, .. } => self.hand_back(&done),
                Transfer::StreamWrite { done, .. } => {
                    if let Some(d) = done {
                        self.hand_back(&d);
                    }
                }
                Transfer::UpRead { pod, slot, .. } => self.release_rx(pod, slot),
            }
        }
        self.streams_link_down(qp);
        self.uploads_link_down(qp);
        self.call_streams_link_down(qp);
        self.pod_uploads_link_down(qp);
        for o in loss.orphans {
            self.release_rx(o.d.src_pod, o.reply_slot);
            self.hand_back(&o.d);
        }
        // What came over it has nobody to answer; a reply from the pod is dropped
        // when it comes. Their response phase still runs (the breaker must not count
        // them in flight for ever), as requests whose client went away.
        for mut exchange in loss.dropped {
            self.response_phase(&mut exchange, 499, FailureKind::LocalReply, None, None);
        }
        for xid in loss.failed {
            let e = ProxyError::new(
                ErrorKind::LinkLost,
                format!("lost the link to the service's node ({why})"),
            );
            self.fail_at(xid, e, upstream.clone());
        }
    }
}

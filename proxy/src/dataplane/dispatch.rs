//! Sending an allowed request on: to a pod on this node (reading its body into the
//! pod's pool first) or to the proxy of a node that runs the service.

use super::*;

impl<F: Fabric> Reactor<F> {
    /// Drops the registrations of pods that left, and ends the tries that were at
    /// them: tried again on another pod when the exchange allows, answered 502
    /// otherwise (rather than waiting for a timeout).
    pub(super) fn forget_departed_pods(&mut self) {
        let live = self.pods.forget_departed();
        self.expire_streams(|pod| live.contains(&pod));
        self.expire_uploads(|pod| live.contains(&pod));
        self.expire_call_streams(|pod| live.contains(&pod));
        self.expire_pod_uploads(|pod| live.contains(&pod));
        for xid in self.table.at_departed_pods(|pod| live.contains(&pod)) {
            let e = ProxyError::new(
                ErrorKind::LinkLost,
                "the service's pod went away with the request",
            );
            self.fail_try(xid, e);
        }
    }

    /// Publishes the node's occupancy: pods, exchanges in flight, slots in use per
    /// pool.
    pub(super) fn publish_occupancy(&self) {
        self.pods.publish_occupancy();
        // The node's count (every shard's exchanges), not this shard's alone.
        metrics::gauge!("dpumesh_exchanges_in_flight")
            .set(self.meter.stats.in_flight.load(Ordering::Relaxed) as f64);
    }

    pub(super) fn dispatch(&mut self, xid: u32) {
        let Some(exchange) = self.table.get(xid) else {
            return;
        };
        let service = exchange.service.clone();
        let from_pod = matches!(exchange.origin, Origin::Pod { .. });
        if let Some(pod) = self.pods.pick(&service) {
            self.send_to_pod(xid, pod);
            return;
        }
        let peer = from_pod.then(|| self.pick_peer(&service)).flatten();
        match peer {
            Some(node) => self.send_to_peer(xid, &node),
            None => {
                let e = ProxyError::new(
                    ErrorKind::NoEndpoint,
                    format!(
                        "no endpoint for service {service:?} on node {:?}",
                        self.topology.node
                    ),
                );
                self.fail(xid, e);
            }
        }
    }

    pub(super) fn pick_peer(&mut self, service: &str) -> Option<String> {
        let is_peer =
            |n: &&String| **n != self.topology.node && self.topology.peers.contains_key(*n);
        let count = self
            .topology
            .placement
            .get(service)?
            .iter()
            .filter(is_peer)
            .count();
        if count == 0 {
            return None;
        }
        let n = self.links.next_node(service);
        let is_peer =
            |n: &&String| **n != self.topology.node && self.topology.peers.contains_key(*n);
        self.topology.placement[service]
            .iter()
            .filter(is_peer)
            .nth(n % count)
            .cloned()
    }

    /// Sends an allowed request to pod `pod` on this node.
    pub(super) fn send_to_pod(&mut self, xid: u32, pod: u32) {
        let Some(exchange) = self.table.start_try(xid, Instant::now()) else {
            return;
        };
        let bytes = match encode_head(exchange, wire::encode_request_for_pod) {
            Ok(b) => b,
            Err(e) => {
                self.fail(xid, e);
                return;
            }
        };
        let header = match self.pods.port.alloc_header(&bytes) {
            Ok(h) => h,
            Err(e) => {
                let e = ProxyError::new(ErrorKind::Overloaded, format!("no header buffer: {e}"));
                self.fail(xid, e);
                return;
            }
        };
        match &exchange.origin {
            Origin::Pod { d } => {
                // Case 3: the body goes pod A → pod B by DMA; the head is the one the
                // filters left.
                // Each try travels under its own ids, so a late answer to an
                // abandoned try cannot pass for the current one; A's ids go back on
                // the answer.
                let mut out = *d;
                out.case = Case::PodToPod;
                out.dst = Destination::Pod(pod);
                out.header = header;
                out.req_id = xid;
                out.step_id = exchange.attempt;
                let original = d.header;
                let caller = *d;
                let key = (d.src_pod, xid, exchange.attempt);
                // The DMA manager hands A's body back once it copied it, and the
                // original head is freed here: neither is ours to complete later.
                if let Origin::Pod { d } = &mut exchange.origin {
                    d.header = Buffer::NONE;
                    d.body = Buffer::NONE;
                }
                if !original.is_none() {
                    let _ = self.pods.port.release_header(original);
                }
                if exchange.traits.streamed {
                    // Its body follows part by part.
                    self.deliver_pod_upload(xid, pod, &caller, out);
                    return;
                }
                self.table.at_pod(xid, key, pod);
                self.forward(out);
            }
            &Origin::Link {
                qp, xid: peer_xid, ..
            } if exchange.traits.streamed => {
                let (attempt, idle) = (exchange.attempt, exchange.policy.stream_idle);
                self.deliver_upload(xid, pod, header, attempt, (qp, peer_xid), idle);
            }
            &Origin::Link { qp, .. } => {
                let attempt = exchange.attempt;
                match exchange.body {
                    None => self.deliver(xid, pod, header, Buffer::NONE, attempt),
                    Some(body) => {
                        let slot = match self.pods.port.reserve_body(pod, body.len) {
                            Ok(s) => s,
                            Err(e) => {
                                let _ = self.pods.port.release_header(header);
                                let e = ProxyError::new(
                                    ErrorKind::EndpointRefused,
                                    format!("no body buffer at the service: {e}"),
                                );
                                self.fail_try(xid, e);
                                return;
                            }
                        };
                        // The slot's place in the pod's registered RX pool.
                        let at = self
                            .pods
                            .regions(pod, &self.links.fabric, &self.links.pd)
                            .and_then(|r| Some((r, r.rx_pool.offset_of(slot).ok()?)));
                        let Some((regions, offset)) = at else {
                            self.release_rx(pod, slot);
                            let _ = self.pods.port.release_header(header);
                            let e = ProxyError::new(
                                ErrorKind::Internal,
                                "the service's memory cannot be registered",
                            );
                            self.fail(xid, e);
                            return;
                        };
                        let sge = regions.rx.sge(offset, body.len);
                        let token = self.table.next_token();
                        let Some(state) = self.links.by_qp.get_mut(&qp) else {
                            self.release_rx(pod, slot);
                            let _ = self.pods.port.release_header(header);
                            self.drop_exchange(xid);
                            return;
                        };
                        if state.link.read(sge, body.at, token).is_err() {
                            self.release_rx(pod, slot);
                            let _ = self.pods.port.release_header(header);
                            self.link_down(qp, "read refused".into());
                            return;
                        }
                        // The header waits in the DPU pool until the body is in (and
                        // the exchange is `Reading` meanwhile).
                        self.table.track(
                            token,
                            Transfer::Read {
                                qp,
                                xid,
                                pod,
                                slot,
                                header,
                            },
                        );
                    }
                }
            }
        }
    }

    /// Case 2: hands the DMA manager a request for `pod` whose body (if any) is in
    /// the pod's RX pool already.
    pub(super) fn deliver(
        &mut self,
        xid: u32,
        pod: u32,
        header: Buffer,
        body: Buffer,
        attempt: u32,
    ) {
        let d = Descriptor::request(Case::ExternalToHost, xid, attempt, 0, Destination::Pod(pod))
            .with_header(header)
            .with_body(body);
        // The try's clock starts when the pod has it (reading the body is not the
        // pod's time).
        self.table.at_pod(xid, (0, xid, attempt), pod);
        self.table.arm_try(xid, Instant::now());
        self.forward(d);
    }

    /// To the DMA manager, in order; held while its ring is full.
    pub(super) fn forward(&mut self, d: Descriptor) {
        if !self.pods.deferred.is_empty() || self.pods.port.forward(&d).is_err() {
            self.pods.deferred.push_back(d);
        }
    }

    pub(super) fn flush_deferred(&mut self) -> usize {
        let mut n = 0;
        while let Some(d) = self.pods.deferred.front() {
            if self.pods.port.forward(d).is_err() {
                break;
            }
            self.pods.deferred.pop_front();
            n += 1;
        }
        n
    }

    pub(super) fn release_rx(&mut self, pod: u32, slot: Buffer) {
        if let Some(info) = self.pods.get(pod)
            && let Ok(s) = info.rx_body.slot_of(slot)
        {
            let _ = info.rx_body.release(s, OwnerId::FABRIC);
        }
    }

    /// Hands what a pod's descriptor names back to the DMA manager (header slot, and a
    /// body still in the pod's TX pool).
    pub(super) fn hand_back(&mut self, d: &Descriptor) {
        let mut done = *d;
        done.kind.completion = true;
        self.forward(done);
    }

    pub(super) fn transfer_done(&mut self, token: u64, failed: Option<WcStatus>) {
        let Some(op) = self.table.transfer_done(token) else {
            return;
        };
        match op {
            Transfer::Read {
                xid,
                pod,
                slot,
                header,
                ..
            } => {
                let attempt = self.table.get(xid).map(|e| e.attempt);
                let (None, Some(attempt)) = (failed, attempt) else {
                    self.release_rx(pod, slot);
                    let _ = self.pods.port.release_header(header);
                    if let Some(status) = failed {
                        let e = ProxyError::new(
                            ErrorKind::DownstreamLost,
                            format!("the request body could not be read: {status:?}"),
                        );
                        self.fail(xid, e);
                    }
                    return;
                };
                self.deliver(xid, pod, header, slot, attempt);
            }
            Transfer::Write { done, .. } => self.hand_back(&done),
            Transfer::StreamWrite { done, .. } => {
                if let Some(d) = done {
                    self.hand_back(&d);
                }
            }
            Transfer::UpRead { qp, xid, pod, slot } => {
                self.upload_read(qp, xid, pod, slot, failed.is_none());
            }
        }
    }
}

/// `exchange`'s decided head, encoded by `encode` for the next hop.
pub(super) fn encode_head(
    exchange: &Exchange,
    encode: impl FnOnce(&RequestHead) -> Result<Vec<u8>, wire::WireError>,
) -> Result<Vec<u8>, ProxyError> {
    let Some(head) = exchange.head.as_ref() else {
        // Only a decided exchange is sent on; its chain gives the head back.
        return Err(ProxyError::new(
            ErrorKind::Internal,
            "a request was sent on before its chain decided it",
        ));
    };
    encode(head).map_err(|e| {
        ProxyError::new(
            ErrorKind::HeadTooLarge,
            format!("request head cannot be carried: {e}"),
        )
    })
}

//! Sending an allowed request on: to a pod on this node (reading its body into the
//! pod's pool first) or to the proxy of a node that runs the service.

use super::*;

impl<F: Fabric> Reactor<F> {
    pub(super) fn refresh_pods(&mut self, force: bool) {
        if force || self.pods_at.elapsed() >= Duration::from_millis(100) {
            self.pods = self.dpu.pods();
            self.pods_at = Instant::now();
        }
    }

    pub(super) fn pod(&mut self, id: u32) -> Option<&PodInfo> {
        if !self.pods.iter().any(|p| p.id == id) {
            self.refresh_pods(true);
        }
        self.pods.iter().find(|p| p.id == id)
    }

    /// The next pod of `service` on this node, round robin.
    pub(super) fn pick_pod(&mut self, service: &str) -> Option<u32> {
        self.refresh_pods(false);
        let mut count = self.pods.iter().filter(|p| p.service == service).count();
        if count == 0 {
            self.refresh_pods(true);
            count = self.pods.iter().filter(|p| p.service == service).count();
        }
        if count == 0 {
            return None;
        }
        let n = next_turn(&mut self.pod_turns, service);
        self.pods
            .iter()
            .filter(|p| p.service == service)
            .nth(n % count)
            .map(|p| p.id)
    }

    /// Pod `pod`'s body pools, registered with the fabric for READs and WRITEs.
    pub(super) fn pod_regions(&mut self, pod: u32) -> Option<&PodRegions<F>> {
        if !self.regions.contains_key(&pod) {
            let regions = self.node_pod_regions(pod)?;
            self.regions.insert(pod, regions);
        }
        self.regions.get(&pod).map(|r| &**r)
    }

    /// The node's registration of pod `pod`'s body pools: once per node, made by the
    /// first shard that needs it (the shards share one protection domain).
    fn node_pod_regions(&mut self, pod: u32) -> Option<Arc<PodRegions<F>>> {
        if let Some(known) = self.node_regions.lock().get(&pod) {
            return Some(known.clone());
        }
        let info = self.pod(pod)?.clone();
        let register = |pool: &BufferPool| {
            self.fabric.register(
                &self.pd,
                pool.region(),
                0,
                pool.region().len() as u64,
                dpumesh_dpa::fabric::Access::all(),
            )
        };
        let (rx, tx) = match (register(&info.rx_body), register(&info.tx_body)) {
            (Ok(rx), Ok(tx)) => (rx, tx),
            (Err(e), _) | (_, Err(e)) => {
                tracing::error!(pod, error = %e, "cannot register a pod's body pools");
                return None;
            }
        };
        let regions = Arc::new(PodRegions {
            rx,
            tx,
            rx_pool: info.rx_body,
            tx_pool: info.tx_body,
        });
        // Another shard may have registered it meanwhile: the first one stays.
        Some(
            self.node_regions
                .lock()
                .entry(pod)
                .or_insert(regions)
                .clone(),
        )
    }

    /// Drops the registrations of pods that left (their memory can go), and ends the
    /// tries that were at them: tried again on another pod when the exchange allows,
    /// answered 502 otherwise (rather than waiting for a timeout).
    pub(super) fn forget_departed_pods(&mut self) {
        self.refresh_pods(true);
        let live: std::collections::HashSet<u32> = self.pods.iter().map(|p| p.id).collect();
        self.regions.retain(|id, _| live.contains(id));
        // A registration goes when the last shard holding it lets go.
        self.node_regions.lock().retain(|id, _| live.contains(id));
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
        let (tx, rx) = self.dpu.dpu_pool_use();
        let bodies: usize = self
            .pods
            .iter()
            .map(|p| p.rx_body.in_use() + p.tx_body.in_use())
            .sum();
        metrics::gauge!("dpumesh_pods").set(self.pods.len() as f64);
        // The node's count (every shard's exchanges), not this shard's alone.
        metrics::gauge!("dpumesh_exchanges_in_flight")
            .set(self.stats.in_flight.load(Ordering::Relaxed) as f64);
        metrics::gauge!("dpumesh_pool_slots_in_use", "pool" => "dpu_tx_header").set(tx as f64);
        metrics::gauge!("dpumesh_pool_slots_in_use", "pool" => "dpu_rx_header").set(rx as f64);
        metrics::gauge!("dpumesh_pool_slots_in_use", "pool" => "pod_bodies").set(bodies as f64);
    }

    pub(super) fn dispatch(&mut self, xid: u32) {
        let Some(exchange) = self.table.get(xid) else {
            return;
        };
        let service = exchange.service.clone();
        let from_pod = matches!(exchange.origin, Origin::Pod { .. });
        if let Some(pod) = self.pick_pod(&service) {
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
        let n = next_turn(&mut self.node_turns, service);
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
        self.table.start_try(xid, Instant::now());
        let exchange = self.table.get(xid).expect("dispatching");
        let head = exchange.head.as_ref().expect("decided");
        let bytes = match wire::encode_request_for_pod(head) {
            Ok(b) => b,
            Err(e) => {
                let e = ProxyError::new(
                    ErrorKind::HeadTooLarge,
                    format!("request head cannot be carried: {e}"),
                );
                self.fail(xid, e);
                return;
            }
        };
        let header = match self.port.alloc_header(&bytes) {
            Ok(h) => h,
            Err(e) => {
                let e = ProxyError::new(ErrorKind::Overloaded, format!("no header buffer: {e}"));
                self.fail(xid, e);
                return;
            }
        };
        let exchange = self.table.get_mut(xid).expect("dispatching");
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
                let key = (d.src_pod, xid, exchange.attempt);
                // The DMA manager hands A's body back once it copied it, and the
                // original head is freed here: neither is ours to complete later.
                if let Origin::Pod { d } = &mut exchange.origin {
                    d.header = Buffer::NONE;
                    d.body = Buffer::NONE;
                }
                self.table.at_pod(xid, key, pod);
                if !original.is_none() {
                    let _ = self.port.release_header(original);
                }
                self.forward(out);
            }
            Origin::Link { .. } => {
                let attempt = exchange.attempt;
                match exchange.body {
                    None => self.deliver(xid, pod, header, Buffer::NONE, attempt),
                    Some(body) => {
                        let slot = match self.port.reserve_body(pod, body.len) {
                            Ok(s) => s,
                            Err(e) => {
                                let _ = self.port.release_header(header);
                                let e = ProxyError::new(
                                    ErrorKind::EndpointRefused,
                                    format!("no body buffer at the service: {e}"),
                                );
                                self.fail_try(xid, e);
                                return;
                            }
                        };
                        let Some(regions) = self.pod_regions(pod) else {
                            self.release_rx(pod, slot);
                            let _ = self.port.release_header(header);
                            let e = ProxyError::new(
                                ErrorKind::Internal,
                                "the service's memory cannot be registered",
                            );
                            self.fail(xid, e);
                            return;
                        };
                        let offset = regions.rx_pool.offset_of(slot).expect("reserved here");
                        let sge = regions.rx.sge(offset, body.len);
                        let Some(Origin::Link { qp, .. }) = self.table.get(xid).map(|e| e.origin)
                        else {
                            unreachable!("a body at hand came over a link")
                        };
                        let token = self.table.next_token();
                        let Some(state) = self.links.get_mut(&qp) else {
                            self.release_rx(pod, slot);
                            let _ = self.port.release_header(header);
                            self.drop_exchange(xid);
                            return;
                        };
                        if state.link.read(sge, body.at, token).is_err() {
                            self.release_rx(pod, slot);
                            let _ = self.port.release_header(header);
                            self.link_down(qp, "read refused".into());
                            return;
                        }
                        // The header waits in the DPU pool until the body is in.
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
                        self.table.get_mut(xid).expect("live").stage = Stage::Reading;
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
        if !self.deferred.is_empty() || self.port.forward(&d).is_err() {
            self.deferred.push_back(d);
        }
    }

    pub(super) fn flush_deferred(&mut self) -> usize {
        let mut n = 0;
        while let Some(d) = self.deferred.front() {
            if self.port.forward(d).is_err() {
                break;
            }
            self.deferred.pop_front();
            n += 1;
        }
        n
    }

    pub(super) fn release_rx(&mut self, pod: u32, slot: Buffer) {
        if let Some(info) = self.pod(pod)
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
                if failed.is_some() || self.table.get(xid).is_none() {
                    self.release_rx(pod, slot);
                    let _ = self.port.release_header(header);
                    if let Some(status) = failed {
                        let e = ProxyError::new(
                            ErrorKind::DownstreamLost,
                            format!("the request body could not be read: {status:?}"),
                        );
                        self.fail(xid, e);
                    }
                    return;
                }
                let attempt = self.table.get(xid).expect("checked").attempt;
                self.deliver(xid, pod, header, slot, attempt);
            }
            Transfer::Write { done, .. } => self.hand_back(&done),
        }
    }
}

//! Taking requests in (from links and from the node's pods), routing them and running
//! their chains.

use dpumesh_head::path::ORIGINAL_PATH_METADATA;

use super::*;

impl<F: Fabric> Reactor<F> {
    pub(super) fn drain_sidecar(&mut self) -> usize {
        let mut n = 0;
        while n < 64 {
            let d = match self.pods.port.try_recv() {
                Ok(Some(d)) => d,
                Ok(None) => break,
                Err(e) => {
                    tracing::error!(error = %e, "sidecar ring: undecodable descriptor");
                    n += 1;
                    continue;
                }
            };
            n += 1;
            if d.kind.error {
                self.delivery_failed(d);
            } else if d.kind.response && d.kind.stream {
                use dpumesh_dpa::StreamPart;
                match d.stream_part() {
                    Some(StreamPart::Open) => self.pod_response(d),
                    // What the pod did with a request's streamed body.
                    Some(StreamPart::Taken | StreamPart::Stop) => self.upload_ack(d),
                    _ => self.stream_part(d),
                }
            } else if d.kind.response {
                self.pod_response(d);
            } else if d.kind.stream {
                use dpumesh_dpa::StreamPart;
                match d.stream_part() {
                    // What the pod did with an answer streaming to its call.
                    Some(StreamPart::Taken | StreamPart::Stop) => self.call_stream_ack(d),
                    // A call whose body streams.
                    Some(StreamPart::Open) => self.pod_request(d),
                    _ => self.pod_upload_part(d),
                }
            } else {
                self.pod_request(d);
            }
        }
        n
    }

    pub(super) fn drain_completions(&mut self) -> usize {
        self.links.completions.clear();
        let mut completions = std::mem::take(&mut self.links.completions);
        self.links.cq.poll(&mut completions, 64);
        let n = completions.len();
        for wc in completions.drain(..) {
            let Some(state) = self.links.by_qp.get_mut(&wc.qp_num) else {
                continue;
            };
            match state.link.on_completion(&wc) {
                Ok(None) => {}
                Ok(Some(LinkEvent::Message(m))) => self.link_message(wc.qp_num, m),
                Ok(Some(LinkEvent::OpDone(token))) => self.transfer_done(token, None),
                Ok(Some(LinkEvent::OpFailed(token, status))) => {
                    self.transfer_done(token, Some(status));
                    self.link_down(wc.qp_num, format!("{status:?}"));
                }
                Err(e) => self.link_down(wc.qp_num, e.to_string()),
            }
        }
        self.links.completions = completions;
        n
    }

    pub(super) fn drain_inbox(&mut self) -> usize {
        let mut n = 0;
        while let Ok(item) = self.filters.inbox.try_recv() {
            n += 1;
            match item {
                Inbox::Decided { xid, done } => self.decided(xid, done),
                Inbox::Callout {
                    xid,
                    park,
                    token,
                    reply,
                } => self.callout_done(xid, park, token, *reply),
                Inbox::RootCallout { to, token, reply } => {
                    self.filters.chains.root_callout(&to, token, &reply);
                    self.root_calls();
                }
                #[cfg(feature = "fault-injection")]
                Inbox::Panic => panic!("injected data plane panic"),
            }
        }
        n
    }

    pub(super) fn link_message(&mut self, qp: u32, message: Message) {
        match message {
            Message::Request(r) => self.link_request(qp, r),
            Message::Response(r) => self.peer_response(qp, r),
            Message::Credit => {}
            Message::Window { xid, count } => self.stream_window(qp, xid, count),
            Message::Cancel { xid } => self.stream_cancel(qp, xid),
            Message::UpChunk(c) => self.upload_chunk(qp, c),
            // Of a pod's call whose body streams to the peer.
            Message::UpWindow { xid, count } => self.pod_upload_window(qp, xid, count),
            Message::UpCancel { xid } => self.pod_upload_refused(qp, xid),
            Message::Chunk(c) if self.call_streams.has_link_stream(qp, c.xid) => {
                self.call_stream_chunk(qp, c);
            }
            Message::Chunk(c) => {
                // A peer's stream to a pod's call was given up (the caller stopped
                // it): its last frame frees what the call lent it.
                if !matches!(c.end, dpumesh_dpa::frame::ChunkEnd::More)
                    && let Some(o) = self.table.take_orphan(qp, c.xid)
                {
                    self.release_rx(o.d.src_pod, o.reply_slot);
                    self.hand_back(&o.d);
                }
            }
        }
    }

    /// A request from the ingress or a peer proxy.
    pub(super) fn link_request(&mut self, qp: u32, r: Request) {
        self.meter.stats.requests.fetch_add(1, Ordering::Relaxed);
        self.meter.shard_requests.increment(1);
        let origin = Origin::Link {
            qp,
            xid: r.xid,
            reply: r.reply,
        };
        let mut head = match wire::decode_request(&r.head) {
            Ok(head) => head,
            Err(e) => {
                let e = ProxyError::new(
                    ErrorKind::MalformedRequest,
                    format!("malformed request head: {e}"),
                );
                self.reply_origin_error(&origin, &e);
                return;
            }
        };
        let mut flags = r.flags;
        self.trust_claims(qp, &mut head, &mut flags);
        let limit = (r.deadline_ms > 0).then(|| Duration::from_millis(u64::from(r.deadline_ms)));
        if !flags.stream {
            self.admit(origin, head, r.body, flags, limit);
            return;
        }
        // Its body streams through the requester's buffer: nothing is read until the
        // chain let it through and a pod takes it.
        let opened = r.body.is_some_and(|b| self.upload_open(qp, r.xid, b));
        if !opened {
            let e = ProxyError::new(
                ErrorKind::MalformedRequest,
                "a streamed request needs a buffer of at least one window",
            );
            self.reply_origin_error(&origin, &e);
            return;
        }
        match self.admit(origin, head, None, flags, limit) {
            Some(xid) => self.upload_admitted(qp, r.xid, xid),
            None => self.upload_cancel((qp, r.xid), false),
        }
    }

    /// What a request says of itself is believed as far as its link's proven peer
    /// vouches for it: "already policed" and a source workload identity only from a
    /// node (which policed the request and knows its pod); from the ingress, neither
    /// (it polices nothing and knows no workload), but the principal of a client
    /// certificate it verified, when that names no identity of the mesh's domain. A mesh without mutual TLS proves
    /// nothing and believes everything (`identity.mtls: off` warns of this); a mesh
    /// that requires identities believes nothing from a link that proved none (a
    /// backend without authentication: fail closed).
    fn trust_claims(&self, qp: u32, head: &mut RequestHead, flags: &mut RequestFlags) {
        let peer = self
            .links
            .by_qp
            .get(&qp)
            .and_then(|s| s.link.peer_identity());
        match peer {
            Some(peer) if peer.is_node() => return,
            None if !self.topology.require_identity => return,
            // The ingress (or a link that proved nothing): the chain's metadata is
            // the filters' to set, so of what it says only the path it normalized
            // is kept.
            _ => keep_edge_metadata(head),
        }
        // A client principal the ingress verified (its client certificate) stands;
        // the ingress never vouches for a name of the mesh's own.
        let vouched = match (peer, head.source.identity.as_deref()) {
            (Some(peer), Some(claimed)) => {
                peer.is_ingress()
                    && !dpumesh_identity::spiffe::in_trust_domain(claimed, &peer.trust_domain)
            }
            _ => false,
        };
        let peer = match peer {
            // Nothing claimed, nothing to drop (every request from the ingress): the
            // peer's name is formatted only for a warning.
            _ if !flags.policed && !flags.call && (vouched || head.source.identity.is_none()) => {
                return;
            }
            Some(peer) => peer.to_string(),
            None => "an unauthenticated link".to_owned(),
        };
        if flags.policed {
            tracing::warn!(%peer, path = %head.path, "a request claimed to be policed by a peer that is not a node: its chain runs");
            metrics::counter!("dpumesh_untrusted_claims_total", "claim" => "policed").increment(1);
            flags.policed = false;
        }
        if flags.call {
            tracing::warn!(%peer, authority = %head.authority, "a request claimed to be a mesh call by a peer that is not a node: only routes let it in");
            metrics::counter!("dpumesh_untrusted_claims_total", "claim" => "call").increment(1);
            flags.call = false;
        }
        if vouched {
            return;
        }
        if let Some(claimed) = head.source.identity.take() {
            tracing::warn!(%peer, claimed, "a request claimed a workload identity its peer cannot vouch for: dropped");
            metrics::counter!("dpumesh_untrusted_claims_total", "claim" => "identity").increment(1);
        }
    }

    /// A request from a pod on this node (case 1 or 3). Nothing the pod wrote is
    /// believed but the request itself: its identity is the ring's, its metadata is
    /// dropped (only filters set metadata: a pod's `jwt.payload` would be read as
    /// verified claims, its `wasm.*` as proxy-wasm properties), the mesh's own headers
    /// are removed, and its path is normalized as the ingress normalizes a client's.
    pub(super) fn pod_request(&mut self, d: Descriptor) {
        self.meter.stats.requests.fetch_add(1, Ordering::Relaxed);
        self.meter.shard_requests.increment(1);
        let origin = Origin::Pod { d };
        let bytes = match self.pods.port.header(&d) {
            Ok(b) => b,
            Err(e) => {
                let e = ProxyError::new(
                    ErrorKind::MalformedRequest,
                    format!("unreadable request head: {e}"),
                );
                self.reply_origin_error(&origin, &e);
                return;
            }
        };
        let mut head = match wire::decode_request(&bytes) {
            Ok(head) => head,
            Err(e) => {
                let e = ProxyError::new(
                    ErrorKind::MalformedRequest,
                    format!("malformed request head: {e}"),
                );
                self.reply_origin_error(&origin, &e);
                return;
            }
        };
        head.clear_metadata();
        head.remove_reserved();
        if let Err(e) = head.normalize_path(&self.topology.path) {
            let e = ProxyError::new(ErrorKind::MalformedRequest, format!("{e}: {:?}", head.path));
            self.reply_origin_error(&origin, &e);
            return;
        }
        // Who is calling is the data path's to say, not the pod's: its service's
        // workload ID (one allocation; `pod` first takes a new pod into the table).
        let _ = self.pods.get(d.src_pod);
        let identity = self
            .pods
            .known
            .iter()
            .find(|p| p.id == d.src_pod)
            .map(|p| format!("{}{}", self.topology.workload_prefix, p.service));
        head.source = Peer {
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            identity,
        };
        let flags = RequestFlags {
            stream: d.kind.stream,
            ..RequestFlags::default()
        };
        if !flags.stream {
            self.admit(origin, head, None, flags, None);
            return;
        }
        // Its parts wait from now on (the chain may send it on before `admit`
        // returns).
        self.pod_upload_open(&d);
        let exchange = self.admit(origin, head, None, flags, None);
        self.pod_upload_admitted(&d, exchange);
    }

    /// Routes a request and runs its chain (unless a peer proxy already did);
    /// the exchange it opened, if it did (else it was answered).
    pub(super) fn admit(
        &mut self,
        origin: Origin,
        mut head: RequestHead,
        body: Option<RemoteBuf>,
        flags: RequestFlags,
        limit: Option<Duration>,
    ) -> Option<u32> {
        let snapshot = self.filters.policy.snapshot();
        let routed = if flags.policed {
            head.destination.clone().map(|s| {
                let policy = snapshot.service_policy(&s);
                // Observed where its chain ran (the node that sent it), not again here.
                (s, usize::MAX, policy, None)
            })
        } else {
            let routed = match origin {
                // A pod's call, or a node's (a filter's callout), names its service; it
                // meets that service's chain.
                Origin::Pod { .. } => snapshot.resolve_call(&head.authority, &head.path),
                Origin::Link { .. } if flags.call => {
                    snapshot.resolve_call(&head.authority, &head.path)
                }
                // From a link otherwise: the ingress (or a peer whose claim was not
                // believed). Only routes let a request in.
                Origin::Link { .. } => snapshot.resolve_route(&head.authority, &head.path),
            };
            routed.map(|r| (r.service, r.chain, r.policy, Some(r.route)))
        };
        let Some((service, chain, policy, route)) = routed else {
            let e = ProxyError::new(
                ErrorKind::NoRoute,
                format!(
                    "no route for host {:?} path {:?}",
                    head.authority, head.path
                ),
            );
            self.reply_origin_error(&origin, &e);
            return None;
        };
        head.destination = Some(service.clone());
        let opening = Opening {
            origin,
            service,
            traits: RequestTraits {
                streamed: flags.stream,
                ..RequestTraits::of(&head)
            },
            body,
            policy,
            default_timeout: self.topology.timeout,
            limit,
            head: None,
            // Before the chain gives this hop its own span id: the caller's span.
            trace_parent: match (&self.topology.observer.traces, &route) {
                (Some(_), Some(_)) => head
                    .headers()
                    .get(&TRACEPARENT)
                    .and_then(|v| v.to_str().ok())
                    .and_then(dpumesh_traces::TraceContext::parse),
                _ => None,
            },
            route,
        };
        if flags.policed {
            // Decided by the proxy that sent it: no chain here.
            let decided = Opening {
                head: Some(head),
                ..opening
            };
            let xid = self.table.open(decided, Instant::now());
            self.dispatch(xid);
            return Some(xid);
        }
        let xid = self.table.open(opening, Instant::now());
        let generation = &snapshot.generation;
        if !generation.chains()[chain].offload() {
            // Run to completion here: the chain's instances are this thread's.
            let done = self.filters.chains.on_request(generation, chain, head);
            self.decided(xid, Ok(Box::new(done)));
            return Some(xid);
        }
        // A chain with a filter slow by nature runs on the pool; its verdict comes
        // back through the inbox and the bell.
        let inbox = self.filters.inbox_tx.clone();
        let bell = self.bell.clone();
        let submitted =
            self.filters
                .policy
                .pool()
                .request_with(generation.clone(), chain, head, move |done| {
                    let _ = inbox.send(Inbox::Decided {
                        xid,
                        done: done.map(Box::new),
                    });
                    bell.ring();
                });
        if let Err(e) = submitted {
            self.fail(xid, pool_error(e));
        }
        Some(xid)
    }

    /// Runs a response phase where its request phase ran: inline, or on the pool for
    /// an offloaded chain. Response filters do not edit the response, so nobody waits
    /// for the result.
    pub(super) fn run_response_phase(
        &mut self,
        ticket: Ticket,
        head: RequestHead,
        info: ResponseInfo,
    ) {
        if ticket.worker == SHARD_RUNNER {
            self.filters.chains.on_response(&ticket, head, &info);
        } else {
            let _ = self
                .filters
                .policy
                .pool()
                .response_with(ticket, head, info, |_| {});
        }
    }

    /// The chain decided (or its worker died with the request).
    pub(super) fn decided(&mut self, xid: u32, done: Result<Box<RequestDone>, PoolError>) {
        let done = match done {
            Ok(done) => *done,
            Err(e) => {
                self.fail(xid, pool_error(e));
                return;
            }
        };
        let Some(exchange) = self.table.get_mut(xid) else {
            // Timed out while filtering: the response phase still runs.
            let info = ResponseInfo {
                status: 504,
                latency_ns: 0,
                upstream: None,
                failure: FailureKind::Timeout,
            };
            if let Decision::Pause { park, .. } = done.outcome.decision {
                // Paused again (or first) after its exchange ended: given up there.
                self.abandon_parked(done.ticket, park, info);
                return;
            }
            self.run_response_phase(done.ticket, done.outcome.head, info);
            return;
        };
        exchange.ticket = Some(done.ticket);
        exchange.park = None;
        let outcome = done.outcome;
        if !outcome.times.is_empty() {
            exchange.seen.filters = outcome.times;
        }
        match outcome.decision {
            Decision::Pause { park, callouts } => self.park(xid, park, callouts),
            Decision::Deny { filter, reply, .. } => {
                metrics::counter!(
                    "dpumesh_denials_total",
                    "service" => exchange.service.clone(),
                    "filter" => filter.to_string(),
                    "status" => reply.status.to_string(),
                )
                .increment(1);
                exchange.head = Some(outcome.head);
                exchange.seen.denied_by = Some(filter);
                let mut headers = HeaderMap::new();
                for (name, value) in &reply.headers {
                    if let (Ok(n), Ok(v)) = (
                        HeaderName::from_bytes(name.as_bytes()),
                        HeaderValue::from_str(value),
                    ) {
                        headers.append(n, v);
                    }
                }
                let head = ResponseHead {
                    status: reply.status,
                    headers,
                    ..Default::default()
                };
                self.finish_with(
                    xid,
                    &head,
                    reply.body.into_bytes(),
                    FailureKind::LocalReply,
                    None,
                );
            }
            Decision::Continue => {
                exchange.head = Some(outcome.head);
                // Only a route with `cache` pays for the cache's look.
                if exchange.policy.cache.is_some() && self.cache_request(xid) {
                    return;
                }
                self.dispatch(xid);
            }
        }
    }
}

/// Of a head's metadata from the mesh's edge, keeps only the path the ingress
/// normalized away ([`ORIGINAL_PATH_METADATA`]); everything else is dropped.
fn keep_edge_metadata(head: &mut RequestHead) {
    if head
        .metadata_entries()
        .all(|(k, _)| k == ORIGINAL_PATH_METADATA)
    {
        return;
    }
    metrics::counter!("dpumesh_untrusted_claims_total", "claim" => "metadata").increment(1);
    let original = head.metadata(ORIGINAL_PATH_METADATA).map(str::to_owned);
    head.clear_metadata();
    if let Some(original) = original {
        head.set_metadata(ORIGINAL_PATH_METADATA, &original);
    }
}

//! The exchange table: every request the data plane holds, from its admission to its
//! answer, and the decisions about it that do not touch a link, a ring or a clock.
//!
//! It is sans-I/O: the shard tells it what happened (a request admitted, a try
//! started, a pod's answer, a peer's answer, a link lost, pods gone, time passed, with
//! the time passed in) and it answers with what that means for the exchanges (which one
//! an answer belongs to, which tries timed out, what a lost link takes with it). The
//! shard does the I/O those answers call for. So retries, per-try timeouts, late and
//! stray answers, link loss and pod death are tested here as tables, with no process,
//! no fabric and no sleep.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::time::{Duration, Instant};

use dpumesh_config::RoutePolicy;
use dpumesh_dpa::frame::RemoteBuf;
use dpumesh_dpa::{Buffer, Descriptor};
use dpumesh_runtime::{RequestHead, Ticket};

use super::layers::{retry, timeout};

/// Where a request came from (and where its answer goes).
#[derive(Debug, Clone, Copy)]
pub(super) enum Origin {
    /// Over the fabric: the ingress or a peer proxy.
    Link { qp: u32, xid: u32, reply: RemoteBuf },
    /// A pod on this node; `d` is its descriptor as the shard took it from the pod's
    /// ring (its header in a DPU pool, its body still in the pod's TX pool).
    Pod { d: Descriptor },
}

/// Where an admitted request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stage {
    /// Waiting for the chain (or for its next try).
    Filtering,
    /// Its body is being read into a pod's RX pool.
    Reading,
    /// Delivered to pod `pod`; its answer is awaited under `key` and must come from it.
    Pod { key: PodKey, pod: u32 },
    /// Sent to a peer proxy over link `qp`; the answer's body lands in `reply_slot`.
    Peer { qp: u32, reply_slot: Buffer },
}

/// How a pod's answer names the request: (the pod it goes to, req_id, step_id). The
/// proxy's own deliveries go to "pod 0" (outside the node).
pub(super) type PodKey = (u32, u32, u32);

/// One request in flight.
#[derive(Debug)]
pub(super) struct Exchange {
    pub origin: Origin,
    /// The head the chain left (`None` while filtering).
    pub head: Option<RequestHead>,
    pub service: String,
    /// Where its response phase runs.
    pub ticket: Option<Ticket>,
    /// Parked in its chain runner (under this id) while a filter's HTTP calls run.
    pub park: Option<u32>,
    pub started: Instant,
    pub deadline: Instant,
    pub stage: Stage,
    /// Body waiting at the origin's side of a link.
    pub body: Option<RemoteBuf>,
    /// Tries so far.
    pub attempt: u32,
    /// Timeout and retries of its route.
    pub policy: RoutePolicy,
    /// When the current try times out.
    pub try_deadline: Option<Instant>,
    /// What its request is, fixed when it opened.
    pub traits: RequestTraits,
    /// What the response cache does with its answer.
    pub cache: Option<Box<super::cache::Pending>>,
    /// What this node observes of it ([`Opening::route`]).
    pub seen: Seen,
}

/// What the node's metrics, tap and access log say of an exchange beyond its head.
#[derive(Debug, Default)]
pub(super) struct Seen {
    /// Its route's label; `None` when another node ran its chain (and observes it).
    pub route: Option<std::sync::Arc<str>>,
    /// The filter that denied it.
    pub denied_by: Option<std::sync::Arc<str>>,
    /// A gRPC call's status, when its answer carried one.
    pub grpc_status: Option<u32>,
    /// Each filter's time, while someone looks ([`dpumesh_runtime::timing`]).
    pub filters: Vec<dpumesh_runtime::timing::FilterTime>,
    /// The trace context the request came with (read only while spans are exported).
    pub trace_parent: Option<dpumesh_traces::TraceContext>,
}

impl Exchange {
    /// What the exchange allows a failed try (read by [`retry`]).
    fn allowance(&self) -> retry::Allowance {
        retry::Allowance {
            attempt: self.attempt,
            retries: self.policy.retries,
            idempotent: self.traits.idempotent
                || (self.traits.grpc && !self.policy.grpc_retry_on.is_empty()),
            // A pod's body is handed on by the first try; one at the ingress can be
            // read again.
            body_at_hand: match &self.origin {
                // A streamed body went to the pod part by part: it is not at hand.
                Origin::Link { .. } => !self.traits.streamed,
                Origin::Pod { .. } => !self.traits.had_body && !self.traits.streamed,
            },
            at_pod: matches!(self.stage, Stage::Pod { .. }),
            deadline: self.deadline,
        }
    }
}

/// What the table needs to open an exchange.
#[derive(Debug)]
pub(super) struct Opening {
    pub origin: Origin,
    pub service: String,
    /// What the head says of the request ([`RequestTraits::of`]; `had_body` is the
    /// table's to find).
    pub traits: RequestTraits,
    pub body: Option<RemoteBuf>,
    pub policy: RoutePolicy,
    /// The mesh's timeout for routes that set none.
    pub default_timeout: Duration,
    /// What the sender will wait, if it said.
    pub limit: Option<Duration>,
    /// The head, when it arrives decided (a request a peer's proxy policed); `None`
    /// while the chain has it.
    pub head: Option<RequestHead>,
    /// Its route's label, when this node runs its chain (and so observes it).
    pub route: Option<std::sync::Arc<str>>,
    /// The trace context it came with, while spans are exported.
    pub trace_parent: Option<dpumesh_traces::TraceContext>,
}

/// What an exchange knows of its request beyond the head, fixed when it opens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct RequestTraits {
    /// GET, HEAD, OPTIONS, PUT, DELETE, TRACE.
    pub idempotent: bool,
    /// The request came with a body (a pod's body is handed on by the first try).
    pub had_body: bool,
    /// A gRPC call: the proxy's own answers to it are trailers-only gRPC responses.
    pub grpc: bool,
    /// Its body streams (an upload: `upload`), so it cannot be sent twice.
    pub streamed: bool,
    /// A gRPC call's `grpc-timeout`: its deadline bounds a streamed answer too.
    pub grpc_timeout: Option<Duration>,
}

impl RequestTraits {
    /// What `head` says: its method's idempotence, whether it is gRPC.
    pub fn of(head: &RequestHead) -> Self {
        let grpc = dpumesh_head::grpc::is_grpc(head.headers());
        Self {
            idempotent: matches!(
                head.method.as_str(),
                "GET" | "HEAD" | "OPTIONS" | "PUT" | "DELETE" | "TRACE"
            ),
            had_body: false,
            grpc,
            streamed: false,
            // A malformed one was refused at the ingress.
            grpc_timeout: grpc
                .then(|| head.headers().get("grpc-timeout")?.to_str().ok())
                .flatten()
                .and_then(|v| dpumesh_head::grpc::parse_timeout(v).ok()),
        }
    }
}

/// An RDMA operation in flight for an exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Transfer {
    /// A request body read into pod `pod`'s RX slot `slot`; `header` (in a DPU pool)
    /// goes with it once it is in.
    Read {
        qp: u32,
        xid: u32,
        pod: u32,
        slot: Buffer,
        header: Buffer,
    },
    /// A response body written out of a pod's TX pool; `done` hands it back.
    Write { qp: u32, done: Descriptor },
    /// A piece of a streamed answer's part written into a window; `done` (the part,
    /// when this is its last piece) is handed back.
    StreamWrite { qp: u32, done: Option<Descriptor> },
    /// A part of a streamed request body (of the requester's `xid` over `qp`) read
    /// into pod `pod`'s RX slot `slot`.
    UpRead {
        qp: u32,
        xid: u32,
        pod: u32,
        slot: Buffer,
    },
}

impl Transfer {
    fn qp(&self) -> u32 {
        match self {
            Transfer::Read { qp, .. }
            | Transfer::Write { qp, .. }
            | Transfer::StreamWrite { qp, .. }
            | Transfer::UpRead { qp, .. } => *qp,
        }
    }
}

/// A call to a peer that was answered locally (timeout) while the peer may still use
/// the caller's body and reply slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Orphan {
    pub qp: u32,
    pub d: Descriptor,
    pub reply_slot: Buffer,
}

/// Whose a pod's answer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum PodAnswer {
    /// The answer to exchange `xid`'s current try (the table no longer waits for it).
    Current(u32),
    /// Nobody waits for it: its exchange ended (a timeout, a lost origin) or it answers
    /// a try given up on.
    Stale,
    /// It came from another pod than the one the try went to.
    Impostor,
}

/// Whose a peer proxy's answer is.
#[derive(Debug)]
pub(super) enum PeerAnswer {
    /// The answer to the exchange, which leaves the table; its body landed in
    /// `reply_slot` (if it has one).
    Current {
        exchange: Box<Exchange>,
        reply_slot: Buffer,
    },
    /// The late answer to a call already answered locally: the peer is done with what
    /// was lent to it.
    Orphan(Orphan),
    /// Nothing waits for it over this link.
    Unknown,
}

/// A timer that fired.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Due {
    /// The try at a pod ran out of its per-try time (the exchange has time left).
    TryTimeout(u32),
    /// The exchange ran out of time.
    Timeout(u32),
}

/// What a lost link takes with it.
#[derive(Debug, Default)]
pub(super) struct LinkLoss {
    /// Operations that will never complete: what they hold goes back.
    pub transfers: Vec<Transfer>,
    /// Calls answered locally whose peer can no longer use what was lent to it.
    pub orphans: Vec<Orphan>,
    /// Exchanges that came over the link: nobody is left to answer (they left the
    /// table).
    pub dropped: Vec<Exchange>,
    /// Exchanges that went out over it: they fail (still in the table).
    pub failed: Vec<u32>,
}

/// The table's maps: looked up several times per request with keys the shard makes
/// (exchange ids, pods' request ids), so hashed with seeded foldhash rather than
/// SipHash (which took ~1.5 % of the shard's samples).
type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;
type FastSet<K> = std::collections::HashSet<K, foldhash::fast::RandomState>;

/// Timers of ended exchanges (or replaced tries) the heap may hold beyond twice the
/// live exchanges before they are dropped (see `ExchangeTable::compact_timers`).
const TIMER_SLACK: usize = 1024;

/// The exchanges in flight, the timers, the transfers and the orphans.
#[derive(Debug)]
pub(super) struct ExchangeTable {
    exchanges: FastMap<u32, Exchange>,
    at_pod: FastMap<PodKey, u32>,
    transfers: FastMap<u64, Transfer>,
    orphans: FastMap<u32, Orphan>,
    /// Ids of exchanges that left the table while a peer still names them in its
    /// frames (a call's answer streaming in over a link): not given out again.
    held: FastSet<u32>,
    timers: BinaryHeap<Reverse<(Instant, u32)>>,
    next_xid: u32,
    next_token: u64,
}

impl Default for ExchangeTable {
    fn default() -> Self {
        Self {
            exchanges: FastMap::default(),
            at_pod: FastMap::default(),
            transfers: FastMap::default(),
            orphans: FastMap::default(),
            held: FastSet::default(),
            timers: BinaryHeap::new(),
            next_xid: 1,
            next_token: 1,
        }
    }
}

impl ExchangeTable {
    /// Exchanges in flight.
    pub fn len(&self) -> usize {
        self.exchanges.len()
    }

    pub fn get(&self, xid: u32) -> Option<&Exchange> {
        self.exchanges.get(&xid)
    }

    pub fn get_mut(&mut self, xid: u32) -> Option<&mut Exchange> {
        self.exchanges.get_mut(&xid)
    }

    /// Opens an exchange at `now` and arms its deadline: the route's timeout (or the
    /// mesh's), within what the sender will wait.
    pub fn open(&mut self, o: Opening, now: Instant) -> u32 {
        let xid = self.new_xid();
        let deadline = timeout::deadline(now, o.policy.timeout, o.default_timeout, o.limit);
        self.timers.push(Reverse((deadline, xid)));
        let traits = RequestTraits {
            had_body: match &o.origin {
                Origin::Link { .. } => o.body.is_some(),
                Origin::Pod { d } => !d.body.is_none(),
            },
            ..o.traits
        };
        self.exchanges.insert(
            xid,
            Exchange {
                origin: o.origin,
                head: o.head,
                service: o.service,
                ticket: None,
                park: None,
                started: now,
                deadline,
                stage: Stage::Filtering,
                body: o.body,
                attempt: 0,
                policy: o.policy,
                try_deadline: None,
                traits,
                cache: None,
                seen: Seen {
                    route: o.route,
                    trace_parent: o.trace_parent,
                    ..Seen::default()
                },
            },
        );
        xid
    }

    fn new_xid(&mut self) -> u32 {
        loop {
            let xid = self.next_xid;
            self.next_xid = self.next_xid.wrapping_add(1).max(1);
            if !self.exchanges.contains_key(&xid)
                && !self.orphans.contains_key(&xid)
                && !self.held.contains(&xid)
            {
                return xid;
            }
        }
    }

    /// Starts a try: counts it and arms its per-try timer. The exchange, to send on
    /// (`None`: it is gone).
    pub fn start_try(&mut self, xid: u32, now: Instant) -> Option<&mut Exchange> {
        self.exchanges.get_mut(&xid)?.attempt += 1;
        self.arm_try(xid, now);
        self.exchanges.get_mut(&xid)
    }

    /// (Re)arms the current try's timer from `now` (a try's clock restarts when the
    /// pod has the request: reading its body is not the pod's time).
    pub fn arm_try(&mut self, xid: u32, now: Instant) {
        let Some(e) = self.exchanges.get_mut(&xid) else {
            return;
        };
        if let Some(at) = timeout::try_deadline(now, e.policy.per_try_timeout, e.deadline) {
            e.try_deadline = Some(at);
            self.timers.push(Reverse((at, xid)));
        }
    }

    /// The current try is at pod `pod`, whose answer will carry `key`.
    pub fn at_pod(&mut self, xid: u32, key: PodKey, pod: u32) {
        if let Some(e) = self.exchanges.get_mut(&xid) {
            e.stage = Stage::Pod { key, pod };
            self.at_pod.insert(key, xid);
        }
    }

    /// Whose the answer under `key` from pod `from` is.
    pub fn pod_answer(&mut self, key: PodKey, from: u32) -> PodAnswer {
        let expected = self
            .at_pod
            .get(&key)
            .and_then(|xid| match self.exchanges.get(xid)?.stage {
                Stage::Pod { pod, .. } => Some(pod),
                _ => None,
            });
        match expected {
            None => PodAnswer::Stale,
            Some(pod) if pod != from => PodAnswer::Impostor,
            Some(_) => match self.at_pod.remove(&key) {
                Some(xid) => PodAnswer::Current(xid),
                None => PodAnswer::Stale,
            },
        }
    }

    /// The exchange whose try under `key` could not be delivered (the table no
    /// longer waits for its answer).
    pub fn undelivered(&mut self, key: PodKey) -> Option<u32> {
        self.at_pod.remove(&key)
    }

    /// Whether the try of `xid` that failed with `failure` at `now` is tried again
    /// ([`retry`]).
    /// The gRPC statuses a gRPC exchange's route retries on; `None` for any other
    /// exchange (its answer's gRPC status need not be read).
    pub fn grpc_retry_on(&self, xid: u32) -> Option<dpumesh_config::GrpcCodes> {
        self.exchanges
            .get(&xid)
            .filter(|e| e.traits.grpc && !e.policy.grpc_retry_on.is_empty())
            .map(|e| e.policy.grpc_retry_on)
    }

    pub fn tries_again(&self, xid: u32, failure: retry::Failure, now: Instant) -> bool {
        self.exchanges
            .get(&xid)
            .is_some_and(|e| retry::again(failure, &e.allowance(), now))
    }

    /// Gives up the current try (its answer, if it comes, is stale) so the exchange
    /// can be dispatched again.
    pub fn begin_retry(&mut self, xid: u32) -> Option<&Exchange> {
        let e = self.exchanges.get_mut(&xid)?;
        if let Stage::Pod { key, .. } = e.stage {
            self.at_pod.remove(&key);
        }
        e.stage = Stage::Filtering;
        e.try_deadline = None;
        Some(e)
    }

    /// Ends an exchange: it leaves the table, and an answer to it is stale from now.
    pub fn close(&mut self, xid: u32) -> Option<Exchange> {
        let e = self.exchanges.remove(&xid)?;
        if let Stage::Pod { key, .. } = e.stage {
            self.at_pod.remove(&key);
        }
        self.compact_timers();
        Some(e)
    }

    /// Drops the timers that mean nothing any more once they outnumber the live
    /// exchanges' by [`TIMER_SLACK`]. The heap cannot remove an ended exchange's timer,
    /// so without this it held one per request for a whole timeout (a 5 s timeout at
    /// 50k requests a second: 250k timers, and each coming due cost a pop down 18
    /// levels of a heap larger than the cache). Rebuilding is linear in the heap and
    /// happens once per [`TIMER_SLACK`] ended exchanges or so: constant per request.
    fn compact_timers(&mut self) {
        if self.timers.len() <= 2 * self.exchanges.len() + TIMER_SLACK {
            return;
        }
        let exchanges = &self.exchanges;
        self.timers.retain(|Reverse((at, xid))| {
            exchanges
                .get(xid)
                .is_some_and(|e| e.deadline == *at || e.try_deadline == Some(*at))
        });
    }

    /// When the next timer fires.
    pub fn next_timer(&self) -> Option<Instant> {
        self.timers.peek().map(|t| t.0.0)
    }

    /// The next timer that fired by `now` and still means something (a try's timer
    /// that a later try replaced, or an ended exchange's, means nothing).
    pub fn due(&mut self, now: Instant) -> Option<Due> {
        while let Some(Reverse((at, xid))) = self.timers.peek().copied() {
            if at > now {
                return None;
            }
            self.timers.pop();
            let Some(e) = self.exchanges.get(&xid) else {
                continue;
            };
            if e.deadline <= now {
                return Some(Due::Timeout(xid));
            }
            if e.try_deadline.is_some_and(|t| t <= now) && matches!(e.stage, Stage::Pod { .. }) {
                return Some(Due::TryTimeout(xid));
            }
        }
        None
    }

    /// A token for an RDMA operation about to be posted.
    pub fn next_token(&mut self) -> u64 {
        let t = self.next_token;
        self.next_token += 1;
        t
    }

    /// The operation posted under `token`, until it completes.
    pub fn track(&mut self, token: u64, op: Transfer) {
        // A READ of a request's body: its exchange waits for it.
        if let Transfer::Read { xid, .. } = op
            && let Some(e) = self.exchanges.get_mut(&xid)
        {
            e.stage = Stage::Reading;
        }
        self.transfers.insert(token, op);
    }

    /// The operation under `token` completed.
    pub fn transfer_done(&mut self, token: u64) -> Option<Transfer> {
        self.transfers.remove(&token)
    }

    /// `xid` stays named by a peer after its exchange left the table: it is not given
    /// to a new exchange until [`ExchangeTable::release_xid`].
    pub fn hold_xid(&mut self, xid: u32) {
        self.held.insert(xid);
    }

    /// The peer names `xid` no more.
    pub fn release_xid(&mut self, xid: u32) {
        self.held.remove(&xid);
    }

    /// Exchange `xid` was answered locally while its peer keeps what was lent to it.
    pub fn orphan(&mut self, xid: u32, o: Orphan) {
        self.orphans.insert(xid, o);
    }

    /// The orphan `xid` over link `qp`, whose peer is now done with what was lent.
    pub fn take_orphan(&mut self, qp: u32, xid: u32) -> Option<Orphan> {
        if self.orphans.get(&xid).is_some_and(|o| o.qp == qp) {
            return self.orphans.remove(&xid);
        }
        None
    }

    /// Whose the peer's answer to `xid` over link `qp` is.
    pub fn peer_answer(&mut self, qp: u32, xid: u32) -> PeerAnswer {
        if self.orphans.get(&xid).is_some_and(|o| o.qp == qp)
            && let Some(orphan) = self.orphans.remove(&xid)
        {
            return PeerAnswer::Orphan(orphan);
        }
        match self.exchanges.get(&xid).map(|e| e.stage) {
            Some(Stage::Peer { qp: at, reply_slot }) if at == qp => {
                match self.exchanges.remove(&xid) {
                    Some(e) => PeerAnswer::Current {
                        exchange: Box::new(e),
                        reply_slot,
                    },
                    None => PeerAnswer::Unknown,
                }
            }
            _ => PeerAnswer::Unknown,
        }
    }

    /// Link `qp` is gone: what it takes with it.
    pub fn link_down(&mut self, qp: u32) -> LinkLoss {
        let mut loss = LinkLoss::default();
        let tokens: Vec<u64> = self
            .transfers
            .iter()
            .filter(|(_, op)| op.qp() == qp)
            .map(|(t, _)| *t)
            .collect();
        for op in tokens.iter().filter_map(|t| self.transfers.remove(t)) {
            if let Transfer::Read { xid, .. } = op
                && let Some(e) = self.exchanges.get_mut(&xid)
                && e.stage == Stage::Reading
            {
                e.stage = Stage::Filtering;
            }
            loss.transfers.push(op);
        }
        let orphans: Vec<u32> = self
            .orphans
            .iter()
            .filter(|(_, o)| o.qp == qp)
            .map(|(x, _)| *x)
            .collect();
        loss.orphans = orphans
            .into_iter()
            .filter_map(|x| self.orphans.remove(&x))
            .collect();
        let mut affected: Vec<u32> = self
            .exchanges
            .iter()
            .filter(|(_, e)| {
                matches!(e.origin, Origin::Link { qp: q, .. } if q == qp)
                    || matches!(e.stage, Stage::Peer { qp: q, .. } if q == qp)
            })
            .map(|(x, _)| *x)
            .collect();
        affected.sort_unstable();
        for xid in affected {
            if matches!(self.exchanges[&xid].origin, Origin::Link { .. }) {
                loss.dropped.extend(self.close(xid));
            } else {
                loss.failed.push(xid);
            }
        }
        loss
    }

    /// Exchanges whose current try is at a pod that is gone (`live` says which are
    /// not), in order.
    pub fn at_departed_pods(&self, live: impl Fn(u32) -> bool) -> Vec<u32> {
        let mut gone: Vec<u32> = self
            .exchanges
            .iter()
            .filter(|(_, e)| matches!(e.stage, Stage::Pod { pod, .. } if !live(pod)))
            .map(|(x, _)| *x)
            .collect();
        gone.sort_unstable();
        gone
    }

    /// Every exchange in flight, in order (to answer them all after a panic).
    pub fn open_exchanges(&self) -> Vec<u32> {
        let mut all: Vec<u32> = self.exchanges.keys().copied().collect();
        all.sort_unstable();
        all
    }

    /// Forgets the waits and timers (after a panic; the exchanges were answered).
    pub fn clear_waits(&mut self) {
        self.at_pod.clear();
        self.timers.clear();
    }
}

#[cfg(test)]
mod tests;

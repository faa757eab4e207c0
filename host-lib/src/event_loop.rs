//! The service event loop: wakes on transport events
//! and finished internal steps, runs new requests' handlers, feeds completions to
//! their contexts, sends egress requests, runs internal steps on the pool, and answers
//! each request when its graph finishes. Nothing in it blocks on I/O.
//!
//! **The step registry.** An egress request carries `(req_id, step_id)`. `req_id` is a
//! context slot (low 16 bits) and the slot's generation (high 16 bits); `step_id` is a
//! loop-wide request number. A completion is delivered only if its slot still holds
//! the same generation and that step is still awaited there, so a late completion (its
//! step timed out, or its request finished) is dropped, never delivered to whatever
//! request reuses the slot: it would have to match both a 16-bit generation and a
//! 32-bit request number (2^32 egress requests later, in the same slot, after exactly
//! a multiple of 65 536 reuses). At most 65 535 requests are in flight at once; beyond
//! that a request is answered 503 at once.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crossbeam_channel::Receiver;
use foldhash::{HashMap, HashMapExt};

use crate::context::ExecutionContext;
use crate::http::{HttpRequest, HttpResponse};
use crate::pool::{Done, JobKey, Pool, WorkerScope};
use crate::run::{Action, Run, panic_text};
use crate::tasks::Tasks;
use crate::transport::{Event, IncomingId, Tag, Transport, TransportError};

/// A service's handler: builds the graph of one request.
pub type Handler = dyn Fn(&mut ExecutionContext) + Send + Sync;

/// A step timer: (when, sequence, slot, generation, node), earliest first.
type Timer = Reverse<(Duration, u64, u32, u16, usize)>;

const SLOT_BITS: u32 = 16;
const MAX_SLOTS: usize = (1 << SLOT_BITS) - 1;
/// The slot no request has (slots are below [`MAX_SLOTS`]): calls made through an
/// [`Outbound`] travel under it.
const OUTBOUND_SLOT: u32 = MAX_SLOTS as u32;

/// What an [`Outbound`] call's answer is handed to.
type OnAnswer = Box<dyn FnOnce(Result<HttpResponse, String>) + Send>;

struct OutboundCall {
    request: HttpRequest,
    on_answer: OnAnswer,
}

/// Makes mesh calls through a loop from any thread, outside any request's graph:
/// what a bridge's egress port does for the server behind it. The loop sends each
/// call on its next turn (as its service's own call: the node knows the pod) and
/// hands the answer, or why there is none, to the call's `on_answer` on its thread.
#[derive(Clone)]
pub struct Outbound {
    calls: crossbeam_channel::Sender<OutboundCall>,
    wake: crate::transport::Waker,
}

impl std::fmt::Debug for Outbound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outbound").finish_non_exhaustive()
    }
}

impl Outbound {
    /// Sends `request` (its URL names the service: `http://user/me`); `on_answer`
    /// gets the response (any status, as the service or the mesh answered). An
    /// answer whose body streams comes with its head, the rest of its body in
    /// [`HttpResponse::stream`], read at the caller's pace: drop it to stop the
    /// callee.
    pub fn call(
        &self,
        request: HttpRequest,
        on_answer: impl FnOnce(Result<HttpResponse, String>) + Send + 'static,
    ) {
        let call = OutboundCall {
            request,
            on_answer: Box::new(on_answer),
        };
        match self.calls.send(call) {
            Ok(()) => (self.wake)(),
            Err(crossbeam_channel::SendError(call)) => {
                (call.on_answer)(Err("the service's event loop has stopped".into()));
            }
        }
    }
}

/// How the loop is set up.
#[derive(Debug, Clone, Copy)]
pub struct LoopConfig {
    /// Threads for internal steps.
    pub threads: usize,
    /// Most requests in flight (at most 65 535).
    pub max_in_flight: usize,
    /// Which requests' bodies the handler reads as they arrive
    /// ([`crate::HttpRequest::stream`]: uploads of any size, gRPC client streams);
    /// the others' bodies are collected whole before the handler runs. By default
    /// none: a handler written for whole bodies never sees part of one.
    pub stream_requests: fn(&crate::HttpRequest) -> bool,
    /// The largest body collected whole for a handler (past it, the request is
    /// answered 413).
    pub max_request_body: usize,
    /// The largest streamed answer collected whole for a graph's call (past it, the
    /// call fails and the callee is told to stop). [`Outbound`] calls take streamed
    /// answers as they come, of any size.
    pub max_answer_body: usize,
}

impl Default for LoopConfig {
    fn default() -> Self {
        Self {
            threads: 2,
            max_in_flight: MAX_SLOTS,
            stream_requests: |_| false,
            max_request_body: 8 << 20,
            max_answer_body: 8 << 20,
        }
    }
}

impl LoopConfig {
    /// Every request's body streams to the handler (a `tower::Service` that reads
    /// bodies as they come: a tonic server, a bridge).
    pub fn streaming() -> Self {
        Self {
            stream_requests: |_| true,
            ..Self::default()
        }
    }
}

/// Counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoopStats {
    /// Requests received.
    pub requests: u64,
    /// Requests answered.
    pub responses: u64,
    /// Egress requests sent.
    pub egress: u64,
    /// Internal steps run.
    pub internal: u64,
    /// Completions dropped because their step or request was gone.
    pub late_dropped: u64,
    /// Requests refused because too many were in flight.
    pub refused: u64,
}

struct Context {
    generation: u16,
    incoming: IncomingId,
    run: Run,
    pending: HashMap<u32, (usize, usize)>,
    /// Its spans, when the loop exports them.
    trace: Option<Box<crate::spans::RequestTrace>>,
}

/// The requests a loop has in flight: a slot each (its Execution Graph's context),
/// numbered with a generation so a late completion for a slot reused since is known.
struct Requests {
    slots: Vec<Option<Context>>,
    generations: Vec<u16>,
    free: Vec<u32>,
    live: usize,
}

/// The event loop of one service.
pub struct EventLoop<T: Transport> {
    transport: T,
    handler: Arc<Handler>,
    config: LoopConfig,
    /// The requests in flight, by slot.
    requests: Requests,
    pool: Pool,
    done: Receiver<Done>,
    internal_running: usize,
    /// Asynchronous steps' futures, polled on this thread.
    tasks: Tasks,
    /// Calls from [`Outbound`] handles, and the answers they wait for (by step id).
    outbound: (
        crossbeam_channel::Sender<OutboundCall>,
        Receiver<OutboundCall>,
        HashMap<u32, OnAnswer>,
    ),
    timers: BinaryHeap<Timer>,
    timer_seq: u64,
    next_step: u32,
    events: Vec<Event>,
    actions: Vec<Action>,
    queue: VecDeque<Action>,
    stats: LoopStats,
    /// The span exporter, when OpenTelemetry's environment names a collector.
    spans: Option<dpumesh_traces::Exporter>,
}

impl<T: Transport> std::fmt::Debug for EventLoop<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventLoop")
            .field("live", &self.requests.live)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl<T: Transport> EventLoop<T> {
    /// A loop serving `handler` on `transport`.
    pub fn new(
        transport: T,
        handler: impl Fn(&mut ExecutionContext) + Send + Sync + 'static,
        config: LoopConfig,
    ) -> std::io::Result<Self> {
        Self::with_worker_scope(transport, handler, config, None)
    }

    /// A loop whose pool threads each run inside `scope` (see [`WorkerScope`]).
    pub fn with_worker_scope(
        transport: T,
        handler: impl Fn(&mut ExecutionContext) + Send + Sync + 'static,
        config: LoopConfig,
        scope: Option<WorkerScope>,
    ) -> std::io::Result<Self> {
        let mut transport = transport;
        transport.stream_requests(config.stream_requests, config.max_request_body);
        transport.answer_limit(config.max_answer_body);
        let (done_tx, done) = crossbeam_channel::unbounded();
        let pool = Pool::new(config.threads, done_tx, transport.waker(), scope)?;
        let tasks = Tasks::new(transport.waker());
        Ok(Self {
            transport,
            handler: Arc::new(handler),
            config: LoopConfig {
                max_in_flight: config.max_in_flight.min(MAX_SLOTS),
                ..config
            },
            requests: Requests {
                slots: Vec::new(),
                generations: Vec::new(),
                free: Vec::new(),
                live: 0,
            },
            pool,
            done,
            internal_running: 0,
            tasks,
            outbound: {
                let (tx, rx) = crossbeam_channel::unbounded();
                (tx, rx, HashMap::new())
            },
            timers: BinaryHeap::new(),
            timer_seq: 0,
            next_step: 0,
            events: Vec::new(),
            actions: Vec::new(),
            queue: VecDeque::new(),
            stats: LoopStats::default(),
            spans: crate::spans::exporter(),
        })
    }

    /// Stops taking internal steps and waits (at most `patience`) until the pool's
    /// threads ended after the steps they run; whether they all did. Dropping the loop
    /// does not wait (a step stuck forever must not hang it); a binding whose worker
    /// threads must be gone before it goes (Python's interpreter) calls this first.
    pub fn shutdown(&mut self, patience: Duration) -> bool {
        self.pool.shutdown(patience)
    }

    /// A handle that makes calls through this loop from other threads.
    pub fn outbound(&self) -> Outbound {
        Outbound {
            calls: self.outbound.0.clone(),
            wake: self.transport.waker(),
        }
    }

    /// The transport (tests inject requests and read answers through it).
    pub fn transport(&mut self) -> &mut T {
        &mut self.transport
    }

    /// Counters.
    pub fn stats(&self) -> LoopStats {
        self.stats
    }

    /// Requests in flight, and egress requests awaited across them (the registry's
    /// size; both return to zero when the service is quiet).
    pub fn in_flight(&self) -> (usize, usize) {
        let pending = self
            .requests
            .slots
            .iter()
            .flatten()
            .map(|c| c.pending.len())
            .sum();
        (self.requests.live, pending)
    }

    /// Memory the registry holds on to: context slots allocated (they are reused, so
    /// this is the peak of requests in flight).
    pub fn slots_allocated(&self) -> usize {
        self.requests.slots.len()
    }

    /// Time until the earliest timer is due, if one is armed (for a loop driven by a
    /// reactor that does its own waiting: [`crate::reactor`]).
    pub fn next_timer(&self) -> Option<Duration> {
        let now = self.transport.now();
        self.timers
            .peek()
            .map(|Reverse((at, ..))| at.saturating_sub(now))
    }

    /// One turn: finished internal steps, due timers, then whatever the transport has
    /// (waiting at most `max_wait`). Returns how many things happened.
    pub fn turn(&mut self, max_wait: Option<Duration>) -> Result<usize, TransportError> {
        let mut work = self.drain_internal();
        work += self.drain_tasks();
        work += self.send_outbound();
        work += self.fire_timers();
        let now = self.transport.now();
        let next_timer = self
            .timers
            .peek()
            .map(|Reverse((at, ..))| at.saturating_sub(now));
        let wait = match (max_wait, next_timer) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let wait = if work > 0 { Some(Duration::ZERO) } else { wait };
        let mut events = std::mem::take(&mut self.events);
        events.clear();
        let idle = self.internal_running == 0 && self.tasks.live() == 0;
        self.transport.poll(wait, idle, &mut events)?;
        work += events.len();
        for event in events.drain(..) {
            match event {
                Event::Request { id, request } => self.start(id, request),
                Event::Completion { tag, outcome } => self.call_answered(tag, outcome),
            }
        }
        self.events = events;
        work += self.fire_timers();
        work += self.drain_internal();
        work += self.drain_tasks();
        Ok(work)
    }

    /// Turns until nothing is in flight and nothing more can happen (the transport
    /// has nothing to deliver and no timer is armed), or until `stop`.
    pub fn run_until_idle(&mut self) -> Result<(), TransportError> {
        loop {
            let work = self.turn(None)?;
            if work == 0
                && self.internal_running == 0
                && self.tasks.live() == 0
                && self.outbound.2.is_empty()
                && self.timers.is_empty()
            {
                return Ok(());
            }
        }
    }

    /// Turns until `stop` is set.
    pub fn run(&mut self, stop: &AtomicBool) -> Result<(), TransportError> {
        while !stop.load(Ordering::Relaxed) {
            self.turn(Some(Duration::from_millis(50)))?;
        }
        Ok(())
    }

    fn start(&mut self, id: IncomingId, request: crate::http::HttpRequest) {
        self.stats.requests += 1;
        if self.requests.live >= self.config.max_in_flight {
            self.stats.refused += 1;
            let answer = HttpResponse::new(
                503,
                format!(
                    "service overloaded: {} requests in flight\n",
                    self.requests.live
                ),
            );
            let _ = self.transport.send_response(id, answer);
            return;
        }
        let trace = self
            .spans
            .as_ref()
            .map(|e| Box::new(crate::spans::RequestTrace::begin(e, &request)));
        let mut ctx = ExecutionContext::new(request);
        let handler = self.handler.clone();
        let run = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handler(&mut ctx)))
        {
            Ok(()) => {
                let (graph, respond) = ctx.into_graph();
                Run::new(graph, respond).unwrap_or_else(Run::failed)
            }
            Err(panic) => Run::failed(crate::StepError::Panicked(format!(
                "handler: {}",
                panic_text(&*panic)
            ))),
        };
        let slot = match self.requests.free.pop() {
            Some(s) => s,
            None => {
                self.requests.slots.push(None);
                self.requests.generations.push(0);
                (self.requests.slots.len() - 1) as u32
            }
        };
        let generation = self.requests.generations[slot as usize];
        self.requests.slots[slot as usize] = Some(Context {
            generation,
            incoming: id,
            run,
            pending: HashMap::new(),
            trace,
        });
        self.requests.live += 1;
        let mut actions = std::mem::take(&mut self.actions);
        if let Some(ctx) = self.requests.slots[slot as usize].as_mut() {
            ctx.run.start(&mut actions);
        }
        self.apply(slot, actions);
    }

    /// Sends the calls [`Outbound`] handles made since the last turn.
    fn send_outbound(&mut self) -> usize {
        let mut n = 0;
        while let Ok(OutboundCall { request, on_answer }) = self.outbound.1.try_recv() {
            n += 1;
            let step_id = self.next_step;
            self.next_step = self.next_step.wrapping_add(1);
            let tag = Tag {
                req_id: OUTBOUND_SLOT,
                step_id,
            };
            self.stats.egress += 1;
            // The caller forwards the answer (a bridge's egress port): a streamed
            // one reaches it as it comes.
            match self
                .transport
                .send_call(tag, request, crate::AnswerBody::Streamed)
            {
                Ok(()) => {
                    self.outbound.2.insert(step_id, on_answer);
                }
                Err(e) => on_answer(Err(e.to_string())),
            }
        }
        n
    }

    fn call_answered(&mut self, tag: Tag, outcome: Result<HttpResponse, String>) {
        if tag.req_id == OUTBOUND_SLOT {
            match self.outbound.2.remove(&tag.step_id) {
                Some(on_answer) => on_answer(outcome),
                None => self.stats.late_dropped += 1,
            }
            return;
        }
        let slot = tag.req_id & ((1 << SLOT_BITS) - 1);
        let generation = (tag.req_id >> SLOT_BITS) as u16;
        let entry = self
            .requests
            .slots
            .get_mut(slot as usize)
            .and_then(Option::as_mut)
            .filter(|c| c.generation == generation)
            .and_then(|c| c.pending.remove(&tag.step_id));
        let Some((node, part)) = entry else {
            self.stats.late_dropped += 1;
            return;
        };
        let mut actions = std::mem::take(&mut self.actions);
        if let Some(ctx) = self.requests.slots[slot as usize].as_mut() {
            if let (Some(trace), Some(spans)) = (ctx.trace.as_mut(), self.spans.as_ref()) {
                trace.on_answer(spans, node, part, ctx.run.step_id(node), &outcome);
            }
            ctx.run.on_egress(node, part, outcome, &mut actions);
        }
        self.apply(slot, actions);
    }

    fn drain_internal(&mut self) -> usize {
        let mut n = 0;
        while let Ok(done) = self.done.try_recv() {
            n += 1;
            self.internal_running -= 1;
            self.internal_done(done);
        }
        n
    }

    /// Polls the asynchronous steps woken since the last turn.
    fn drain_tasks(&mut self) -> usize {
        let mut finished = Vec::new();
        let n = self.tasks.poll_woken(&mut finished);
        for done in finished {
            self.internal_done(done);
        }
        n
    }

    /// Delivers a finished internal or asynchronous step to its request, if the
    /// request is still the one it ran for.
    fn internal_done(&mut self, Done { key, outcome }: Done) {
        let current = self
            .requests
            .slots
            .get_mut(key.slot as usize)
            .and_then(Option::as_mut)
            .filter(|c| c.generation as u32 == key.generation);
        let Some(ctx) = current else {
            self.stats.late_dropped += 1;
            return;
        };
        let mut actions = std::mem::take(&mut self.actions);
        if let (Some(trace), Some(spans)) = (ctx.trace.as_mut(), self.spans.as_ref()) {
            trace.on_step_done(spans, key.node, ctx.run.step_id(key.node));
        }
        ctx.run.on_internal(key.node, outcome, &mut actions);
        self.apply(key.slot, actions);
    }

    fn fire_timers(&mut self) -> usize {
        let now = self.transport.now();
        let mut n = 0;
        while let Some(Reverse((at, _, slot, generation, node))) = self.timers.peek().copied() {
            if at > now {
                break;
            }
            self.timers.pop();
            n += 1;
            let Some(ctx) = self
                .requests
                .slots
                .get_mut(slot as usize)
                .and_then(Option::as_mut)
                .filter(|c| c.generation == generation)
            else {
                continue;
            };
            let mut actions = std::mem::take(&mut self.actions);
            ctx.run.on_timeout(node, &mut actions);
            self.apply(slot, actions);
        }
        n
    }

    /// Drops timers of finished requests: all of them when nothing is in flight, and
    /// the dead ones whenever they outnumber the live requests four to one (they would
    /// otherwise stay until they fire: request rate × timeout).
    fn prune_timers(&mut self) {
        if self.requests.live == 0 {
            self.timers.clear();
        } else if self.timers.len() > 1024 && self.timers.len() > 4 * self.requests.live {
            let slots = &self.requests.slots;
            self.timers.retain(|Reverse((_, _, slot, generation, _))| {
                slots
                    .get(*slot as usize)
                    .and_then(Option::as_ref)
                    .is_some_and(|c| c.generation == *generation)
            });
        }
    }

    /// Carries out a context's actions (which may produce more), then answers and
    /// frees the context if its graph finished.
    fn apply(&mut self, slot: u32, mut actions: Vec<Action>) {
        // In the order the run asked for them (a fan-out's requests leave in order).
        let mut queue: VecDeque<Action> = std::mem::take(&mut self.queue);
        queue.extend(actions.drain(..));
        while let Some(action) = queue.pop_front() {
            let Some(ctx) = self.requests.slots[slot as usize].as_mut() else {
                break;
            };
            match action {
                Action::Send {
                    node,
                    part,
                    mut request,
                } => {
                    if let Some(trace) = ctx.trace.as_mut() {
                        trace.on_send(node, part, &mut request);
                    }
                    let step_id = self.next_step;
                    self.next_step = self.next_step.wrapping_add(1);
                    ctx.pending.insert(step_id, (node, part));
                    let tag = Tag {
                        req_id: (ctx.generation as u32) << SLOT_BITS | slot,
                        step_id,
                    };
                    self.stats.egress += 1;
                    if let Err(e) = self.transport.send_request(tag, request) {
                        let ctx = self.requests.slots[slot as usize]
                            .as_mut()
                            .expect("checked above");
                        ctx.pending.remove(&step_id);
                        let failed = Err(e.to_string());
                        if let (Some(trace), Some(spans)) =
                            (ctx.trace.as_mut(), self.spans.as_ref())
                        {
                            trace.on_answer(spans, node, part, ctx.run.step_id(node), &failed);
                        }
                        ctx.run.on_egress(node, part, failed, &mut actions);
                        queue.extend(actions.drain(..));
                    }
                }
                Action::Internal {
                    node,
                    func,
                    inputs,
                    on_loop: true,
                } => {
                    // Quick work (answering): here, now, no hand-off.
                    self.stats.internal += 1;
                    if let Some(trace) = ctx.trace.as_mut() {
                        trace.on_step(node);
                    }
                    let outcome = crate::pool::run_step(func, &inputs);
                    if let (Some(trace), Some(spans)) = (ctx.trace.as_mut(), self.spans.as_ref()) {
                        trace.on_step_done(spans, node, ctx.run.step_id(node));
                    }
                    ctx.run.on_internal(node, outcome, &mut actions);
                    queue.extend(actions.drain(..));
                }
                Action::Internal {
                    node, func, inputs, ..
                } => {
                    if let Some(trace) = ctx.trace.as_mut() {
                        trace.on_step(node);
                    }
                    self.stats.internal += 1;
                    self.internal_running += 1;
                    let key = JobKey {
                        slot,
                        generation: ctx.generation as u32,
                        node,
                    };
                    self.pool.submit(key, func, inputs);
                }
                Action::Spawn { node, future } => {
                    self.stats.internal += 1;
                    if let Some(trace) = ctx.trace.as_mut() {
                        trace.on_step(node);
                    }
                    let key = JobKey {
                        slot,
                        generation: ctx.generation as u32,
                        node,
                    };
                    if let Some(done) = self.tasks.spawn(key, future) {
                        // Finished in its first poll: no wake-up, no hand-off.
                        if let (Some(trace), Some(spans)) =
                            (ctx.trace.as_mut(), self.spans.as_ref())
                        {
                            trace.on_step_done(spans, node, ctx.run.step_id(node));
                        }
                        ctx.run.on_internal(node, done.outcome, &mut actions);
                        queue.extend(actions.drain(..));
                    }
                }
                Action::Timer { node, after } => {
                    self.timer_seq += 1;
                    let at = self.transport.now() + after;
                    self.timers
                        .push(Reverse((at, self.timer_seq, slot, ctx.generation, node)));
                }
                Action::Forget { node } => ctx.pending.retain(|_, (n, _)| *n != node),
            }
        }
        self.actions = actions;
        self.queue = queue;
        let finished = self.requests.slots[slot as usize].as_mut().and_then(|c| {
            c.run
                .take_response()
                .map(|r| (c.incoming, r, c.trace.take()))
        });
        if let Some((incoming, response, trace)) = finished {
            if let (Some(trace), Some(spans)) = (trace, self.spans.as_ref()) {
                trace.end(spans, response.status);
            }
            // What still runs for it (an asynchronous step that timed out) is dropped.
            self.tasks
                .cancel(slot, self.requests.generations[slot as usize] as u32);
            // Free the slot first: whatever is still out for it is now late.
            self.requests.slots[slot as usize] = None;
            self.requests.generations[slot as usize] =
                self.requests.generations[slot as usize].wrapping_add(1);
            self.requests.free.push(slot);
            self.requests.live -= 1;
            self.stats.responses += 1;
            self.prune_timers();
            if let Err(e) = self.transport.send_response(incoming, response) {
                tracing::warn!(error = %e, "could not answer a request");
            }
        }
    }
}

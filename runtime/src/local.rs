//! Chains run on the calling thread: every generation's chain runners (so their
//! instances) that one thread owns. A worker of the pool owns one; so does each shard
//! of a node's DPU proxy, which runs a request's chain inline, between taking its head
//! off the fabric and handing it to a pod, with no hand-off to another thread.
//!
//! A request runs on the generation it was routed in; a newer one is switched to
//! between two calls (its instances built then), and a retired generation stays while
//! responses are still to come for requests it ran (at most [`MAX_RETIRED`] of them,
//! each at most [`RETIRED_TTL`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use dpumesh_head::RequestHead;

use crate::bindings::ResponseInfo;
use crate::callout::CalloutReply;
use crate::chain::ChainRunner;
use crate::generation::{Generation, RequestDone, ResponseDone, Ticket};
use crate::queues::WakeSlot;

/// Retired generations kept for responses still to come.
pub const MAX_RETIRED: usize = 3;
/// A retired generation with requests still open is dropped after this long anyway
/// (their callers never came back for the response phase).
pub const RETIRED_TTL: Duration = Duration::from_secs(30);

/// One generation's runners.
struct Runners {
    generation: Arc<Generation>,
    runners: Vec<ChainRunner>,
    /// Requests whose response phase has not run yet.
    open: usize,
    /// When a retired set was last used (retirement counts as a use).
    last_used: Instant,
}

impl Runners {
    fn new(generation: Arc<Generation>, wake: &Arc<WakeSlot>) -> Self {
        let runners = generation
            .chains()
            .iter()
            .cloned()
            .map(|chain| ChainRunner::with_wake(chain, wake.clone()))
            .collect();
        Self {
            generation,
            runners,
            open: 0,
            last_used: Instant::now(),
        }
    }
}

/// Where the answer to a plugin root's HTTP call goes: the generation, chain, filter
/// and instance that made it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RootCall {
    /// The generation's number.
    pub generation: u64,
    /// The chain's index in it.
    pub chain: usize,
    /// The filter's index in the chain.
    pub filter: usize,
    /// Which instance of that filter (replaced ones do not get answers).
    pub instance: u64,
}

/// The chains one thread runs, per generation, with their instances.
pub struct LocalChains {
    /// Goes in tickets: which runner of several ran the request phase.
    id: usize,
    current: Runners,
    /// Older generations with responses still to come, newest first.
    retired: Vec<Runners>,
    /// How plugins' shared-queue notifications wake the owning thread.
    wake: Arc<WakeSlot>,
}

impl std::fmt::Debug for LocalChains {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalChains")
            .field("id", &self.id)
            .field("generation", &self.current.generation.number())
            .field("retired", &self.retired.len())
            .finish()
    }
}

impl LocalChains {
    /// Runner `id`'s chains of `generation`, every instance created now.
    pub fn new(id: usize, generation: Arc<Generation>) -> Self {
        let wake = Arc::default();
        Self {
            id,
            current: Runners::new(generation, &wake),
            retired: Vec::new(),
            wake,
        }
    }

    /// How to wake the owning thread when a plugin's shared queue gets an item: it
    /// then calls [`Self::tick`], which tells the plugins. Set by the owning thread
    /// when it starts (instances created before keep following it).
    pub fn set_waker(&self, waker: crate::queues::Waker) {
        self.wake.set(waker);
    }

    /// The generation new requests run on.
    pub fn generation(&self) -> u64 {
        self.current.generation.number()
    }

    /// Runs the request phase of chain `chain` of `generation` on `head`.
    ///
    /// # Panics
    ///
    /// If `chain` is not a chain of `generation` (the caller resolved it there).
    pub fn on_request(
        &mut self,
        generation: &Arc<Generation>,
        chain: usize,
        head: RequestHead,
    ) -> RequestDone {
        let worker = self.id;
        let runners = self.runners(generation);
        runners.open += 1;
        let runner = &mut runners.runners[chain];
        let outcome = runner.on_request(head);
        runner.repair();
        RequestDone {
            ticket: Ticket {
                worker,
                generation: generation.clone(),
                chain,
                ran: outcome.ran,
            },
            outcome,
        }
    }

    /// Runs the response phase where `ticket` says (on the instances of its request
    /// phase).
    pub fn on_response(
        &mut self,
        ticket: &Ticket,
        head: RequestHead,
        info: &ResponseInfo,
    ) -> ResponseDone {
        self.on_response_editing(ticket, head, info, None)
    }

    /// [`Self::on_response`] with the response's headers for plugins to edit.
    pub fn on_response_editing(
        &mut self,
        ticket: &Ticket,
        head: RequestHead,
        info: &ResponseInfo,
        headers: Option<&mut crate::call::ResponseHeaders>,
    ) -> ResponseDone {
        let runners = self.runners(&ticket.generation);
        runners.open = runners.open.saturating_sub(1);
        let runner = &mut runners.runners[ticket.chain];
        let result = runner.on_response_editing(head, info, ticket.ran, headers);
        runner.repair();
        self.sweep();
        result
    }

    /// Hands a request parked in the chain `ticket` names (its request phase paused
    /// under `park`) the answer to its HTTP call `token`; the chain goes on from the
    /// filter that paused it. `None` when the request is not parked here (abandoned,
    /// or its instances were rebuilt after a panic).
    pub fn resume(
        &mut self,
        ticket: &Ticket,
        park: u32,
        token: u32,
        reply: &CalloutReply,
    ) -> Option<RequestDone> {
        let worker = self.id;
        let runners = self.runners(&ticket.generation);
        let runner = &mut runners.runners[ticket.chain];
        let outcome = runner.resume(park, token, reply)?;
        runner.repair();
        Some(RequestDone {
            ticket: Ticket {
                worker,
                generation: ticket.generation.clone(),
                chain: ticket.chain,
                ran: outcome.ran,
            },
            outcome,
        })
    }

    /// Gives up on a parked request (its exchange timed out, its caller left) and runs
    /// its response phase with `info` (which ends the paused filter's context too).
    /// `None` when it is not parked here.
    pub fn abandon(
        &mut self,
        ticket: &Ticket,
        park: u32,
        info: &ResponseInfo,
    ) -> Option<ResponseDone> {
        let runners = self.runners(&ticket.generation);
        let (head, ran) = runners.runners[ticket.chain].abandon(park)?;
        let mut ticket = ticket.clone();
        ticket.ran = ran;
        Some(self.on_response(&ticket, head, info))
    }

    /// Says this thread makes its plugins' root-context HTTP calls: it takes them with
    /// [`Self::take_root_calls`] after each [`Self::tick`] and hands the answers to
    /// [`Self::root_callout`]. (Otherwise those calls are not made.)
    pub fn perform_root_calls(&self) {
        self.wake.set_performs_calls();
    }

    /// The HTTP calls the current generation's plugins' root contexts made since the
    /// last look, each with where its answer goes.
    pub fn take_root_calls(&mut self) -> Vec<(RootCall, crate::callout::Callout)> {
        let generation = self.current.generation.number();
        let mut calls = Vec::new();
        for (chain, runner) in self.current.runners.iter_mut().enumerate() {
            for (filter, instance, call) in runner.take_root_calls() {
                let to = RootCall {
                    generation,
                    chain,
                    filter,
                    instance,
                };
                calls.push((to, call));
            }
        }
        calls
    }

    /// Hands the answer to root call `token` to the instance that made it (if its
    /// generation still runs).
    pub fn root_callout(&mut self, to: &RootCall, token: u32, reply: &CalloutReply) {
        if to.generation != self.current.generation.number() {
            return;
        }
        if let Some(runner) = self.current.runners.get_mut(to.chain) {
            runner.root_callout(to.filter, to.instance, token, reply);
            runner.repair();
        }
    }

    /// Runs the proxy-wasm ticks that are due on the current generation's instances
    /// (instances of retired generations stop ticking); returns when the next is due.
    pub fn tick(&mut self, now: Instant) -> Option<Instant> {
        let mut next: Option<Instant> = None;
        for runner in &mut self.current.runners {
            let due = runner.tick(now);
            runner.repair();
            next = match (next, due) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
        next
    }

    /// Switches to `generation` now if it is newer (its instances are built here, not
    /// during the next request).
    pub fn switch(&mut self, generation: &Arc<Generation>) {
        self.runners(generation);
    }

    /// Drops every instance and builds the current generation's again (after a panic
    /// left them in an unknown state).
    pub fn rebuild(&mut self) {
        let generation = self.current.generation.clone();
        for runner in self
            .retired
            .iter_mut()
            .chain(std::iter::once(&mut self.current))
            .flat_map(|r| r.runners.iter_mut())
        {
            runner.discard();
        }
        self.retired.clear();
        self.current = Runners::new(generation, &self.wake);
    }

    /// The runners of `generation`: the current ones, a retired set, or new ones (after
    /// switching to it when it is newer than the current generation).
    fn runners(&mut self, generation: &Arc<Generation>) -> &mut Runners {
        let number = generation.number();
        if number > self.current.generation.number() {
            let mut old = std::mem::replace(
                &mut self.current,
                Runners::new(generation.clone(), &self.wake),
            );
            // The retirement TTL counts from here; the current set is not timed per job.
            old.last_used = Instant::now();
            self.retired.insert(0, old);
            self.sweep();
        }
        if number == self.current.generation.number() {
            return &mut self.current;
        }
        let index = match self
            .retired
            .iter()
            .position(|r| r.generation.number() == number)
        {
            Some(index) => index,
            None => {
                // A request routed before a publish reached a runner that had already
                // dropped (or never had) its generation: build it again.
                self.retired
                    .push(Runners::new(generation.clone(), &self.wake));
                self.retired.len() - 1
            }
        };
        let runners = &mut self.retired[index];
        runners.last_used = Instant::now();
        runners
    }

    /// Drops retired generations with no open requests, and the oldest beyond the
    /// limit or idle too long.
    fn sweep(&mut self) {
        self.retired
            .retain(|r| r.open > 0 && r.last_used.elapsed() < RETIRED_TTL);
        self.retired.truncate(MAX_RETIRED);
    }
}

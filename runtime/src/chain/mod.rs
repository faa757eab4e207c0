//! Filter chains: `on-request` in order until the first deny, `on-response` in
//! reverse for every filter whose `on-request` ran, metadata and header edits flowing
//! from each filter to the next.

use std::sync::Arc;
use std::time::Instant;

use dpumesh_head::RequestHead;

use crate::bindings::ResponseInfo;
use crate::call::{CallInput, ResponseHeaders};
use crate::epoch::Epoch;
use crate::error::{FaultKind, FilterFault, Phase};
use crate::filter::{FailurePolicy, LoadedFilter};
use crate::health::HealthState;
use crate::instance::FilterInstance;
use crate::queues::WakeSlot;
use crate::stamp::Stamp;

mod decision;
mod fused;

pub use decision::{ChainOutcome, Decision, DenyCause, LocalReply};
use decision::{checked_reply, fault_reply};

/// An ordered list of loaded filters: the definition of a chain, shared by every
/// worker.
#[derive(Debug, Clone)]
pub struct FilterChain {
    name: String,
    filters: Vec<Arc<LoadedFilter>>,
    edits_responses: bool,
    /// The filters composed into one component, when the chain is fused.
    fused: Option<Arc<crate::fusion::FusedChain>>,
}

impl FilterChain {
    /// A chain named `name` running `filters` in order.
    pub fn new(name: impl Into<String>, filters: Vec<Arc<LoadedFilter>>) -> Self {
        let edits_responses = filters.iter().any(|f| f.is_proxy_wasm());
        Self {
            name: name.into(),
            filters,
            edits_responses,
            fused: None,
        }
    }

    /// This chain with its filters composed into one component, so a request
    /// enters Wasm once per phase rather than once per filter (see docs/benchmarks.md,
    /// "Fused chains"). Composing and compiling take a while (the filters' code is
    /// compiled again as part of the whole; the compile cache keeps the result), so
    /// do it where a chain is loaded, not per request. Fails with the reason when the
    /// chain cannot be fused ([`Self::unfusable`]) or the composition fails; the
    /// chain still runs unfused then.
    pub fn fuse(&self) -> Result<Self, crate::error::LoadError> {
        let fused = crate::fusion::fuse(&self.name, &self.filters)?;
        Ok(Self {
            fused: Some(Arc::new(fused)),
            ..self.clone()
        })
    }

    /// Why [`Self::fuse`] would refuse this chain (a proxy-wasm plugin in it, no
    /// filters, more than 32, filters of different runtimes); `None` if it would not.
    pub fn unfusable(&self) -> Option<String> {
        crate::fusion::unfusable(&self.filters)
    }

    /// Whether fusing would make the chain cheaper: not when a filter of it runs as a
    /// core instance ([`LoadedFilter::runs_as_core`]). Entering a core instance costs
    /// less than a fused chain's component call into each filter, and its host calls
    /// a fraction of a component's; a fused chain is all component calls
    /// (docs/benchmarks.md).
    pub fn fusion_pays(&self) -> bool {
        !self.filters.iter().any(|f| f.runs_as_core())
    }

    /// Whether the chain's filters run as one composed component.
    pub fn is_fused(&self) -> bool {
        self.fused.is_some()
    }

    /// Whether a filter of the chain may edit response headers (a proxy-wasm plugin):
    /// the proxy hands the response's headers to the response phase only then.
    pub fn edits_responses(&self) -> bool {
        self.edits_responses
    }

    /// The chain's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The filters, in order.
    pub fn filters(&self) -> &[Arc<LoadedFilter>] {
        &self.filters
    }

    /// Whether the chain runs on the worker pool (one of its filters asked to be
    /// offloaded) rather than inline where the request is.
    pub fn offload(&self) -> bool {
        self.filters.iter().any(|f| f.settings().offload)
    }
}

struct Slot {
    filter: Arc<LoadedFilter>,
    instance: Option<FilterInstance>,
    /// How many times the instance was discarded (a parked request resumes only on
    /// the instance that paused it).
    replaced: u64,
    invocations: metrics::Counter,
    skipped: metrics::Counter,
    duration: metrics::Histogram,
}

/// One filter's answer.
enum Step {
    Continue,
    Deny(LocalReply),
    Pause(Vec<crate::callout::Callout>),
    Fault(FilterFault),
}

/// A request waiting in filter `index` for its HTTP calls.
struct Parked {
    head: Box<RequestHead>,
    index: usize,
    /// The instance it waits in (its slot's `replaced` count then).
    instance: u64,
    faults: Vec<FilterFault>,
}

/// Most requests one runner keeps parked; a pause past it is a fault of the filter
/// (fail-open or fail-closed as configured) rather than unbounded memory.
const MAX_PARKED: usize = 8192;

/// After a filter answered: on to the next, or the chain's outcome.
#[allow(
    clippy::large_enum_variant,
    reason = "returned, never stored: the outcome is what the caller gets anyway"
)]
enum Next {
    Go(Box<RequestHead>),
    Stop(ChainOutcome),
}

/// Runs one chain on one worker: owns an instance of each filter, reused across
/// requests and replaced after a fault.
pub struct ChainRunner {
    chain: Arc<FilterChain>,
    slots: Vec<Slot>,
    /// The epoch tickers of the chain's runtimes (one, in practice), woken once per
    /// phase rather than once per filter call.
    epochs: Vec<Arc<Epoch>>,
    /// Whether a filter takes the batched call (the shared input is built then).
    batched: bool,
    /// Requests paused by a filter, by park id.
    parked: std::collections::HashMap<u32, Parked>,
    last_park: u32,
    /// How its instances' shared-queue notifications wake the owning thread.
    wake: Arc<WakeSlot>,
    /// The fused instance, when the chain is fused. The slots' own instances are
    /// then made only for the requests between a fault of the fused one and the
    /// `repair` that makes it again.
    fused: Option<fused::Fused>,
    /// Filters the last fused call entered, with their times (kept for its capacity).
    entered: Vec<(u32, Stamp)>,
    /// The current request's filter times, while they are wanted.
    times: Vec<crate::timing::FilterTime>,
    /// The box a request's head travels in between the runner and its instances
    /// (see [`Self::lend`]), kept from one request to the next.
    spare: Option<Box<RequestHead>>,
}

impl std::fmt::Debug for ChainRunner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChainRunner")
            .field("chain", &self.chain.name)
            .field("instances", &self.instances())
            .finish()
    }
}

impl ChainRunner {
    /// A runner with one fresh instance per filter. An instance that cannot be created
    /// now is retried before the next request that needs it.
    pub fn new(chain: Arc<FilterChain>) -> Self {
        Self::with_wake(chain, Arc::default())
    }

    /// [`Self::new`] whose instances wake their owning thread through `wake` when a
    /// shared queue they registered gets an item (the owner then runs
    /// [`Self::tick`]).
    pub fn with_wake(chain: Arc<FilterChain>, wake: Arc<WakeSlot>) -> Self {
        crate::stamp::calibrate();
        let fused = chain
            .fused
            .as_ref()
            .map(|fused| fused::Fused::new(fused.clone(), &chain.filters));
        let separate = fused.as_ref().is_none_or(|f| !f.is_live());
        let slots = chain
            .filters
            .iter()
            .map(|filter| Slot {
                instance: if separate {
                    instantiate(filter, &wake)
                } else {
                    None
                },
                replaced: 0,
                invocations: metrics::counter!(
                    "dpumesh_filter_invocations_total",
                    "chain" => chain.name.clone(),
                    "filter" => filter.name().to_owned(),
                ),
                skipped: metrics::counter!(
                    "dpumesh_filter_skipped_total",
                    "chain" => chain.name.clone(),
                    "filter" => filter.name().to_owned(),
                ),
                duration: metrics::histogram!(
                    "dpumesh_filter_duration_seconds",
                    "chain" => chain.name.clone(),
                    "filter" => filter.name().to_owned(),
                ),
                filter: filter.clone(),
            })
            .collect();
        let mut epochs: Vec<Arc<Epoch>> = Vec::new();
        for filter in &chain.filters {
            let epoch = &filter.runtime.inner.epoch;
            if !epochs.iter().any(|e| Arc::ptr_eq(e, epoch)) {
                epochs.push(epoch.clone());
            }
        }
        let batched = chain.filters.iter().any(|f| f.is_batched());
        Self {
            chain,
            slots,
            epochs,
            batched,
            parked: std::collections::HashMap::new(),
            last_park: 0,
            wake,
            fused,
            entered: Vec::new(),
            times: Vec::new(),
            spare: None,
        }
    }

    fn wake_epochs(&self) {
        for epoch in &self.epochs {
            epoch.call_begins();
        }
    }

    /// The chain this runner runs.
    pub fn chain(&self) -> &Arc<FilterChain> {
        &self.chain
    }

    /// Live instances (one per filter when healthy; a fused instance counts as one
    /// per filter it runs).
    pub fn instances(&self) -> usize {
        if self.is_fused() {
            return self.slots.len();
        }
        self.slots.iter().filter(|s| s.instance.is_some()).count()
    }

    /// Re-creates instances discarded after faults. Workers call this between requests
    /// so the next request does not pay for it.
    pub fn repair(&mut self) {
        self.repair_fused();
        if self.is_fused() {
            return;
        }
        for slot in &mut self.slots {
            if slot.instance.is_none() {
                slot.instance = instantiate(&slot.filter, &self.wake);
            }
        }
    }

    /// Runs the proxy-wasm ticks that are due; returns when the next one is (`None`
    /// when no instance of this chain asked for ticks). The owner calls it between
    /// requests: a worker when its wait times out, a shard in its housekeeping.
    pub fn tick(&mut self, now: Instant) -> Option<Instant> {
        let mut next: Option<Instant> = None;
        for index in 0..self.slots.len() {
            let Some(instance) = self.slots[index].instance.as_mut() else {
                continue;
            };
            let (due, result) = instance.tick(now);
            if let Err(kind) = result {
                // The instance is replaced; its successor's root starts its own ticks.
                self.fault(index, Phase::Tick, kind);
                continue;
            }
            next = match (next, due) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
        next
    }

    /// The HTTP calls its plugins' root contexts made (from ticks, queue notifications
    /// or earlier answers) since the last look, for an owner that makes them (its
    /// [`WakeSlot`] says so): each with the filter and instance that made it.
    pub fn take_root_calls(&mut self) -> Vec<(usize, u64, crate::callout::Callout)> {
        let mut calls = Vec::new();
        for (index, slot) in self.slots.iter_mut().enumerate() {
            if let Some(instance) = slot.instance.as_mut() {
                for call in instance.take_root_calls() {
                    calls.push((index, slot.replaced, call));
                }
            }
        }
        calls
    }

    /// Hands filter `index`'s root the answer to its call `token`, if the instance
    /// that made it (`instance`, from [`Self::take_root_calls`]) is still there.
    pub fn root_callout(
        &mut self,
        index: usize,
        instance: u64,
        token: u32,
        reply: &crate::callout::CalloutReply,
    ) {
        let live = self
            .slots
            .get(index)
            .is_some_and(|s| s.replaced == instance && s.instance.is_some());
        if !live {
            return;
        }
        self.wake_epochs();
        let result = match self.slots[index].instance.as_mut() {
            Some(live) => live.on_root_callout(token, reply),
            None => Ok(()),
        };
        if let Err(kind) = result {
            // A root callback's fault replaces the instance, as a tick's does.
            self.fault(index, Phase::Tick, kind);
        }
    }

    /// Runs the request phase.
    pub fn on_request(&mut self, head: RequestHead) -> ChainOutcome {
        self.wake_epochs();
        self.times.clear();
        let head = self.lend(head);
        let head = if self.fused.is_some() {
            match self.request_fused(head) {
                fused::Ran::Done(outcome) => return outcome,
                fused::Ran::Unfused(head) => head,
            }
        } else {
            head
        };
        self.run(head, 0, Vec::new())
    }

    /// Requests parked in this runner.
    pub fn parked(&self) -> usize {
        self.parked.len()
    }

    /// Hands parked request `park` the answer to its HTTP call `token`: the filter
    /// that paused it decides (go on, answer, or wait more), and the chain goes on
    /// from there. `None` when no such request is parked (it was abandoned).
    pub fn resume(
        &mut self,
        park: u32,
        token: u32,
        reply: &crate::callout::CalloutReply,
    ) -> Option<ChainOutcome> {
        let parked = self.parked.remove(&park)?;
        self.wake_epochs();
        self.times.clear();
        let Parked {
            head,
            index,
            instance,
            mut faults,
        } = parked;
        let slot = &mut self.slots[index];
        let policy = slot.filter.settings.failure_policy;
        let (head, step) = match slot.instance.as_mut() {
            Some(live) if slot.replaced == instance => {
                let (head, result) = live.on_callout(head, token, reply);
                let step = self.sort(index, Phase::Request, result);
                (head, step)
            }
            _ => {
                // The instance faulted (for another request) while this one waited:
                // its context, and what the plugin meant to do, are gone.
                let fault = FilterFault {
                    filter: slot.filter.name().to_owned(),
                    phase: Phase::Request,
                    kind: FaultKind::Unavailable(
                        "the instance the request was paused in was replaced after a fault"
                            .to_owned(),
                    ),
                };
                (head, Step::Fault(fault))
            }
        };
        match self.after(index, policy, step, head, &mut faults, Some(park)) {
            Next::Go(head) => Some(self.run(head, index + 1, faults)),
            Next::Stop(outcome) => Some(outcome),
        }
    }

    /// Gives up on parked request `park` (its exchange timed out or its caller went
    /// away): returns its head and how many filters ran, for the response phase
    /// (which ends the paused filter's context too).
    pub fn abandon(&mut self, park: u32) -> Option<(RequestHead, usize)> {
        let parked = self.parked.remove(&park)?;
        Some((self.unbox(parked.head), parked.index + 1))
    }

    /// `head` in the runner's box: from here to the outcome, each hand-off (into a
    /// filter's store and back, from step to step) moves a pointer rather than the
    /// ~350-byte head, five filters times several moves a request. The box is kept
    /// for the next request ([`Self::unbox`]), so this allocates once per runner.
    fn lend(&mut self, head: RequestHead) -> Box<RequestHead> {
        match self.spare.take() {
            Some(mut boxed) => {
                *boxed = head;
                boxed
            }
            None => Box::new(head),
        }
    }

    /// The head out of its box, the box kept for the next request.
    fn unbox(&mut self, mut boxed: Box<RequestHead>) -> RequestHead {
        let head = std::mem::take(&mut *boxed);
        self.spare = Some(boxed);
        head
    }

    /// Runs filters `from..` on `head`.
    fn run(
        &mut self,
        mut head: Box<RequestHead>,
        from: usize,
        mut faults: Vec<FilterFault>,
    ) -> ChainOutcome {
        let shared = match (self.batched, self.slots.first()) {
            (true, Some(slot)) => {
                let clock = &slot.filter.runtime.inner.services.clock;
                Some(crate::input::Shared::new(
                    &head,
                    clock.wall_ns(),
                    clock.monotonic_ns(),
                ))
            }
            _ => None,
        };
        let line = CallInput {
            line: std::cell::OnceCell::new(),
            shared,
        };
        // One clock read per filter: a filter's time runs from the end of the one
        // before it (the chain's own bookkeeping between two calls is included).
        let mut mark = crate::stamp::now();
        for index in from..self.slots.len() {
            let policy = self.slots[index].filter.settings.failure_policy;
            let health = self.slots[index].filter.health.state();
            let step = if let HealthState::Degraded { retry_in_ms } = health {
                Step::Fault(self.skipped(index, retry_in_ms))
            } else {
                // A retry must see the head as it was, not half-edited by the failed call,
                // and a filter skipped after a fault (fail-open) leaves no edits: the
                // batched call applies a call's edits only when it returns, so every
                // path must. The copy is of the head alone; it goes back in the same box.
                let original = policy.restores_head().then(|| RequestHead::clone(&head));
                let (returned, step) = self.step(index, &line, &mut mark, head);
                head = returned;
                match (step, original) {
                    (Step::Fault(fault), Some(original))
                        if policy == FailurePolicy::Reload && fault.kind.retryable() =>
                    {
                        faults.push(fault);
                        *head = original;
                        let (returned, step) = self.step(index, &line, &mut mark, head);
                        head = returned;
                        step
                    }
                    (Step::Fault(fault), Some(original)) => {
                        *head = original;
                        Step::Fault(fault)
                    }
                    (step, _) => step,
                }
            };
            match self.after(index, policy, step, head, &mut faults, None) {
                Next::Go(returned) => head = returned,
                Next::Stop(outcome) => return outcome,
            }
        }
        ChainOutcome {
            head: self.unbox(head),
            decision: Decision::Continue,
            ran: self.slots.len(),
            faults,
            times: std::mem::take(&mut self.times),
        }
    }

    /// What follows filter `index`'s answer: the next filter, a denial, or a parked
    /// request (under `park` when it was parked before, a new id otherwise).
    fn after(
        &mut self,
        index: usize,
        policy: FailurePolicy,
        step: Step,
        head: Box<RequestHead>,
        faults: &mut Vec<FilterFault>,
        park: Option<u32>,
    ) -> Next {
        let (reply, cause) = match step {
            Step::Continue => return Next::Go(head),
            Step::Pause(callouts) => {
                if park.is_none() && self.parked.len() >= MAX_PARKED {
                    // The instance is fine (and holds the other parked requests): only
                    // this request is refused; its context ends in its response phase.
                    let fault = FilterFault {
                        filter: self.slots[index].filter.name().to_owned(),
                        phase: Phase::Request,
                        kind: FaultKind::Unavailable(format!(
                            "{MAX_PARKED} requests are paused in this worker already"
                        )),
                    };
                    return self.after(index, policy, Step::Fault(fault), head, faults, None);
                }
                let park = park.unwrap_or_else(|| self.next_park());
                self.parked.insert(
                    park,
                    Parked {
                        head,
                        index,
                        instance: self.slots[index].replaced,
                        faults: faults.clone(),
                    },
                );
                return Next::Stop(ChainOutcome {
                    head: RequestHead::default(),
                    decision: Decision::Pause { park, callouts },
                    ran: index + 1,
                    faults: std::mem::take(faults),
                    times: Vec::new(),
                });
            }
            Step::Deny(reply) => (reply, DenyCause::Policy),
            Step::Fault(fault) => {
                faults.push(fault.clone());
                // An unsendable reply is a bug in the filter: always denied.
                let open = policy == FailurePolicy::FailOpen
                    && !matches!(fault.kind, FaultKind::BadReply(_));
                if open {
                    return Next::Go(head);
                }
                (fault_reply(&fault), DenyCause::Fault(fault))
            }
        };
        Next::Stop(ChainOutcome {
            head: self.unbox(head),
            decision: Decision::Deny {
                filter: self.slots[index].filter.tag.name.clone(),
                reply,
                cause,
            },
            ran: index + 1,
            faults: std::mem::take(faults),
            times: std::mem::take(&mut self.times),
        })
    }

    fn next_park(&mut self) -> u32 {
        loop {
            self.last_park = self.last_park.wrapping_add(1);
            if !self.parked.contains_key(&self.last_park) {
                return self.last_park;
            }
        }
    }

    /// Calls one filter's `on-request` and sorts out the result.
    fn step(
        &mut self,
        index: usize,
        line: &CallInput,
        mark: &mut Stamp,
        head: Box<RequestHead>,
    ) -> (Box<RequestHead>, Step) {
        let (head, result) = self.call(index, line, mark, head);
        (head, self.sort(index, Phase::Request, result))
    }

    /// A filter's answer as a step: replies checked, faults recorded.
    fn sort(
        &mut self,
        index: usize,
        phase: Phase,
        result: Result<crate::call::Answer, FaultKind>,
    ) -> Step {
        use crate::call::Answer;
        match result {
            Ok(Answer::Continue) => {
                self.slots[index].filter.health.record_success();
                Step::Continue
            }
            Ok(Answer::Pause(callouts)) => {
                self.slots[index].filter.health.record_success();
                Step::Pause(callouts)
            }
            Ok(Answer::Deny(reply)) => match checked_reply(reply) {
                Ok(reply) => {
                    self.slots[index].filter.health.record_success();
                    Step::Deny(reply)
                }
                Err(detail) => Step::Fault(self.fault(index, phase, FaultKind::BadReply(detail))),
            },
            Err(kind) => Step::Fault(self.fault(index, phase, kind)),
        }
    }

    /// The fault of a filter skipped because it is degraded: counted, not logged per
    /// request (the degradation itself was).
    fn skipped(&self, index: usize, retry_in_ms: u64) -> FilterFault {
        let slot = &self.slots[index];
        slot.skipped.increment(1);
        FilterFault {
            filter: slot.filter.name().to_owned(),
            phase: Phase::Request,
            kind: FaultKind::Degraded { retry_in_ms },
        }
    }

    /// Runs the response phase on the first `ran` filters, last first. Faults here
    /// cannot change the response; they are reported and the instance replaced.
    /// Degraded filters are skipped.
    pub fn on_response(
        &mut self,
        head: RequestHead,
        info: &ResponseInfo,
        ran: usize,
    ) -> (RequestHead, Vec<FilterFault>) {
        self.on_response_editing(head, info, ran, None)
    }

    /// [`Self::on_response`] with the response's headers, which proxy-wasm plugins
    /// may edit (`headers.edited` says whether one did).
    pub fn on_response_editing(
        &mut self,
        head: RequestHead,
        info: &ResponseInfo,
        ran: usize,
        headers: Option<&mut ResponseHeaders>,
    ) -> (RequestHead, Vec<FilterFault>) {
        let ran = ran.min(self.slots.len());
        if ran == 0 {
            return (head, Vec::new());
        }
        self.wake_epochs();
        let head = self.lend(head);
        // A fused chain has no proxy-wasm plugin, so no response headers to edit.
        let (head, faults) = if self.fused.is_some() {
            match self.response_fused(head, info, ran) {
                fused::Ran::Done(done) => done,
                fused::Ran::Unfused(head) => self.respond_unfused(head, info, ran, headers),
            }
        } else {
            self.respond_unfused(head, info, ran, headers)
        };
        (self.unbox(head), faults)
    }

    /// The response phase of filters `0..upto`, last first, each on its own instance.
    fn respond_unfused(
        &mut self,
        mut head: Box<RequestHead>,
        info: &ResponseInfo,
        upto: usize,
        mut headers: Option<&mut ResponseHeaders>,
    ) -> (Box<RequestHead>, Vec<FilterFault>) {
        let mut faults = Vec::new();
        for index in (0..upto.min(self.slots.len())).rev() {
            if self.slots[index].filter.health.is_degraded() {
                continue;
            }
            let slot = &mut self.slots[index];
            if slot.instance.is_none() && self.fused.is_some() && slot.filter.has_response_phase() {
                // A fused chain's separate instances are made on demand; one that
                // cannot be made skips its response phase, as a discarded instance
                // of an unfused chain does.
                match FilterInstance::new(&slot.filter, &self.wake) {
                    Ok(instance) => slot.instance = Some(instance),
                    Err(e) => {
                        tracing::warn!(chain = %self.chain.name, filter = slot.filter.name(), error = %e, "no instance for the response phase");
                        continue;
                    }
                }
            }
            let Some(instance) = self.slots[index].instance.as_mut() else {
                continue;
            };
            let (returned, result) =
                instance.on_response(head, info.clone(), headers.as_deref_mut());
            head = returned;
            if let Err(kind) = result {
                faults.push(self.fault(index, Phase::Response, kind));
            }
        }
        (head, faults)
    }

    /// Calls filter `index`'s `on-request`, creating its instance first if a fault
    /// discarded it and `repair` has not run since.
    fn call(
        &mut self,
        index: usize,
        line: &CallInput,
        mark: &mut Stamp,
        head: Box<RequestHead>,
    ) -> (Box<RequestHead>, Result<crate::call::Answer, FaultKind>) {
        let slot = &mut self.slots[index];
        slot.invocations.increment(1);
        if slot.instance.is_none() {
            match FilterInstance::new(&slot.filter, &self.wake) {
                Ok(instance) => slot.instance = Some(instance),
                Err(e) => return (head, Err(FaultKind::Unavailable(e.to_string()))),
            }
        }
        let Some(instance) = slot.instance.as_mut() else {
            return (head, Err(FaultKind::Unavailable("no instance".to_owned())));
        };
        let result = instance.on_request(line, head);
        let now = crate::stamp::now();
        let took = now - *mark;
        slot.duration.record(took.as_secs_f64());
        if crate::timing::wanted() {
            self.times.push(crate::timing::FilterTime {
                filter: slot.filter.tag.name.clone(),
                ns: took.as_nanos() as u64,
            });
        }
        *mark = now;
        result
    }

    /// Records a fault: the instance is discarded (it cannot be re-entered after a
    /// trap) and the fault logged and counted.
    fn fault(&mut self, index: usize, phase: Phase, kind: FaultKind) -> FilterFault {
        let slot = &mut self.slots[index];
        slot.instance = None;
        slot.replaced += 1;
        if let Some(backoff_ms) = slot.filter.health.record_fault() {
            tracing::warn!(
                chain = %self.chain.name,
                filter = %slot.filter.name(),
                backoff_ms,
                "filter degraded after repeated faults: its failure policy applies without calling it until the backoff ends"
            );
        }
        let fault = FilterFault {
            filter: slot.filter.name().to_owned(),
            phase,
            kind,
        };
        metrics::counter!(
            "dpumesh_filter_faults_total",
            "filter" => fault.filter.clone(),
            "kind" => fault.kind.label(),
        )
        .increment(1);
        tracing::warn!(
            chain = %self.chain.name,
            filter = %fault.filter,
            phase = %phase,
            kind = fault.kind.label(),
            "filter fault: {}",
            fault.kind
        );
        fault
    }
}

impl ChainRunner {
    /// Drops every instance without ending it (after a panic left them in an unknown
    /// state: no guest code runs on them again).
    pub fn discard(&mut self) {
        for slot in &mut self.slots {
            slot.instance = None;
        }
        self.discard_fused();
    }
}

impl Drop for ChainRunner {
    /// A runner's healthy instances are ended as Envoy ends a VM's plugin (a plugin's
    /// root gets `proxy_on_done` and `proxy_on_delete`), under each filter's deadline.
    fn drop(&mut self) {
        if self
            .slots
            .iter()
            .any(|s| s.instance.is_some() && s.filter.is_proxy_wasm())
        {
            self.wake_epochs();
            for slot in &mut self.slots {
                if let Some(instance) = slot.instance.as_mut() {
                    instance.retire();
                }
            }
        }
    }
}

fn instantiate(filter: &Arc<LoadedFilter>, wake: &Arc<WakeSlot>) -> Option<FilterInstance> {
    match FilterInstance::new(filter, wake) {
        Ok(instance) => Some(instance),
        Err(e) => {
            tracing::error!(filter = filter.name(), error = %e, "cannot create filter instance");
            None
        }
    }
}

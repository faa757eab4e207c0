//! Running a fused chain (see [`crate::fusion`]): both phases in one call each, with
//! health, failure policies, metrics and faults applied per filter as the unfused
//! path applies them.
//!
//! After a fault the fused instance is gone (wasmtime cannot re-enter it): the rest of
//! that request, and every request until `repair` makes the fused instance again, run
//! on separate instances, so a request's two phases stay on one kind of instance.
//! The workers and shards repair between requests; a fused instance that cannot be
//! made is tried again after [`RETRY_AFTER`], not per request.

use std::time::{Duration, Instant};

use dpumesh_head::RequestHead;

use super::{ChainOutcome, ChainRunner, Decision, Next, Step, checked_reply};
use crate::bindings::{ResponseInfo, Verdict};
use crate::call::CallInput;
use crate::error::{FilterFault, Phase};
use crate::filter::FailurePolicy;
use crate::fusion::instance::{Decided, FusedFault, FusedInstance};
use crate::health::HealthState;
use crate::stamp::Stamp;

/// How long after a failed attempt the fused instance is tried again.
const RETRY_AFTER: Duration = Duration::from_secs(1);

/// A runner's fused instance and what it was made from.
pub(super) struct Fused {
    chain: std::sync::Arc<crate::fusion::FusedChain>,
    /// `None` after a fault until `repair` makes it again.
    instance: Option<FusedInstance>,
    /// Not tried again before this, after making it failed.
    retry_at: Option<Instant>,
}

impl Fused {
    /// The fused instance of `chain`'s filters, made now (tried again later if that
    /// fails).
    pub(super) fn new(
        chain: std::sync::Arc<crate::fusion::FusedChain>,
        filters: &[std::sync::Arc<crate::filter::LoadedFilter>],
    ) -> Self {
        let mut fused = Self {
            chain,
            instance: None,
            retry_at: None,
        };
        fused.make(filters);
        fused
    }

    fn make(&mut self, filters: &[std::sync::Arc<crate::filter::LoadedFilter>]) {
        if self.retry_at.is_some_and(|at| Instant::now() < at) {
            return;
        }
        match FusedInstance::new(&self.chain, filters) {
            Ok(instance) => {
                self.instance = Some(instance);
                self.retry_at = None;
            }
            Err(e) => {
                self.retry_at = Some(Instant::now() + RETRY_AFTER);
                tracing::error!(
                    error = %e,
                    "cannot create the fused chain's instance; the chain runs unfused until it can"
                );
            }
        }
    }

    pub(super) fn is_live(&self) -> bool {
        self.instance.is_some()
    }

    pub(super) fn discard(&mut self) {
        self.instance = None;
    }
}

/// What a fused phase did: ran, or could not run (no fused instance, or it failed
/// before any filter was entered), giving the head back for the unfused path.
#[allow(
    clippy::large_enum_variant,
    reason = "moved, not stored; `Done` carries a head as large in practice"
)]
pub(super) enum Ran<T> {
    Done(T),
    Unfused(Box<RequestHead>),
}

/// The bits of filters `from..` of a 32-filter mask.
fn from_on(from: usize) -> u32 {
    u32::MAX.checked_shl(from as u32).unwrap_or(0)
}

impl ChainRunner {
    /// Makes the fused instance again after a fault, and lets the separate instances
    /// the requests since then ran on go.
    pub(super) fn repair_fused(&mut self) {
        let Some(fused) = self.fused.as_mut() else {
            return;
        };
        if fused.instance.is_some() {
            return;
        }
        fused.make(&self.chain.filters);
        if fused.instance.is_some() {
            for slot in &mut self.slots {
                slot.instance = None;
            }
        }
    }

    /// Drops the fused instance after a fault: wasmtime cannot re-enter it.
    pub(super) fn discard_fused(&mut self) {
        if let Some(fused) = self.fused.as_mut() {
            fused.discard();
        }
    }

    /// Whether requests run through the fused instance now.
    pub fn is_fused(&self) -> bool {
        self.fused.as_ref().is_some_and(Fused::is_live)
    }

    /// The request phase through the fused instance; the head back when there is
    /// none (the caller runs the chain unfused).
    pub(super) fn request_fused(&mut self, head: Box<RequestHead>) -> Ran<ChainOutcome> {
        // The entry marks are copied into a vector the runner keeps (no allocation
        // per request), since the store is busy while they are recorded.
        let mut entered = std::mem::take(&mut self.entered);
        let ran = self.request_fused_marking(head, &mut entered);
        entered.clear();
        self.entered = entered;
        ran
    }

    fn request_fused_marking(
        &mut self,
        head: Box<RequestHead>,
        entered: &mut Vec<(u32, Stamp)>,
    ) -> Ran<ChainOutcome> {
        let n = self.slots.len();
        // Degraded filters are not called: fail-open ones are skipped (and counted
        // once it is known the chain got that far), and the first fail-closed one ends
        // the fused call (its policy answers after the filters before it ran, as the
        // unfused path would).
        let mut skipped: Vec<(usize, u64)> = Vec::new();
        let mut skip = 0u32;
        let mut stop: Option<(usize, u64)> = None;
        for k in 0..n {
            if let HealthState::Degraded { retry_in_ms } = self.slots[k].filter.health.state() {
                if self.slots[k].filter.settings.failure_policy == FailurePolicy::FailOpen {
                    skip |= 1 << k;
                    skipped.push((k, retry_in_ms));
                } else {
                    stop = Some((k, retry_in_ms));
                    skip |= from_on(k);
                    break;
                }
            }
        }
        let call = CallInput {
            line: std::cell::OnceCell::new(),
            shared: None,
        };
        let Some(instance) = self.fused.as_mut().and_then(|f| f.instance.as_mut()) else {
            return Ran::Unfused(head);
        };
        let (head, result) = instance.on_request(&call, head, skip);
        let end = crate::stamp::now();
        entered.extend_from_slice(instance.marks());
        let reload_head = match &result {
            Err(_) => instance.take_reload_head(),
            Ok(_) => None,
        };
        if result.is_err() {
            self.discard_fused();
        }
        self.record_entries(entered, end);
        // Skipped filters before `limit` were passed over on the way.
        let mut faults = Vec::new();
        let mut passed_over = |runner: &Self, limit: usize, faults: &mut Vec<FilterFault>| {
            for (k, retry_in_ms) in skipped.drain(..).filter(|(k, _)| *k < limit) {
                faults.push(runner.skipped(k, retry_in_ms));
            }
        };
        let (index, step, head) = match result {
            Ok(Decided { index, verdict }) => {
                let denier = matches!(verdict, Verdict::Deny(_)).then_some(index);
                for (k, _) in entered.iter() {
                    if Some(*k as usize) != denier {
                        self.slots[*k as usize].filter.health.record_success();
                    }
                }
                match verdict {
                    Verdict::Deny(reply) => {
                        passed_over(self, index, &mut faults);
                        let step = match checked_reply(reply) {
                            Ok(reply) => {
                                self.slots[index].filter.health.record_success();
                                Step::Deny(reply)
                            }
                            Err(detail) => Step::Fault(self.fault(
                                index,
                                Phase::Request,
                                crate::error::FaultKind::BadReply(detail),
                            )),
                        };
                        (index, step, head)
                    }
                    Verdict::Continue => match stop {
                        None => {
                            passed_over(self, n, &mut faults);
                            return Ran::Done(ChainOutcome {
                                head: self.unbox(head),
                                decision: Decision::Continue,
                                ran: n,
                                faults,
                                times: std::mem::take(&mut self.times),
                            });
                        }
                        Some((k, retry_in_ms)) => {
                            passed_over(self, k, &mut faults);
                            (k, Step::Fault(self.skipped(k, retry_in_ms)), head)
                        }
                    },
                }
            }
            Err(FusedFault { index: None, kind }) => {
                // The driver itself failed before entering any filter (the request
                // line did not fit its memory): no filter ran, so the whole chain runs
                // on separate instances.
                tracing::warn!(chain = %self.chain.name, fault = %kind, "fused chain failed before its first filter; running it unfused");
                return Ran::Unfused(head);
            }
            Err(FusedFault {
                index: Some(index),
                kind,
            }) => {
                for (k, _) in entered.iter().filter(|(k, _)| (*k as usize) < index) {
                    self.slots[*k as usize].filter.health.record_success();
                }
                passed_over(self, index, &mut faults);
                let fault = self.fault(index, Phase::Request, kind);
                let policy = self.slots[index].filter.settings.failure_policy;
                match reload_head {
                    Some(original) if policy == FailurePolicy::Reload && fault.kind.retryable() => {
                        faults.push(fault);
                        let mut mark = crate::stamp::now();
                        let mut head = head;
                        *head = original;
                        let (head, step) = self.step(index, &call, &mut mark, head);
                        (index, step, head)
                    }
                    Some(original) => {
                        // Skipped (fail-open) or denied: none of its edits stay.
                        let mut head = head;
                        *head = original;
                        (index, Step::Fault(fault), head)
                    }
                    None => (index, Step::Fault(fault), head),
                }
            }
        };
        let policy = self.slots[index].filter.settings.failure_policy;
        Ran::Done(
            match self.after(index, policy, step, head, &mut faults, None) {
                Next::Go(head) => self.run(head, index + 1, faults),
                Next::Stop(outcome) => outcome,
            },
        )
    }

    /// Each entered filter's invocation and time: from its entry to the next one's
    /// (the last one's to `end`).
    fn record_entries(&mut self, entered: &[(u32, Stamp)], end: Stamp) {
        let wanted = crate::timing::wanted();
        for (i, (k, at)) in entered.iter().enumerate() {
            let until = entered.get(i + 1).map_or(end, |(_, next)| *next);
            let slot = &self.slots[*k as usize];
            slot.invocations.increment(1);
            let took = until - *at;
            slot.duration.record(took.as_secs_f64());
            if wanted {
                self.times.push(crate::timing::FilterTime {
                    filter: slot.filter.tag.name.clone(),
                    ns: took.as_nanos() as u64,
                });
            }
        }
    }

    /// The response phase of the first `ran` filters through the fused instance; the
    /// head back when there is none. After a fault the filters before the faulting
    /// one run on separate instances.
    pub(super) fn response_fused(
        &mut self,
        head: Box<RequestHead>,
        info: &ResponseInfo,
        ran: usize,
    ) -> Ran<(Box<RequestHead>, Vec<FilterFault>)> {
        let Some(fused) = self.fused.as_mut() else {
            return Ran::Unfused(head);
        };
        let mut skip = fused.chain.no_response;
        let Some(instance) = fused.instance.as_mut() else {
            return Ran::Unfused(head);
        };
        for (k, slot) in self.slots.iter().enumerate() {
            if slot.filter.health.is_degraded() {
                skip |= 1 << k;
            }
        }
        let (head, result) = instance.on_response(head, info.clone(), ran, skip);
        if result.is_err() {
            self.discard_fused();
        }
        match result {
            Ok(()) => Ran::Done((head, Vec::new())),
            Err(FusedFault { index: None, kind }) => {
                tracing::warn!(chain = %self.chain.name, fault = %kind, "fused chain failed before its first filter; running its response phase unfused");
                Ran::Unfused(head)
            }
            Err(FusedFault {
                index: Some(index),
                kind,
            }) => {
                let mut faults = vec![self.fault(index, Phase::Response, kind)];
                let (head, more) = self.respond_unfused(head, info, index, None);
                faults.extend(more);
                Ran::Done((head, faults))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::from_on;

    #[test]
    fn masks_cover_the_filters_from_an_index_on() {
        assert_eq!(from_on(0), u32::MAX);
        assert_eq!(from_on(3), !0b111);
        assert_eq!(from_on(31), 1 << 31);
        assert_eq!(from_on(32), 0);
    }
}

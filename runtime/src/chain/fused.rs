//! Running a fused chain (see [`crate::fusion`]): both phases in one call each, with
//! health, failure policies, metrics and faults applied per filter as the unfused
//! path applies them; after a fault the rest of that request runs unfused.

use std::time::Instant;

use dpumesh_head::RequestHead;

use super::{ChainOutcome, ChainRunner, Decision, Next, Step, checked_reply};
use crate::bindings::{ResponseInfo, Verdict};
use crate::error::{FilterFault, Phase};
use crate::filter::FailurePolicy;
use crate::fusion::instance::{Decided, FusedFault, FusedInstance};
use crate::health::HealthState;
use crate::instance::CallInput;

/// A runner's fused instance and what it was made from.
pub(super) struct Fused {
    pub(super) chain: std::sync::Arc<crate::fusion::FusedChain>,
    /// `None` after a fault until it is made again (by `repair` or the next request).
    pub(super) instance: Option<FusedInstance>,
}

/// What a fused phase did: ran, or could not run (no fused instance), giving the
/// head back for the unfused path.
#[allow(
    clippy::large_enum_variant,
    reason = "moved, not stored; `Done` carries a head as large in practice"
)]
pub(super) enum Ran<T> {
    Done(T),
    Unfused(RequestHead),
}

/// The bits of filters `from..` of a 32-filter mask.
fn from_on(from: usize) -> u32 {
    u32::MAX.checked_shl(from as u32).unwrap_or(0)
}

impl ChainRunner {
    /// The fused instance, made now if a fault discarded it. `None` when the chain is
    /// not fused or the instance cannot be made (the chain then runs unfused).
    fn fused_instance(&mut self) -> Option<&mut FusedInstance> {
        let fused = self.fused.as_mut()?;
        if fused.instance.is_none() {
            fused.instance = make(&fused.chain, &self.chain.filters);
        }
        fused.instance.as_mut()
    }

    /// Makes the fused instance again after a fault, and lets the separate instances
    /// the faulted requests finished on go.
    pub(super) fn repair_fused(&mut self) {
        let Some(fused) = self.fused.as_mut() else {
            return;
        };
        if fused.instance.is_none() {
            fused.instance = make(&fused.chain, &self.chain.filters);
        }
        if fused.instance.is_some() {
            for slot in &mut self.slots {
                slot.instance = None;
            }
        }
    }

    /// Whether the fused instance is live.
    pub(super) fn fused_live(&self) -> bool {
        self.fused.as_ref().is_some_and(|f| f.instance.is_some())
    }

    /// The request phase through the fused instance; the head back when there is
    /// none (the caller runs the chain unfused).
    pub(super) fn request_fused(&mut self, head: RequestHead) -> Ran<ChainOutcome> {
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
        head: RequestHead,
        entered: &mut Vec<(u32, Instant)>,
    ) -> Ran<ChainOutcome> {
        let n = self.slots.len();
        // Degraded filters are not called: fail-open ones are skipped, and the first
        // fail-closed one ends the fused call (its policy answers after the filters
        // before it ran, as the unfused path would).
        let mut faults = Vec::new();
        let mut skip = 0u32;
        let mut stop: Option<(usize, u64)> = None;
        for k in 0..n {
            if let HealthState::Degraded { retry_in_ms } = self.slots[k].filter.health.state() {
                if self.slots[k].filter.settings.failure_policy == FailurePolicy::FailOpen {
                    skip |= 1 << k;
                    faults.push(self.skipped(k, retry_in_ms));
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
        let Some(instance) = self.fused_instance() else {
            return Ran::Unfused(head);
        };
        let (head, result) = instance.on_request(&call, head, skip);
        let end = Instant::now();
        entered.extend_from_slice(instance.marks());
        let reload_head = match &result {
            Err(_) => instance.take_reload_head(),
            Ok(_) => None,
        };
        self.record_entries(entered, end);
        let (index, step, head) = match result {
            Ok(Decided { index, verdict }) => {
                for (k, _) in entered.iter() {
                    self.slots[*k as usize].filter.health.record_success();
                }
                match verdict {
                    Verdict::Deny(reply) => {
                        let step = match checked_reply(reply) {
                            Ok(reply) => Step::Deny(reply),
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
                            return Ran::Done(ChainOutcome {
                                head,
                                decision: Decision::Continue,
                                ran: n,
                                faults,
                            });
                        }
                        Some((k, retry_in_ms)) => {
                            (k, Step::Fault(self.skipped(k, retry_in_ms)), head)
                        }
                    },
                }
            }
            Err(FusedFault { index, kind }) => {
                if let Some(fused) = self.fused.as_mut() {
                    fused.instance = None;
                }
                let fault = self.fault(index, Phase::Request, kind);
                let policy = self.slots[index].filter.settings.failure_policy;
                match reload_head {
                    Some(original) if policy == FailurePolicy::Reload && fault.kind.retryable() => {
                        faults.push(fault);
                        let mut mark = Instant::now();
                        let (head, step) = self.step(index, &call, &mut mark, original);
                        (index, step, head)
                    }
                    _ => (index, Step::Fault(fault), head),
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
    fn record_entries(&self, entered: &[(u32, Instant)], end: Instant) {
        for (i, (k, at)) in entered.iter().enumerate() {
            let until = entered.get(i + 1).map_or(end, |(_, next)| *next);
            let slot = &self.slots[*k as usize];
            slot.invocations.increment(1);
            slot.duration.record((until - *at).as_secs_f64());
        }
    }

    /// The response phase of the first `ran` filters through the fused instance; the
    /// head back when there is none. After a fault the filters before the faulting
    /// one run unfused.
    pub(super) fn response_fused(
        &mut self,
        head: RequestHead,
        info: &ResponseInfo,
        ran: usize,
    ) -> Ran<(RequestHead, Vec<FilterFault>)> {
        let mut skip = self.fused.as_ref().map_or(0, |f| f.chain.no_response);
        for (k, slot) in self.slots.iter().enumerate() {
            if slot.filter.health.is_degraded() {
                skip |= 1 << k;
            }
        }
        let Some(instance) = self.fused_instance() else {
            return Ran::Unfused(head);
        };
        let (head, result) = instance.on_response(head, info.clone(), ran, skip);
        match result {
            Ok(()) => Ran::Done((head, Vec::new())),
            Err(FusedFault { index, kind }) => {
                if let Some(fused) = self.fused.as_mut() {
                    fused.instance = None;
                }
                let mut faults = vec![self.fault(index, Phase::Response, kind)];
                let (head, more) = self.respond_unfused(head, info, index, None);
                faults.extend(more);
                Ran::Done((head, faults))
            }
        }
    }
}

pub(super) fn make(
    fused: &crate::fusion::FusedChain,
    filters: &[std::sync::Arc<crate::filter::LoadedFilter>],
) -> Option<FusedInstance> {
    match FusedInstance::new(fused, filters) {
        Ok(instance) => Some(instance),
        Err(e) => {
            tracing::error!(error = %e, "cannot create the fused chain's instance; the chain runs unfused");
            None
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

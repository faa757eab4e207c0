//! One call into a filter, whichever path runs it (component, core, proxy-wasm,
//! fused): what its store's data must have, how the store is armed for a call, how a
//! failed call becomes a fault, what a request callback answers, and what a chain run
//! hands each call.

use std::sync::Arc;
use std::time::Duration;

use dpumesh_head::RequestHead;
use wasmtime::{Store, Trap, UpdateDeadline};

use crate::bindings::{RequestLine, Verdict};
use crate::budget::{Check, CpuBudget, MAX_TICKS_BETWEEN_CHECKS};
use crate::error::FaultKind;
use crate::imports::StoreState;
use crate::limits::MemoryLimiter;
use crate::stderr::StderrTail;

/// What one chain run hands every filter call.
pub(crate) struct CallInput {
    /// The request line for `on-request`, built by the first filter that takes it.
    /// Filters cannot edit the line (pseudo-headers are read-only), the query, the
    /// destination or the source, so one copy serves the whole run.
    pub(crate) line: std::cell::OnceCell<Arc<RequestLine>>,
    /// What every batched call of the run shares; `None` when the chain has no
    /// batched filter.
    pub(crate) shared: Option<crate::input::Shared>,
}

impl CallInput {
    pub(crate) fn line(&self, head: &RequestHead) -> Arc<RequestLine> {
        self.line
            .get_or_init(|| {
                Arc::new(RequestLine {
                    method: crate::imports::wit_method(&head.method),
                    scheme: crate::imports::wit_scheme(&head.scheme),
                    authority: head.authority.clone(),
                    path: head.path.clone(),
                })
            })
            .clone()
    }
}

/// Most stderr quoted in a fault report.
const STDERR_QUOTE: usize = 400;

/// A filter's answer to a request callback.
#[derive(Debug)]
pub(crate) enum Answer {
    /// Go on to the next filter.
    Continue,
    /// Answer with this reply.
    Deny(crate::bindings::LocalReply),
    /// The request waits (a proxy-wasm plugin paused it) for these HTTP calls, or for
    /// those made before.
    Pause(Vec<crate::callout::Callout>),
}

impl From<Verdict> for Answer {
    fn from(verdict: Verdict) -> Self {
        match verdict {
            Verdict::Continue => Self::Continue,
            Verdict::Deny(reply) => Self::Deny(reply),
        }
    }
}

/// What every kind of instance's `Store` data has: a memory cap, a CPU budget and the
/// guest's stderr tail, which is what classifying a fault needs.
pub(crate) trait CallData: Send + 'static {
    fn limiter(&mut self) -> &mut MemoryLimiter;
    fn budget(&mut self) -> &mut CpuBudget;
    fn stderr(&self) -> &StderrTail;
}

impl CallData for StoreState {
    fn limiter(&mut self) -> &mut MemoryLimiter {
        &mut self.limiter
    }
    fn budget(&mut self) -> &mut CpuBudget {
        &mut self.budget
    }
    fn stderr(&self) -> &StderrTail {
        &self.stderr
    }
}

/// A store with the memory cap and the CPU-time deadline wired in, armed for a call
/// of `deadline` (the epoch ticker is woken by the caller).
pub(crate) fn new_store<T: CallData>(
    engine: &wasmtime::Engine,
    epoch: Arc<crate::epoch::Epoch>,
    data: T,
    deadline: Duration,
) -> Store<T> {
    let mut store = Store::new(engine, data);
    store.limiter(|state| state.limiter());
    // The epoch deadline only triggers a look at the thread's CPU time
    // (`budget`): a call that was preempted goes on.
    store.epoch_deadline_callback(move |mut store| {
        let cpu = crate::budget::thread_cpu_time();
        Ok(
            match store
                .data_mut()
                .budget()
                .check(cpu, MAX_TICKS_BETWEEN_CHECKS)
            {
                Check::Continue(ticks) => {
                    // Still running: keep the ticker from parking under this call.
                    epoch.call_begins();
                    UpdateDeadline::Continue(ticks)
                }
                Check::Exhausted | Check::Stalled => UpdateDeadline::Interrupt,
            },
        )
    });
    arm_store(&mut store, deadline);
    store
}

/// Readies `store` for a call of at most `deadline` of CPU time.
pub(crate) fn arm_store<T: CallData>(store: &mut Store<T>, deadline: Duration) {
    let data = store.data_mut();
    data.limiter().hit = false;
    let first = data.budget().arm(deadline, MAX_TICKS_BETWEEN_CHECKS);
    store.set_epoch_deadline(first);
}

/// Turns a call error into a fault: memory cap, deadline, or a trap with the guest's
/// last stderr output (a Rust panic message, say).
pub(crate) fn classify<T: CallData>(
    store: &mut Store<T>,
    error: wasmtime::Error,
    deadline: Duration,
) -> FaultKind {
    let data = store.data_mut();
    if data.limiter().hit {
        return FaultKind::MemoryCap(data.limiter().cap());
    }
    if let Some(Trap::Interrupt) = error.downcast_ref::<Trap>() {
        let budget = data.budget();
        return if budget.stalled() {
            FaultKind::Stalled(budget.backstop())
        } else {
            FaultKind::Deadline(deadline)
        };
    }
    let mut message = match error.downcast_ref::<Trap>() {
        Some(trap) => trap.to_string(),
        None => format!("{error:#}"),
    };
    let stderr = data.stderr().take();
    if !stderr.is_empty() {
        let start = stderr
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| stderr.len() - i <= STDERR_QUOTE)
            .unwrap_or(0);
        message.push_str("; guest stderr: ");
        message.push_str(&stderr[start..]);
    }
    FaultKind::Trap(message)
}

/// A response's header fields as the response phase may edit them (a proxy-wasm
/// plugin's `on_http_response_headers`; components only read `response-info`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResponseHeaders {
    /// The fields, in order (names lower-case), without `:status`.
    pub fields: Vec<(String, Vec<u8>)>,
    /// Whether a filter changed them.
    pub edited: bool,
}

//! One instance of a filter: its `Store`, its typed exports, and the calls into it.
//!
//! An instance belongs to one worker thread and handles one call at a time. A call
//! that faults leaves the instance unusable (wasmtime refuses to re-enter a component
//! instance that trapped), so the owner discards it and makes a new one.

use std::sync::Arc;
use std::time::{Duration, Instant};

use dpumesh_head::RequestHead;
use wasmtime::component::{Resource, TypedFunc};
use wasmtime::{Store, Trap, UpdateDeadline};

use crate::bindings::{HeaderEdit, Interest, Outcome, RequestLine, ResponseInfo, Verdict};
use crate::budget::Check;
use crate::error::{FaultKind, LoadError};
use crate::filter::LoadedFilter;
use crate::imports::{HeadHandle, StoreState};

/// The request line goes in by `Arc`: a chain builds it once per request and every
/// filter's call lowers it from there (no copy of the path and authority per filter).
type OnRequest = TypedFunc<(Arc<RequestLine>, Resource<HeadHandle>), (Verdict,)>;
type OnResponse = TypedFunc<(Resource<HeadHandle>, ResponseInfo), ()>;
type HandleRequest = TypedFunc<(Resource<HeadHandle>, Vec<u8>), (Outcome,)>;

/// Most headers and metadata keys a filter may declare it reads.
const MAX_DECLARED: usize = 256;

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
    fn line(&self, head: &RequestHead) -> Arc<RequestLine> {
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

/// A component of the `batched-filter` world: its call and what it declared.
struct Batched {
    handle: HandleRequest,
    interest: Interest,
}

/// Most stderr quoted in a fault report.
const STDERR_QUOTE: usize = 400;

/// A configured instance of a [`LoadedFilter`].
pub struct FilterInstance {
    filter: Arc<LoadedFilter>,
    store: Store<StoreState>,
    on_request: OnRequest,
    on_response: Option<OnResponse>,
    batched: Option<Batched>,
    startup: Startup,
}

/// How long an instance took to start: instantiation from the pool, then `configure`.
/// Interpreted guests spend most of it in `configure` (their engine parses and compiles
/// the guest's code on first call), which is why workers create instances ahead of
/// requests.
#[derive(Debug, Clone, Copy, Default)]
pub struct Startup {
    /// `InstancePre::instantiate`: pool slot, memory image, start functions.
    pub instantiate: Duration,
    /// The `configure` export's call (zero for filters without one).
    pub configure: Duration,
}

impl std::fmt::Debug for FilterInstance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FilterInstance")
            .field("filter", &self.filter.name())
            .finish_non_exhaustive()
    }
}

impl FilterInstance {
    pub(crate) fn new(filter: &Arc<LoadedFilter>) -> Result<Self, LoadError> {
        let runtime = &filter.runtime.inner;
        let settings = &filter.settings;
        let name = || settings.name.clone();
        let namespace = settings.namespace.as_deref().unwrap_or(&settings.name);
        let state = StoreState::new(
            filter.tag.clone(),
            namespace,
            &runtime.services,
            settings.memory_cap,
            runtime.config.epoch_tick,
        );
        let mut store = Store::new(&runtime.engine, state);
        store.limiter(|state| &mut state.limiter);
        // The epoch deadline only triggers a look at the thread's CPU time
        // (`budget`): a call that was preempted goes on.
        store.epoch_deadline_callback(|mut store| {
            let cpu = crate::budget::thread_cpu_time();
            Ok(match store.data_mut().budget.check(cpu) {
                Check::Continue(ticks) => UpdateDeadline::Continue(ticks),
                Check::Exhausted => UpdateDeadline::Interrupt,
            })
        });
        runtime.epoch.call_begins();
        let first = store.data_mut().budget.arm(settings.configure_deadline);
        store.set_epoch_deadline(first);

        let started = Instant::now();
        let instance = match filter.pre.instantiate(&mut store) {
            Ok(instance) => instance,
            Err(e) if store.data().limiter.hit => {
                return Err(LoadError::Settings {
                    filter: name(),
                    detail: format!(
                        "memory cap of {} KiB is below what the component needs to start ({e})",
                        settings.memory_cap / 1024
                    ),
                });
            }
            Err(e) => {
                return Err(LoadError::Instantiate {
                    filter: name(),
                    detail: format!("{e:#}"),
                });
            }
        };
        let export_type = |export: &'static str| {
            move |e: wasmtime::Error| LoadError::ExportType {
                filter: settings.name.clone(),
                export,
                detail: format!("{e:#}"),
            }
        };
        let on_request = instance
            .get_typed_func::<(Arc<RequestLine>, Resource<HeadHandle>), (Verdict,)>(
                &mut store,
                &filter.exports.on_request,
            )
            .map_err(export_type("on-request"))?;
        let on_response = match &filter.exports.on_response {
            Some(index) => Some(
                instance
                    .get_typed_func::<(Resource<HeadHandle>, ResponseInfo), ()>(&mut store, index)
                    .map_err(export_type("on-response"))?,
            ),
            None => None,
        };
        let instantiated = Instant::now();
        if let Some(index) = &filter.exports.configure {
            let configure = instance
                .get_typed_func::<(&str,), (Result<(), String>,)>(&mut store, index)
                .map_err(export_type("configure"))?;
            match configure.call(&mut store, (settings.config.as_str(),)) {
                Ok((Ok(()),)) => {}
                Ok((Err(message),)) => {
                    return Err(LoadError::Configure {
                        filter: name(),
                        message,
                    });
                }
                Err(e) => {
                    let fault = classify(&mut store, e, settings.configure_deadline);
                    return Err(LoadError::ConfigureFault {
                        filter: name(),
                        fault,
                    });
                }
            }
        }
        let batched = match &filter.exports.handle_request {
            None => {
                let _ = filter.batched.set(false);
                None
            }
            Some(index) => {
                let handle = instance
                    .get_typed_func::<(Resource<HeadHandle>, Vec<u8>), (Outcome,)>(
                        &mut store, index,
                    )
                    .map_err(export_type("handle-request"))?;
                let interest = match &filter.exports.interest {
                    None => Interest {
                        headers: Vec::new(),
                        metadata: Vec::new(),
                    },
                    Some(index) => {
                        let interest = instance
                            .get_typed_func::<(), (Interest,)>(&mut store, index)
                            .map_err(export_type("interest"))?;
                        match interest.call(&mut store, ()) {
                            Ok((interest,)) => interest,
                            Err(e) => {
                                let fault = classify(&mut store, e, settings.configure_deadline);
                                return Err(LoadError::ConfigureFault {
                                    filter: name(),
                                    fault,
                                });
                            }
                        }
                    }
                };
                let interest = checked_interest(&settings.name, interest)?;
                let declared = !interest.headers.is_empty() || !interest.metadata.is_empty();
                // Every instance of one configuration declares the same; the first
                // one's answer decides how the filter is called.
                let _ = filter.batched.set(declared);
                declared.then_some(Batched { handle, interest })
            }
        };
        let startup = Startup {
            instantiate: instantiated - started,
            configure: instantiated.elapsed(),
        };
        filter
            .live
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(Self {
            startup,
            filter: filter.clone(),
            store,
            on_request,
            on_response,
            batched,
        })
    }

    /// The filter this is an instance of.
    pub fn filter(&self) -> &Arc<LoadedFilter> {
        &self.filter
    }

    /// How long this instance took to start.
    pub fn startup(&self) -> Startup {
        self.startup
    }

    /// Readies the store for a call. The epoch ticker was woken by the caller, once
    /// per chain run ([`crate::chain::ChainRunner`]), not per filter.
    fn arm(&mut self) {
        let data = self.store.data_mut();
        data.limiter.hit = false;
        let first = data.budget.arm(self.filter.settings.deadline);
        self.store.set_epoch_deadline(first);
    }

    /// Runs the request phase (`handle-request` for a batched component, `on-request`
    /// otherwise) with `head` lent to the instance; the head comes back with the
    /// filter's edits, whatever happened.
    pub(crate) fn on_request(
        &mut self,
        call: &CallInput,
        head: RequestHead,
    ) -> (RequestHead, Result<Verdict, FaultKind>) {
        self.arm();
        let deadline = self.filter.settings.deadline;
        let result = match &self.batched {
            Some(batched) => {
                // The chain builds the shared part when it knows of a batched filter;
                // an instance declaring what its filter's first one did not (a filter
                // whose interest varies) gets it built here.
                let built;
                let shared = match &call.shared {
                    Some(shared) => shared,
                    None => {
                        let clock = &self.filter.runtime.inner.services.clock;
                        built =
                            crate::input::Shared::new(&head, clock.wall_ns(), clock.monotonic_ns());
                        &built
                    }
                };
                // The call takes the list by value (wasmtime lowers it from an owned
                // `Vec`), so it cannot be a buffer kept across calls.
                let mut input = Vec::with_capacity(512);
                crate::input::encode(
                    &mut input,
                    &head,
                    shared,
                    &batched.interest.headers,
                    &batched.interest.metadata,
                );
                let handle = batched.handle;
                self.store.data_mut().head = Some(head);
                match handle.call(&mut self.store, (Resource::new_borrow(0), input)) {
                    Ok((outcome,)) => apply(self.store.data_mut(), outcome),
                    Err(e) => Err(classify(&mut self.store, e, deadline)),
                }
            }
            None => {
                let line = call.line(&head);
                self.store.data_mut().head = Some(head);
                self.on_request
                    .call(&mut self.store, (line, Resource::new_borrow(0)))
                    .map(|(verdict,)| verdict)
                    .map_err(|e| classify(&mut self.store, e, deadline))
            }
        };
        (self.take_head(), result)
    }

    /// Runs `on-response` (a no-op for filters without a response phase).
    pub(crate) fn on_response(
        &mut self,
        head: RequestHead,
        info: ResponseInfo,
    ) -> (RequestHead, Result<(), FaultKind>) {
        let Some(on_response) = self.on_response else {
            return (head, Ok(()));
        };
        self.arm();
        self.store.data_mut().head = Some(head);
        let result = on_response.call(&mut self.store, (Resource::new_borrow(0), info));
        let head = self.take_head();
        let result =
            result.map_err(|e| classify(&mut self.store, e, self.filter.settings.deadline));
        (head, result)
    }

    fn take_head(&mut self) -> RequestHead {
        // The head was lent just before the call and nothing else takes it.
        self.store.data_mut().head.take().unwrap_or_default()
    }
}

impl Drop for FilterInstance {
    fn drop(&mut self) {
        self.filter
            .live
            .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Applies what a batched call returned to the lent head: counters, metadata, then
/// header edits in order, each checked as `set-header` and friends check them. A
/// refused edit faults the call (an SDK refuses it when it is made, so only a filter
/// that bypasses its SDK gets here).
fn apply(state: &mut StoreState, outcome: Outcome) -> Result<Verdict, FaultKind> {
    use crate::bindings::dpumesh::filter::metrics::Host as _;
    for (id, delta) in outcome.counters {
        // Never fails: unknown ids are ignored, as the import does.
        let _ = state.increment(id, delta);
    }
    let head = state
        .head
        .as_mut()
        .ok_or_else(|| FaultKind::Trap("the head was not lent (a host bug)".into()))?;
    for (key, value) in &outcome.metadata {
        head.set_metadata(key, value);
    }
    for edit in outcome.headers {
        let (name, result) = match &edit {
            HeaderEdit::Set((name, value)) => (name, head.set_header(name, value)),
            HeaderEdit::Append((name, value)) => (name, head.append_header(name, value)),
            HeaderEdit::Remove(name) => (name, head.remove_header(name)),
        };
        result.map_err(|e| FaultKind::BadReply(format!("header edit of {name:?} refused: {e}")))?;
    }
    Ok(outcome.verdict)
}

/// Lower-cases declared header names (matching is case-insensitive) and bounds what
/// a filter may declare.
fn checked_interest(filter: &str, mut interest: Interest) -> Result<Interest, LoadError> {
    if interest.headers.len() > MAX_DECLARED || interest.metadata.len() > MAX_DECLARED {
        return Err(LoadError::Settings {
            filter: filter.to_owned(),
            detail: format!(
                "the filter declares {} headers and {} metadata keys; at most {MAX_DECLARED} each",
                interest.headers.len(),
                interest.metadata.len()
            ),
        });
    }
    for name in &mut interest.headers {
        name.make_ascii_lowercase();
    }
    Ok(interest)
}

/// Turns a call error into a fault: memory cap, deadline, or a trap with the guest's
/// last stderr output (a Rust panic message, say).
fn classify(
    store: &mut Store<StoreState>,
    error: wasmtime::Error,
    deadline: Duration,
) -> FaultKind {
    let data = store.data_mut();
    if data.limiter.hit {
        return FaultKind::MemoryCap(data.limiter.cap());
    }
    if let Some(Trap::Interrupt) = error.downcast_ref::<Trap>() {
        return FaultKind::Deadline(deadline);
    }
    let mut message = match error.downcast_ref::<Trap>() {
        Some(trap) => trap.to_string(),
        None => format!("{error:#}"),
    };
    let stderr = data.stderr.take();
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

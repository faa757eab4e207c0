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

use crate::bindings::{RequestLine, ResponseInfo, Verdict};
use crate::budget::Check;
use crate::error::{FaultKind, LoadError};
use crate::filter::LoadedFilter;
use crate::imports::{HeadHandle, StoreState};

/// The request line goes in by `Arc`: a chain builds it once per request and every
/// filter's call lowers it from there (no copy of the path and authority per filter).
type OnRequest = TypedFunc<(Arc<RequestLine>, Resource<HeadHandle>), (Verdict,)>;
type OnResponse = TypedFunc<(Resource<HeadHandle>, ResponseInfo), ()>;

/// Most stderr quoted in a fault report.
const STDERR_QUOTE: usize = 400;

/// A configured instance of a [`LoadedFilter`].
pub struct FilterInstance {
    filter: Arc<LoadedFilter>,
    store: Store<StoreState>,
    on_request: OnRequest,
    on_response: Option<OnResponse>,
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

    /// Runs `on-request` with `head` lent to the instance; the head comes back with the
    /// filter's edits, whatever happened.
    pub(crate) fn on_request(
        &mut self,
        line: Arc<RequestLine>,
        head: RequestHead,
    ) -> (RequestHead, Result<Verdict, FaultKind>) {
        self.arm();
        self.store.data_mut().head = Some(head);
        let result = self
            .on_request
            .call(&mut self.store, (line, Resource::new_borrow(0)));
        let head = self.take_head();
        let result = result
            .map(|(verdict,)| verdict)
            .map_err(|e| classify(&mut self.store, e, self.filter.settings.deadline));
        (head, result)
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

//! One instance of a filter: its `Store`, its typed exports, and the calls into it.
//!
//! An instance belongs to one worker thread and handles one call at a time. A call
//! that faults leaves the instance unusable (wasmtime refuses to re-enter a component
//! instance that trapped), so the owner discards it and makes a new one.

use std::sync::Arc;
use std::time::{Duration, Instant};

use dpumesh_head::RequestHead;
use wasmtime::Store;
use wasmtime::component::{Resource, TypedFunc};

use crate::bindings::{HeaderEdit, Interest, Outcome, RequestLine, ResponseInfo, Verdict};
use crate::call::{Answer, CallInput, arm_store, classify, new_store};
use crate::error::{FaultKind, LoadError};
use crate::filter::{FilterKind, LoadedFilter};
use crate::imports::{HeadHandle, StoreState};
use crate::proxywasm::instance::PwInstance;

/// The request line goes in by `Arc`: a chain builds it once per request and every
/// filter's call lowers it from there (no copy of the path and authority per filter).
type OnRequest = TypedFunc<(Arc<RequestLine>, Resource<HeadHandle>), (Verdict,)>;
type OnResponse = TypedFunc<(Resource<HeadHandle>, ResponseInfo), ()>;
type HandleRequest = TypedFunc<(Resource<HeadHandle>, Vec<u8>), (Outcome,)>;

/// Most headers and metadata keys a filter may declare it reads.
const MAX_DECLARED: usize = 256;

/// A component of the `batched-filter` world: its call and what it declared.
struct Batched {
    handle: HandleRequest,
    interest: Interest,
}

/// A configured instance of a [`LoadedFilter`].
pub struct FilterInstance {
    filter: Arc<LoadedFilter>,
    inner: Inner,
    startup: Startup,
}

/// A component's instance (through wasmtime's component calls, or as a core
/// instance: [`crate::canon`]) or a proxy-wasm plugin's.
enum Inner {
    Component(Box<ComponentCalls>),
    Core(Box<crate::canon::calls::CoreCalls>),
    ProxyWasm(Box<PwInstance>),
}

/// A component instance and its typed exports.
struct ComponentCalls {
    store: Store<StoreState>,
    on_request: OnRequest,
    on_response: Option<OnResponse>,
    batched: Option<Batched>,
}

/// A store of one component filter (its identity, namespace and memory cap), armed
/// for `configure`.
fn filter_store(filter: &LoadedFilter) -> Store<StoreState> {
    let runtime = &filter.runtime.inner;
    let settings = &filter.settings;
    let namespace = settings.namespace.as_deref().unwrap_or(&settings.name);
    let state = StoreState::new(
        filter.tag.clone(),
        namespace,
        &runtime.services,
        settings.memory_cap,
        runtime.config.epoch_tick,
    );
    new_store(
        &runtime.engine,
        runtime.epoch.clone(),
        state,
        settings.configure_deadline,
    )
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
    /// An instance of `filter`; a plugin's shared-queue notifications wake its owner
    /// through `wake`.
    pub(crate) fn new(
        filter: &Arc<LoadedFilter>,
        wake: &Arc<crate::queues::WakeSlot>,
    ) -> Result<Self, LoadError> {
        let runtime = &filter.runtime.inner;
        let settings = &filter.settings;
        let name = || settings.name.clone();
        runtime.epoch.call_begins();
        let (pre, exports) = match &filter.kind {
            FilterKind::Component {
                core: Some(core), ..
            } => return Self::new_core(filter, core),
            FilterKind::Component { pre, exports, .. } => (pre, exports),
            FilterKind::ProxyWasm(plugin) => {
                let started = Instant::now();
                let state = plugin_state(filter, plugin, wake);
                let store = new_store(
                    &runtime.engine,
                    runtime.epoch.clone(),
                    state,
                    settings.configure_deadline,
                );
                let instance = PwInstance::new(plugin, store, settings.configure_deadline)?;
                filter
                    .live
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let _ = filter.batched.set(false);
                return Ok(Self {
                    filter: filter.clone(),
                    inner: Inner::ProxyWasm(Box::new(instance)),
                    // Instantiation and the root's start are one step here.
                    startup: Startup {
                        instantiate: Duration::ZERO,
                        configure: started.elapsed(),
                    },
                });
            }
        };
        let mut store = filter_store(filter);

        let started = Instant::now();
        let instance = match pre.instantiate(&mut store) {
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
        filter.initial_memory.store(
            store.data().limiter.committed(),
            std::sync::atomic::Ordering::Relaxed,
        );
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
                &exports.on_request,
            )
            .map_err(export_type("on-request"))?;
        let on_response = match &exports.on_response {
            Some(index) => Some(
                instance
                    .get_typed_func::<(Resource<HeadHandle>, ResponseInfo), ()>(&mut store, index)
                    .map_err(export_type("on-response"))?,
            ),
            None => None,
        };
        let instantiated = Instant::now();
        if let Some(index) = &exports.configure {
            configure(&mut store, &instance, index, settings)?;
        }
        let batched = match &exports.handle_request {
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
                let interest = match &exports.interest {
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
            inner: Inner::Component(Box::new(ComponentCalls {
                store,
                on_request,
                on_response,
                batched,
            })),
        })
    }

    /// An instance of `filter` run as a core instance.
    fn new_core(
        filter: &Arc<LoadedFilter>,
        core: &crate::canon::CoreFilter,
    ) -> Result<Self, LoadError> {
        let settings = &filter.settings;
        let name = || settings.name.clone();
        let started = Instant::now();
        let mut calls = match crate::canon::calls::CoreCalls::new(core, filter_store(filter)) {
            Ok(calls) => calls,
            Err((store, e)) if store.data().limiter.hit => {
                return Err(LoadError::Settings {
                    filter: name(),
                    detail: format!(
                        "memory cap of {} KiB is below what the component needs to start ({e})",
                        settings.memory_cap / 1024
                    ),
                });
            }
            Err((_, e)) => {
                return Err(LoadError::Instantiate {
                    filter: name(),
                    detail: format!("{e:#}"),
                });
            }
        };
        filter.initial_memory.store(
            calls.store.data().limiter.committed(),
            std::sync::atomic::Ordering::Relaxed,
        );
        let instantiated = Instant::now();
        match calls.configure(&settings.config) {
            Ok(Ok(())) => {}
            Ok(Err(message)) => {
                return Err(LoadError::Configure {
                    filter: name(),
                    message,
                });
            }
            Err(e) => {
                return Err(LoadError::ConfigureFault {
                    filter: name(),
                    fault: classify(&mut calls.store, e, settings.configure_deadline),
                });
            }
        }
        // Host calls are cheap here, so the batched call's input (built per call)
        // would cost more than the reads it saves.
        let _ = filter.batched.set(false);
        filter
            .live
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(Self {
            startup: Startup {
                instantiate: instantiated - started,
                configure: instantiated.elapsed(),
            },
            filter: filter.clone(),
            inner: Inner::Core(Box::new(calls)),
        })
    }

    /// Runs a proxy-wasm plugin's `proxy_on_tick` if due; returns when the next is
    /// due (`None` for components and plugins without a tick period). A tick that
    /// faults leaves the instance to be replaced, like a faulted request call.
    pub(crate) fn tick(&mut self, now: Instant) -> (Option<Instant>, Result<(), FaultKind>) {
        let deadline = self.filter.settings.deadline;
        match &mut self.inner {
            Inner::ProxyWasm(pw) if pw.ticks() => {
                arm_store(&mut pw.store, deadline);
                pw.tick(now, deadline)
            }
            _ => (None, Ok(())),
        }
    }

    /// Ends a healthy instance that is no longer needed (a proxy-wasm plugin's root
    /// gets `proxy_on_done` and `proxy_on_delete`; a component has nothing to end).
    pub(crate) fn retire(&mut self) {
        let deadline = self.filter.settings.deadline;
        if let Inner::ProxyWasm(pw) = &mut self.inner {
            arm_store(&mut pw.store, deadline);
            pw.retire(deadline);
        }
    }

    /// The HTTP calls a plugin's root context made since the last look (for an owner
    /// that makes them).
    pub(crate) fn take_root_calls(&mut self) -> Vec<crate::callout::Callout> {
        match &mut self.inner {
            Inner::ProxyWasm(pw) => pw.take_root_calls(),
            Inner::Component(_) | Inner::Core(_) => Vec::new(),
        }
    }

    /// Hands a plugin's root the answer to its call `token`.
    pub(crate) fn on_root_callout(
        &mut self,
        token: u32,
        reply: &crate::callout::CalloutReply,
    ) -> Result<(), FaultKind> {
        let deadline = self.filter.settings.deadline;
        match &mut self.inner {
            Inner::ProxyWasm(pw) => {
                arm_store(&mut pw.store, deadline);
                pw.on_root_callout(token, reply, deadline)
            }
            Inner::Component(_) | Inner::Core(_) => Ok(()),
        }
    }

    /// The filter this is an instance of.
    pub fn filter(&self) -> &Arc<LoadedFilter> {
        &self.filter
    }

    /// How long this instance took to start.
    pub fn startup(&self) -> Startup {
        self.startup
    }

    /// Runs the request phase (`handle-request` for a batched component, `on-request`
    /// otherwise) with `head` lent to the instance; the head comes back with the
    /// filter's edits, whatever happened.
    pub(crate) fn on_request(
        &mut self,
        call: &CallInput,
        head: Box<RequestHead>,
    ) -> (Box<RequestHead>, Result<Answer, FaultKind>) {
        // The epoch ticker was woken by the caller, once per chain run
        // (the chain's runner), not per filter.
        let deadline = self.filter.settings.deadline;
        let this = match &mut self.inner {
            Inner::Component(c) => c,
            Inner::Core(core) => {
                arm_store(&mut core.store, deadline);
                // Built (once per chain run) only for a filter that takes the line.
                let line = core.takes_line().then(|| call.line(&head));
                core.store.data_mut().head = Some(head);
                let result = core
                    .on_request(line.as_deref())
                    .map_err(|e| classify(&mut core.store, e, deadline));
                return (take_head(&mut core.store), result.map(Answer::from));
            }
            Inner::ProxyWasm(pw) => {
                arm_store(&mut pw.store, deadline);
                return pw.on_request(head, deadline);
            }
        };
        arm_store(&mut this.store, deadline);
        let result = match &this.batched {
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
                this.store.data_mut().head = Some(head);
                match handle.call(&mut this.store, (Resource::new_borrow(0), input)) {
                    Ok((outcome,)) => apply(this.store.data_mut(), outcome),
                    Err(e) => Err(classify(&mut this.store, e, deadline)),
                }
            }
            None => {
                let line = call.line(&head);
                this.store.data_mut().head = Some(head);
                this.on_request
                    .call(&mut this.store, (line, Resource::new_borrow(0)))
                    .map(|(verdict,)| verdict)
                    .map_err(|e| classify(&mut this.store, e, deadline))
            }
        };
        (take_head(&mut this.store), result.map(Answer::from))
    }

    /// Hands a paused request the answer to one of its HTTP calls (only a proxy-wasm
    /// plugin pauses; a component never has calls under way).
    pub(crate) fn on_callout(
        &mut self,
        head: Box<RequestHead>,
        token: u32,
        reply: &crate::callout::CalloutReply,
    ) -> (Box<RequestHead>, Result<Answer, FaultKind>) {
        let deadline = self.filter.settings.deadline;
        match &mut self.inner {
            Inner::ProxyWasm(pw) => {
                arm_store(&mut pw.store, deadline);
                pw.on_callout(head, token, reply, deadline)
            }
            Inner::Component(_) | Inner::Core(_) => (
                head,
                Err(FaultKind::Unavailable(
                    "a component has no HTTP calls under way".to_owned(),
                )),
            ),
        }
    }

    /// Runs `on-response` (a no-op for filters without a response phase).
    pub(crate) fn on_response(
        &mut self,
        head: Box<RequestHead>,
        info: ResponseInfo,
        headers: Option<&mut crate::call::ResponseHeaders>,
    ) -> (Box<RequestHead>, Result<(), FaultKind>) {
        let deadline = self.filter.settings.deadline;
        let this = match &mut self.inner {
            Inner::Component(c) => c,
            Inner::Core(core) => {
                if !core.has_response() {
                    return (head, Ok(()));
                }
                arm_store(&mut core.store, deadline);
                core.store.data_mut().head = Some(head);
                let result = core.on_response(&info);
                let head = take_head(&mut core.store);
                return (
                    head,
                    result.map_err(|e| classify(&mut core.store, e, deadline)),
                );
            }
            Inner::ProxyWasm(pw) => {
                arm_store(&mut pw.store, deadline);
                return pw.on_response(head, &info, headers, deadline);
            }
        };
        let Some(on_response) = this.on_response else {
            return (head, Ok(()));
        };
        arm_store(&mut this.store, deadline);
        this.store.data_mut().head = Some(head);
        let result = on_response.call(&mut this.store, (Resource::new_borrow(0), info));
        let head = take_head(&mut this.store);
        let result = result.map_err(|e| classify(&mut this.store, e, deadline));
        (head, result)
    }
}

fn take_head(store: &mut Store<StoreState>) -> Box<RequestHead> {
    // The head was lent just before the call and nothing else takes it.
    store.data_mut().head.take().unwrap_or_default()
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

/// Calls a component's `configure` export (at `index` of `instance`) with the filter's
/// configuration, under its configure deadline (the caller armed it).
pub(crate) fn configure(
    store: &mut Store<StoreState>,
    instance: &wasmtime::component::Instance,
    index: &wasmtime::component::ComponentExportIndex,
    settings: &crate::filter::FilterSettings,
) -> Result<(), LoadError> {
    let name = || settings.name.clone();
    let configure = instance
        .get_typed_func::<(&str,), (Result<(), String>,)>(&mut *store, index)
        .map_err(|e| LoadError::ExportType {
            filter: name(),
            export: "configure",
            detail: format!("{e:#}"),
        })?;
    match configure.call(&mut *store, (settings.config.as_str(),)) {
        Ok((Ok(()),)) => Ok(()),
        Ok((Err(message),)) => Err(LoadError::Configure {
            filter: name(),
            message,
        }),
        Err(e) => Err(LoadError::ConfigureFault {
            filter: name(),
            fault: classify(store, e, settings.configure_deadline),
        }),
    }
}

/// The store data of a new instance of `filter`.
fn plugin_state(
    filter: &Arc<LoadedFilter>,
    plugin: &Arc<crate::proxywasm::plugin::Plugin>,
    wake: &Arc<crate::queues::WakeSlot>,
) -> crate::proxywasm::state::PwState {
    let runtime = &filter.runtime.inner;
    let settings = &filter.settings;
    let stderr = crate::stderr::StderrTail::default();
    // No files, no network, no environment or arguments: a plugin sees the head.
    let wasi = wasmtime_wasi::WasiCtx::builder()
        .stderr(stderr.clone())
        .stdout(stderr.clone())
        .allow_tcp(false)
        .allow_udp(false)
        .allow_ip_name_lookup(false)
        .build_p1();
    let namespace = settings.namespace.as_deref().unwrap_or(&settings.name);
    crate::proxywasm::state::PwState {
        limiter: crate::limits::MemoryLimiter::new(settings.memory_cap),
        budget: crate::budget::CpuBudget::new(runtime.config.epoch_tick),
        stderr,
        wasi,
        services: runtime.services.clone(),
        shared: runtime.services.state.namespace(namespace),
        config: plugin.config.clone(),
        call: Default::default(),
        metrics: Vec::new(),
        metric_ids: Default::default(),
        vm_id: namespace.to_owned(),
        queue_owner: crate::queues::QueueOwner::new(wake.clone()),
        tick_ms: 0,
        contexts: Default::default(),
    }
}

impl LoadedFilter {
    /// A new instance, configured. Used by workers; also how a load is validated.
    pub fn instantiate(self: &Arc<Self>) -> Result<FilterInstance, LoadError> {
        FilterInstance::new(self, &Arc::default())
    }
}

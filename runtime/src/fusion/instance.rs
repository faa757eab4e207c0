//! One instance of a fused chain: its store, the driver's two calls, and the host's
//! `enter-filter`.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use dpumesh_head::RequestHead;
use wasmtime::component::{Resource, TypedFunc};

use super::FusedChain;
use crate::bindings::{RequestLine, ResponseInfo, Verdict};
use crate::call::{CallInput, arm_store, classify, new_store};
use crate::error::{FaultKind, LoadError};
use crate::filter::LoadedFilter;
use crate::imports::{HeadHandle, Member, StoreState};
use crate::instance::configure;
use crate::stamp::Stamp;

type RunRequest = TypedFunc<(Arc<RequestLine>, Resource<HeadHandle>, u32), ((u32, Verdict),)>;
type RunResponse = TypedFunc<(Resource<HeadHandle>, ResponseInfo, u32, u32), ()>;

/// A fault in a fused call: the filter it belongs to (the one this call entered
/// last; `None` when the driver failed before entering any) and what happened.
#[derive(Debug)]
pub(crate) struct FusedFault {
    pub(crate) index: Option<usize>,
    pub(crate) kind: FaultKind,
}

/// What `run-request` answered: the filter that decided (the chain's length when all
/// continued) and its verdict.
pub(crate) struct Decided {
    pub(crate) index: usize,
    pub(crate) verdict: Verdict,
}

/// A configured instance of a [`FusedChain`].
pub(crate) struct FusedInstance {
    store: wasmtime::Store<StoreState>,
    run_request: RunRequest,
    run_response: RunResponse,
    filters: Vec<Arc<LoadedFilter>>,
}

impl FusedInstance {
    /// Instantiates `fused` and configures each filter as its own instance would be.
    pub(crate) fn new(
        fused: &FusedChain,
        filters: &[Arc<LoadedFilter>],
    ) -> Result<Self, LoadError> {
        let runtime = &filters[0].runtime.inner;
        let members = filters
            .iter()
            .map(|f| {
                let s = &f.settings;
                Member::new(
                    f.tag.clone(),
                    s.namespace.as_deref().unwrap_or(&s.name),
                    &runtime.services,
                    s.deadline,
                    s.failure_policy.restores_head(),
                )
            })
            .collect();
        // Each filter's budget starts with what its memories take when it starts (its
        // own instance measured that at load): which memory is whose is not known
        // while the whole composition is instantiated.
        let limiter = crate::limits::MemoryLimiter::per_filter(filters.iter().map(|f| {
            (
                f.settings.memory_cap,
                f.initial_memory.load(Ordering::Relaxed),
            )
        }));
        let state = StoreState::fused(
            members,
            limiter,
            &runtime.services,
            runtime.config.epoch_tick,
        );
        let setup_deadline = filters
            .iter()
            .map(|f| f.settings.configure_deadline)
            .max()
            .unwrap_or(Duration::from_secs(1));
        runtime.epoch.call_begins();
        let mut store = new_store(
            &runtime.engine,
            runtime.epoch.clone(),
            state,
            setup_deadline,
        );
        let first = || filters[0].settings.name.clone();
        let instance = match fused.pre.instantiate(&mut store) {
            Ok(instance) => instance,
            Err(e) if store.data().limiter.hit => {
                return Err(LoadError::Settings {
                    filter: first(),
                    detail: format!(
                        "a memory cap is below what the fused chain's filters need to start ({e})"
                    ),
                });
            }
            Err(e) => {
                return Err(LoadError::Instantiate {
                    filter: first(),
                    detail: format!("fused chain: {e:#}"),
                });
            }
        };
        for (k, filter) in filters.iter().enumerate() {
            let Some(index) = &fused.configure[k] else {
                continue;
            };
            let settings = &filter.settings;
            store.data_mut().switch_to(k);
            arm_store(&mut store, settings.configure_deadline);
            configure(&mut store, &instance, index, settings)?;
        }
        let typed_error = |export: &'static str| {
            move |e: wasmtime::Error| LoadError::Instantiate {
                filter: first(),
                detail: format!("fused chain's {export}: {e:#}"),
            }
        };
        let run_request = instance
            .get_typed_func(&mut store, fused.run_request)
            .map_err(typed_error("run-request"))?;
        let run_response = instance
            .get_typed_func(&mut store, fused.run_response)
            .map_err(typed_error("run-response"))?;
        for filter in filters {
            filter.live.fetch_add(1, Ordering::Relaxed);
        }
        Ok(Self {
            store,
            run_request,
            run_response,
            filters: filters.to_vec(),
        })
    }

    /// Runs the request phase of every filter whose bit in `skip` is clear, in order,
    /// until one denies. The head comes back with the edits, whatever happened; with
    /// a fault, also the head as it was before the faulting filter when its policy
    /// retries (see [`Member`]).
    pub(crate) fn on_request(
        &mut self,
        call: &CallInput,
        head: Box<RequestHead>,
        skip: u32,
    ) -> (Box<RequestHead>, Result<Decided, FusedFault>) {
        let line = call.line(&head);
        self.begin(head, true);
        let result = self
            .run_request
            .call(&mut self.store, (line, Resource::new_borrow(0), skip))
            .map(|((index, verdict),)| Decided {
                index: index as usize,
                verdict,
            })
            .map_err(|e| self.fault(e));
        (self.take_head(), result)
    }

    /// Runs the response phase, last filter first, of the first `ran` filters whose
    /// bit in `skip` is clear.
    pub(crate) fn on_response(
        &mut self,
        head: Box<RequestHead>,
        info: ResponseInfo,
        ran: usize,
        skip: u32,
    ) -> (Box<RequestHead>, Result<(), FusedFault>) {
        self.begin(head, false);
        let result = self
            .run_response
            .call(
                &mut self.store,
                (Resource::new_borrow(0), info, ran as u32, skip),
            )
            .map_err(|e| self.fault(e));
        (self.take_head(), result)
    }

    /// When each filter entered during the last request phase began (filter index,
    /// time).
    pub(crate) fn marks(&self) -> &[(u32, Stamp)] {
        self.store.data().marks()
    }

    /// The head as it was before the filter that faulted, if its policy retries.
    pub(crate) fn take_reload_head(&mut self) -> Option<RequestHead> {
        self.store.data_mut().take_reload_head()
    }

    /// Lends `head` and readies the store for a call (the driver arms each filter's
    /// own deadline as it enters it).
    fn begin(&mut self, head: Box<RequestHead>, timed: bool) {
        arm_store(&mut self.store, self.filters[0].settings.deadline);
        let state = self.store.data_mut();
        state.head = Some(head);
        state.begin_run(timed);
    }

    fn take_head(&mut self) -> Box<RequestHead> {
        // Lent just before the call; nothing else takes it.
        self.store.data_mut().head.take().unwrap_or_default()
    }

    fn fault(&mut self, error: wasmtime::Error) -> FusedFault {
        let index = self.store.data().entered_last();
        let deadline = self.filters[index.unwrap_or(0)].settings.deadline;
        FusedFault {
            index,
            kind: classify(&mut self.store, error, deadline),
        }
    }
}

impl Drop for FusedInstance {
    fn drop(&mut self) {
        for filter in &self.filters {
            filter.live.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

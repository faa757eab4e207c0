//! Fused chains: a chain's filter components composed into one component, so a
//! request enters Wasm once per phase instead of once per filter.
//!
//! A separate instance per filter costs a host→guest entry per filter and phase: the
//! call machinery, the request line lowered through the guest's allocator (itself a
//! call into the guest), the verdict lifted, the post-return call. Composed, the host
//! enters a generated [driver](driver) once; the driver calls each filter through the
//! adapters wasmtime compiles between components, which copy the line from memory to
//! memory without leaving Wasm.
//!
//! What stays per filter, as in separate instances:
//! - its identity: logs, metrics, shared-state namespace and key sets are the filter's
//!   own, because the driver calls the host's `enter-filter` before each filter and the
//!   store switches to that filter's [`Member`](crate::imports::Member);
//! - its limits: the CPU deadline is re-armed for each filter, the memory cap is
//!   checked per filter's memory;
//! - its failure policy: a fault is the filter's that this call entered last (one
//!   before any filter was entered — a request line too large for the driver — is no
//!   filter's: the whole chain runs unfused for that request); the fused instance is
//!   discarded (wasmtime cannot re-enter it) and the rest of that request, and the
//!   requests until the runner's `repair` makes it again, run on separate instances,
//!   exactly as an unfused chain would run them;
//! - its time: each filter's duration histogram gets the time from its entry to the
//!   next one's.
//!
//! What is shared: one store, so the filters' instances are created and discarded
//! together (a fault in one restarts the state of all, such as the JWT filter's token
//! cache); the parsed-claims cache of `request-head.claims`; one stderr tail (a
//! fault's report may quote what an earlier filter of the call wrote). Memory caps
//! hold per filter: each filter's budget starts with what its memories take at start
//! (measured on its own instance at load), and what the driver's own memory grows by
//! while a filter runs (a denial's reply copied out) is charged to that filter.
//!
//! Fusion applies to chains of components only (a proxy-wasm plugin keeps its own
//! instance), of at most [`driver::MAX_FILTERS`] filters, all loaded by one runtime;
//! batched filters are called with `on-request` (their edits must be visible to the
//! next filter at once).

pub(crate) mod compose;
pub(crate) mod driver;
pub(crate) mod instance;

use std::sync::Arc;

use wasmtime::component::{ComponentExportIndex, InstancePre};

use crate::error::LoadError;
use crate::filter::{FilterKind, LoadedFilter};
use crate::imports::StoreState;

/// A fused chain, compiled: what every worker instantiates.
pub(crate) struct FusedChain {
    pub(crate) pre: InstancePre<StoreState>,
    pub(crate) run_request: ComponentExportIndex,
    pub(crate) run_response: ComponentExportIndex,
    /// Each filter's `configure`, if it has one.
    pub(crate) configure: Vec<Option<ComponentExportIndex>>,
    /// Filters without a response phase (always skipped in `run-response`): a mask.
    pub(crate) no_response: u32,
    /// SHA-256 of the composed component.
    pub(crate) hash: String,
}

impl std::fmt::Debug for FusedChain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FusedChain")
            .field("filters", &self.configure.len())
            .field("hash", &self.hash)
            .finish_non_exhaustive()
    }
}

/// Why a chain is not fused, when it cannot be.
pub(crate) fn unfusable(filters: &[Arc<LoadedFilter>]) -> Option<String> {
    if filters.is_empty() {
        return Some("the chain is empty".to_owned());
    }
    if filters.len() > driver::MAX_FILTERS {
        return Some(format!(
            "the chain has {} filters; at most {} are fused",
            filters.len(),
            driver::MAX_FILTERS
        ));
    }
    if let Some(plugin) = filters.iter().find(|f| f.is_proxy_wasm()) {
        return Some(format!(
            "filter {:?} is a proxy-wasm plugin, not a component",
            plugin.name()
        ));
    }
    let runtime = &filters[0].runtime.inner;
    if filters
        .iter()
        .any(|f| !Arc::ptr_eq(&f.runtime.inner, runtime))
    {
        return Some("the filters were loaded by different runtimes".to_owned());
    }
    None
}

/// Composes and compiles `filters` into one component (through the runtime's compile
/// cache: the same chain of the same components is compiled once per machine).
pub(crate) fn fuse(chain: &str, filters: &[Arc<LoadedFilter>]) -> Result<FusedChain, LoadError> {
    let failed = |detail: String| LoadError::Fuse {
        chain: chain.to_owned(),
        detail,
    };
    if let Some(reason) = unfusable(filters) {
        return Err(failed(reason));
    }
    let mut members = Vec::with_capacity(filters.len());
    let mut response = Vec::with_capacity(filters.len());
    for filter in filters {
        let FilterKind::Component { exports, bytes, .. } = &filter.kind else {
            return Err(failed(format!("{:?} is not a component", filter.name())));
        };
        response.push(exports.on_response.is_some());
        members.push(compose::Member {
            bytes,
            configure: exports.configure.is_some(),
            on_response: exports.on_response.is_some(),
        });
    }
    let driver = driver::component(&response).map_err(|e| failed(e.to_string()))?;
    let composed = compose::compose(&driver, &members).map_err(|e| match e {
        compose::ComposeError::Member { index, source } => failed(format!(
            "filter {:?} cannot be composed: {source:#}",
            filters[index].name()
        )),
        other => failed(other.to_string()),
    })?;
    let runtime = &filters[0].runtime.inner;
    let hash = crate::artifacts::content_hash(&composed);
    let component = runtime
        .cache
        .get_or_compile(&runtime.engine, &hash, &composed)
        .map_err(|e| match e {
            crate::artifacts::CompileError::NotAComponent(detail)
            | crate::artifacts::CompileError::Compile(detail) => failed(detail),
        })?;
    let export = |name: &str| component.get_export_index(None, name);
    let run_request = export(driver::RUN_REQUEST)
        .ok_or_else(|| failed("the composition lacks run-request".to_owned()))?;
    let run_response = export(driver::RUN_RESPONSE)
        .ok_or_else(|| failed("the composition lacks run-response".to_owned()))?;
    let configure = members
        .iter()
        .enumerate()
        .map(|(k, m)| {
            m.configure
                .then(|| export(&compose::configure_export(k)))
                .flatten()
        })
        .collect();
    let no_response = response
        .iter()
        .enumerate()
        .filter(|(_, has)| !**has)
        .fold(0u32, |mask, (k, _)| mask | 1 << k);
    let pre = runtime
        .linker
        .instantiate_pre(&component)
        .map_err(|e| failed(format!("{e:#}")))?;
    let fused = FusedChain {
        pre,
        run_request,
        run_response,
        configure,
        no_response,
        hash,
    };
    // One instance now, configured, as a filter's load makes one: a fused chain that
    // cannot start is refused here rather than tried per worker.
    instance::FusedInstance::new(&fused, filters)
        .map_err(|e| failed(format!("its instance does not start: {e}")))?;
    Ok(fused)
}

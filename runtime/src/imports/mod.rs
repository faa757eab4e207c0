//! The host side of the filter world: what a filter's imports do.
//!
//! Each filter instance has its own [`StoreState`] (the wasmtime `Store` data). The
//! request head is moved into it for the duration of a call and taken back after, so
//! the `request-head` resource needs no table lookups: the handle is a stand-in and
//! every method works on the head currently lent to the instance.

use std::collections::HashMap;
use std::sync::Arc;

use dpumesh_clock::SharedClock;
use dpumesh_head::RequestHead;
use dpumesh_keys::KeyStore;
use dpumesh_shared_state::{Namespace, SharedState};
use wasmtime::component::ResourceTable;
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use crate::bindings::dpumesh::filter::metrics;
use crate::limits::MemoryLimiter;
use crate::stderr::StderrTail;

mod head;
mod services;

pub(crate) use head::{wit_method, wit_scheme};

/// Stand-in type of the `request-head` resource (see the module docs).
#[derive(Debug)]
pub struct HeadHandle;

/// Node-wide services every filter instance reaches through its imports.
#[derive(Debug, Clone)]
pub struct NodeServices {
    /// Time for filters, WASI clocks and shared-state TTLs.
    pub clock: SharedClock,
    /// Node-wide shared state.
    pub state: Arc<SharedState>,
    /// Key sets for signature verification.
    pub keys: Arc<KeyStore>,
    /// The upstream names a filter's HTTP calls may use.
    pub callouts: Arc<crate::callout::CalloutTargets>,
    /// proxy-wasm plugins' shared queues.
    pub queues: Arc<crate::proxywasm::queues::SharedQueues>,
}

/// Per-instance identity used to tag logs and metrics.
#[derive(Debug)]
pub(crate) struct FilterTag {
    pub(crate) name: Arc<str>,
}

/// Most metrics one instance may define.
const MAX_METRICS: usize = 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum MetricKind {
    Counter,
    Gauge,
    Histogram,
}

/// A metric's identity within an instance: kind, name and labels.
type MetricKey = (MetricKind, String, Vec<(String, String)>);

enum MetricHandle {
    Counter(::metrics::Counter),
    Gauge(::metrics::Gauge),
    Histogram(::metrics::Histogram),
}

/// The data of one filter instance's `Store`.
pub(crate) struct StoreState {
    /// The head lent to the instance during a call.
    pub(crate) head: Option<RequestHead>,
    pub(crate) limiter: MemoryLimiter,
    pub(crate) stderr: StderrTail,
    /// The CPU budget of the call under way.
    pub(crate) budget: crate::budget::CpuBudget,
    /// Verified claims parsed for `request-head.claims`, by payload text: a token seen
    /// again is not parsed again.
    claims: dpumesh_claims::Cache,
    tag: Arc<FilterTag>,
    services: NodeServices,
    namespace: Namespace,
    metrics: Vec<MetricHandle>,
    metric_ids: HashMap<MetricKey, u32>,
    wasi: WasiCtx,
    table: ResourceTable,
}

impl StoreState {
    pub(crate) fn new(
        tag: Arc<FilterTag>,
        namespace: &str,
        services: &NodeServices,
        memory_cap: usize,
        tick: std::time::Duration,
    ) -> Self {
        let stderr = StderrTail::default();
        let mut wasi = WasiCtx::builder();
        // No filesystem, no network, no environment: a filter sees only the head.
        // Its clocks are the host's, so a fixed test clock fixes WASI time too.
        wasi.stderr(stderr.clone())
            .wall_clock(WallClock(services.clock.clone()))
            .monotonic_clock(MonotonicClock(services.clock.clone()))
            .allow_tcp(false)
            .allow_udp(false)
            .allow_ip_name_lookup(false);
        Self {
            head: None,
            limiter: MemoryLimiter::new(memory_cap),
            stderr,
            budget: crate::budget::CpuBudget::new(tick),
            claims: dpumesh_claims::Cache::new(),
            namespace: services.state.namespace(namespace),
            tag,
            services: services.clone(),
            metrics: Vec::new(),
            metric_ids: HashMap::new(),
            wasi: wasi.build(),
            table: ResourceTable::new(),
        }
    }

    /// The head lent to the current call. A guest can only reach it through a handle
    /// the call gave it, so its absence is a host bug; it traps the call (the filter's
    /// failure policy applies) rather than taking the worker thread down.
    fn head(&self) -> wasmtime::Result<&RequestHead> {
        self.head.as_ref().ok_or_else(no_head)
    }

    fn head_mut(&mut self) -> wasmtime::Result<&mut RequestHead> {
        self.head.as_mut().ok_or_else(no_head)
    }

    fn define_metric(
        &mut self,
        kind: MetricKind,
        name: String,
        labels: Vec<(String, String)>,
    ) -> Result<u32, metrics::MetricError> {
        if !valid_metric_name(&name) || name.starts_with("dpumesh_") {
            return Err(metrics::MetricError::InvalidName);
        }
        if labels
            .iter()
            .any(|(k, _)| k == "filter" || !valid_label_name(k))
        {
            return Err(metrics::MetricError::InvalidLabel);
        }
        let key = (kind, name, labels);
        if let Some(id) = self.metric_ids.get(&key) {
            return Ok(*id);
        }
        if self.metrics.len() >= MAX_METRICS {
            return Err(metrics::MetricError::TooMany);
        }
        let (kind, name, labels) = key.clone();
        let mut all: Vec<::metrics::Label> = labels
            .into_iter()
            .map(|(k, v)| ::metrics::Label::new(k, v))
            .collect();
        all.push(::metrics::Label::new("filter", self.tag.name.to_string()));
        let handle = match kind {
            MetricKind::Counter => MetricHandle::Counter(::metrics::counter!(name, all)),
            MetricKind::Gauge => MetricHandle::Gauge(::metrics::gauge!(name, all)),
            MetricKind::Histogram => MetricHandle::Histogram(::metrics::histogram!(name, all)),
        };
        let id = self.metrics.len() as u32;
        self.metrics.push(handle);
        self.metric_ids.insert(key, id);
        Ok(id)
    }
}

fn no_head() -> wasmtime::Error {
    wasmtime::format_err!("request-head used outside of a call that lent it (a host bug)")
}

/// Prometheus metric names: `[a-zA-Z_:][a-zA-Z0-9_:]*`.
fn valid_metric_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

/// Prometheus label names: `[a-zA-Z_][a-zA-Z0-9_]*`.
fn valid_label_name(name: &str) -> bool {
    !name.is_empty()
        && !name.starts_with(|c: char| c.is_ascii_digit())
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

impl WasiView for StoreState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

struct WallClock(SharedClock);

impl wasmtime_wasi::HostWallClock for WallClock {
    fn resolution(&self) -> std::time::Duration {
        std::time::Duration::from_nanos(1)
    }

    fn now(&self) -> std::time::Duration {
        std::time::Duration::from_nanos(self.0.wall_ns())
    }
}

struct MonotonicClock(SharedClock);

impl wasmtime_wasi::HostMonotonicClock for MonotonicClock {
    fn resolution(&self) -> u64 {
        1
    }

    fn now(&self) -> u64 {
        self.0.monotonic_ns()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_and_label_names_follow_prometheus() {
        assert!(valid_metric_name("jwt_denied_total"));
        assert!(valid_metric_name("ns:rate"));
        assert!(!valid_metric_name("9lives"));
        assert!(!valid_metric_name("has space"));
        assert!(!valid_metric_name(""));
        assert!(valid_label_name("reason"));
        assert!(!valid_label_name("a:b"));
        assert!(!valid_label_name("1x"));
    }
}

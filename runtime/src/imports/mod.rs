//! The host side of the filter world: what a filter's imports do.
//!
//! Each filter instance has its own [`StoreState`] (the wasmtime `Store` data). The
//! request head is moved into it for the duration of a call and taken back after, so
//! the `request-head` resource needs no table lookups: the handle is a stand-in and
//! every method works on the head currently lent to the instance.

use std::sync::Arc;
use std::time::Duration;

use dpumesh_clock::SharedClock;
use dpumesh_head::RequestHead;
use dpumesh_keys::KeyStore;
use dpumesh_shared_state::SharedState;
use wasmtime::component::ResourceTable;
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use crate::bindings::dpumesh::filter::metrics;
use crate::limits::MemoryLimiter;
use crate::stamp::Stamp;
use crate::stderr::StderrTail;

pub(crate) mod clocks;
pub(crate) mod core;
mod head;
mod members;
mod services;

pub(crate) use head::{header_error, wit_method, wit_scheme};
pub(crate) use members::Member;
use members::{FusedRun, Members};

pub use crate::bindings::HeadHandle;

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
    pub queues: Arc<crate::queues::SharedQueues>,
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

/// The data of one instance's `Store` (a filter's, or a fused chain's).
pub(crate) struct StoreState {
    /// The head lent to the instance during a call, boxed: lending it and taking it
    /// back moves a pointer, not the head (the chain keeps the box between requests).
    pub(crate) head: Option<Box<RequestHead>>,
    pub(crate) limiter: MemoryLimiter,
    pub(crate) stderr: StderrTail,
    /// The CPU budget of the call under way.
    pub(crate) budget: crate::budget::CpuBudget,
    /// Verified claims parsed for `request-head.claims`, by payload text: a token seen
    /// again is not parsed again.
    claims: dpumesh_claims::ParsedClaims,
    /// The filters the store acts for (the per-filter part).
    members: Members,
    /// What the fused call under way records (the fused path's part).
    run: FusedRun,
    services: NodeServices,
    /// WASI's context and the resource table (the component path's part).
    wasi: Wasi,
    /// The instance's memory and allocator when it runs as a core instance (the
    /// core path's part).
    pub(crate) core: Option<core::Guest>,
}

impl StoreState {
    pub(crate) fn new(
        tag: Arc<FilterTag>,
        namespace: &str,
        services: &NodeServices,
        memory_cap: usize,
        tick: Duration,
    ) -> Self {
        let member = Member::new(tag, namespace, services, Duration::ZERO, false);
        let limiter = MemoryLimiter::new(memory_cap);
        Self::with_members(vec![member], limiter, services, tick)
    }

    /// The store of a fused chain: one member per filter, in chain order, and the
    /// limiter with a budget for each.
    pub(crate) fn fused(
        members: Vec<Member>,
        limiter: MemoryLimiter,
        services: &NodeServices,
        tick: Duration,
    ) -> Self {
        Self::with_members(members, limiter, services, tick)
    }

    fn with_members(
        members: Vec<Member>,
        limiter: MemoryLimiter,
        services: &NodeServices,
        tick: Duration,
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
            limiter,
            stderr,
            budget: crate::budget::CpuBudget::new(tick),
            claims: dpumesh_claims::ParsedClaims::new(),
            members: Members::new(members),
            run: FusedRun::default(),
            services: services.clone(),
            wasi: Wasi {
                ctx: wasi.build(),
                table: ResourceTable::new(),
            },
            core: None,
        }
    }

    /// The node's clock (what WASI's clocks read too).
    pub(crate) fn clock(&self) -> &SharedClock {
        &self.services.clock
    }

    /// The store's WASI random sources.
    pub(crate) fn random(&mut self) -> &mut wasmtime_wasi::random::WasiRandomCtx {
        self.wasi.ctx.random()
    }

    /// The filter the guest code running now belongs to.
    fn member(&self) -> &Member {
        self.members.current()
    }

    fn member_mut(&mut self) -> &mut Member {
        self.members.current_mut()
    }

    /// Acts for filter `index` from now on (its identity and memory cap).
    pub(crate) fn switch_to(&mut self, index: usize) {
        if self.members.switch_to(index) {
            self.limiter.switch_to(index);
        }
    }

    /// A fused call is about to start: forget the last one's marks, and charge no
    /// filter's budget until the driver enters one (what the driver's own memory
    /// takes for the call's arguments is no filter's). A `timed` call stamps each
    /// entry.
    pub(crate) fn begin_run(&mut self, timed: bool) {
        self.run.begin(timed);
        self.limiter.charge_none();
    }

    /// The fused chain's driver enters filter `index`: act for it, stamp the time (in a
    /// timed call), keep
    /// the head if its policy retries, and arm its CPU deadline; returns the epoch
    /// ticks to the first look at it.
    pub(crate) fn enter(&mut self, index: usize) -> wasmtime::Result<u64> {
        if index >= self.members.len() {
            return Err(wasmtime::format_err!(
                "the chain driver entered filter {index} of {} (a host bug)",
                self.members.len()
            ));
        }
        self.switch_to(index);
        let member = self.members.current();
        self.run.enter(index, member.reload, self.head.as_deref());
        self.limiter.hit = false;
        Ok(self
            .budget
            .arm(member.deadline, crate::budget::MAX_TICKS_BETWEEN_CHECKS))
    }

    /// The filters entered by the last fused call, with the time each began.
    pub(crate) fn marks(&self) -> &[(u32, Stamp)] {
        &self.run.marks
    }

    /// The head as it was before the last fused call entered a filter whose policy
    /// retries (taken: it is used once).
    pub(crate) fn take_reload_head(&mut self) -> Option<RequestHead> {
        self.run.reload_head.take()
    }

    /// The filter the last fused call entered last, if it entered any.
    pub(crate) fn entered_last(&self) -> Option<usize> {
        self.run.entered.map(|k| k as usize)
    }

    /// The head lent to the current call. A guest can only reach it through a handle
    /// the call gave it, so its absence is a host bug; it traps the call (the filter's
    /// failure policy applies) rather than taking the worker thread down.
    fn head(&self) -> wasmtime::Result<&RequestHead> {
        self.head.as_deref().ok_or_else(no_head)
    }

    fn head_mut(&mut self) -> wasmtime::Result<&mut RequestHead> {
        self.head.as_deref_mut().ok_or_else(no_head)
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
        let member = self.member_mut();
        let key = (kind, name, labels);
        if let Some(id) = member.metric_ids.get(&key) {
            return Ok(*id);
        }
        if member.metrics.len() >= MAX_METRICS {
            return Err(metrics::MetricError::TooMany);
        }
        let (kind, name, labels) = key.clone();
        let mut all: Vec<::metrics::Label> = labels
            .into_iter()
            .map(|(k, v)| ::metrics::Label::new(k, v))
            .collect();
        all.push(::metrics::Label::new("filter", member.tag.name.to_string()));
        let handle = match kind {
            MetricKind::Counter => MetricHandle::Counter(::metrics::counter!(name, all)),
            MetricKind::Gauge => MetricHandle::Gauge(::metrics::gauge!(name, all)),
            MetricKind::Histogram => MetricHandle::Histogram(::metrics::histogram!(name, all)),
        };
        let id = member.metrics.len() as u32;
        member.metrics.push(handle);
        member.metric_ids.insert(key, id);
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

/// The component path's part of a store: WASI's context and the resource table its
/// imports use.
struct Wasi {
    ctx: WasiCtx,
    table: ResourceTable,
}

impl WasiView for StoreState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi.ctx,
            table: &mut self.wasi.table,
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

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
use dpumesh_shared_state::{BucketSpec, Namespace, SharedState};
use wasmtime::component::{Resource, ResourceTable};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use crate::bindings::dpumesh::filter::{clock, crypto, log, metrics, shared_state, types};
use crate::limits::MemoryLimiter;
use crate::stderr::StderrTail;

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

// === impl types ===

fn header_error(e: dpumesh_head::HeaderError) -> types::HeaderError {
    match e {
        dpumesh_head::HeaderError::InvalidName => types::HeaderError::InvalidName,
        dpumesh_head::HeaderError::InvalidValue => types::HeaderError::InvalidValue,
        dpumesh_head::HeaderError::ReadOnly => types::HeaderError::ReadOnly,
    }
}

/// The method as the world passes it: common methods as cases, others as text.
pub(crate) fn wit_method(method: &str) -> types::Method {
    match method {
        "GET" => types::Method::Get,
        "HEAD" => types::Method::Head,
        "POST" => types::Method::Post,
        "PUT" => types::Method::Put,
        "DELETE" => types::Method::Delete,
        "CONNECT" => types::Method::Connect,
        "OPTIONS" => types::Method::Options,
        "TRACE" => types::Method::Trace,
        "PATCH" => types::Method::Patch,
        other => types::Method::Other(other.to_owned()),
    }
}

pub(crate) fn wit_scheme(scheme: &str) -> types::Scheme {
    if scheme.eq_ignore_ascii_case("https") {
        types::Scheme::Https
    } else {
        types::Scheme::Http
    }
}

impl types::Host for StoreState {}

impl types::HostRequestHead for StoreState {
    fn method(&mut self, _: Resource<HeadHandle>) -> wasmtime::Result<types::Method> {
        Ok(wit_method(&self.head()?.method))
    }

    fn scheme(&mut self, _: Resource<HeadHandle>) -> wasmtime::Result<types::Scheme> {
        Ok(wit_scheme(&self.head()?.scheme))
    }

    fn authority(&mut self, _: Resource<HeadHandle>) -> wasmtime::Result<String> {
        Ok(self.head()?.authority.clone())
    }

    fn path(&mut self, _: Resource<HeadHandle>) -> wasmtime::Result<String> {
        Ok(self.head()?.path.clone())
    }

    fn query(&mut self, _: Resource<HeadHandle>) -> wasmtime::Result<Option<String>> {
        Ok(self.head()?.query.clone())
    }

    fn header(
        &mut self,
        _: Resource<HeadHandle>,
        name: String,
    ) -> wasmtime::Result<Option<String>> {
        Ok(self.head()?.header(&name))
    }

    fn header_all(
        &mut self,
        _: Resource<HeadHandle>,
        name: String,
    ) -> wasmtime::Result<Vec<String>> {
        Ok(self.head()?.header_all(&name))
    }

    fn headers(
        &mut self,
        _: Resource<HeadHandle>,
        names: Vec<String>,
    ) -> wasmtime::Result<Vec<Option<String>>> {
        let head = self.head()?;
        Ok(names.iter().map(|name| head.header(name)).collect())
    }

    fn header_names(&mut self, _: Resource<HeadHandle>) -> wasmtime::Result<Vec<String>> {
        Ok(self.head()?.header_names())
    }

    fn source(&mut self, _: Resource<HeadHandle>) -> wasmtime::Result<types::Peer> {
        let source = &self.head()?.source;
        Ok(types::Peer {
            address: source.addr.ip().to_string(),
            port: source.addr.port(),
            identity: source.identity.clone(),
        })
    }

    fn destination(&mut self, _: Resource<HeadHandle>) -> wasmtime::Result<Option<String>> {
        Ok(self.head()?.destination.clone())
    }

    fn set_header(
        &mut self,
        _: Resource<HeadHandle>,
        name: String,
        value: String,
    ) -> wasmtime::Result<Result<(), types::HeaderError>> {
        Ok(self
            .head_mut()?
            .set_header(&name, &value)
            .map_err(header_error))
    }

    fn append_header(
        &mut self,
        _: Resource<HeadHandle>,
        name: String,
        value: String,
    ) -> wasmtime::Result<Result<(), types::HeaderError>> {
        Ok(self
            .head_mut()?
            .append_header(&name, &value)
            .map_err(header_error))
    }

    fn remove_header(
        &mut self,
        _: Resource<HeadHandle>,
        name: String,
    ) -> wasmtime::Result<Result<(), types::HeaderError>> {
        Ok(self.head_mut()?.remove_header(&name).map_err(header_error))
    }

    fn metadata(
        &mut self,
        _: Resource<HeadHandle>,
        key: String,
    ) -> wasmtime::Result<Option<String>> {
        Ok(self.head()?.metadata(&key).map(str::to_owned))
    }

    fn set_metadata(
        &mut self,
        _: Resource<HeadHandle>,
        key: String,
        value: String,
    ) -> wasmtime::Result<()> {
        self.head_mut()?.set_metadata(&key, &value);
        Ok(())
    }

    fn set_metadata_batch(
        &mut self,
        _: Resource<HeadHandle>,
        entries: Vec<(String, String)>,
    ) -> wasmtime::Result<()> {
        let head = self.head_mut()?;
        for (key, value) in &entries {
            head.set_metadata(key, value);
        }
        Ok(())
    }

    fn drop(&mut self, _: Resource<HeadHandle>) -> wasmtime::Result<()> {
        // Heads are only ever lent (borrowed), never owned by a guest.
        Ok(())
    }
}

// === impl log ===

fn enabled(level: log::Level) -> bool {
    match level {
        log::Level::Trace => tracing::enabled!(target: "dpumesh::filter", tracing::Level::TRACE),
        log::Level::Debug => tracing::enabled!(target: "dpumesh::filter", tracing::Level::DEBUG),
        log::Level::Info => tracing::enabled!(target: "dpumesh::filter", tracing::Level::INFO),
        log::Level::Warn => tracing::enabled!(target: "dpumesh::filter", tracing::Level::WARN),
        log::Level::Error => tracing::enabled!(target: "dpumesh::filter", tracing::Level::ERROR),
    }
}

impl log::Host for StoreState {
    fn enabled(&mut self, level: log::Level) -> wasmtime::Result<bool> {
        Ok(enabled(level))
    }

    fn log(&mut self, level: log::Level, message: String) -> wasmtime::Result<()> {
        let filter = &*self.tag.name;
        match level {
            log::Level::Trace => tracing::trace!(target: "dpumesh::filter", filter, "{message}"),
            log::Level::Debug => tracing::debug!(target: "dpumesh::filter", filter, "{message}"),
            log::Level::Info => tracing::info!(target: "dpumesh::filter", filter, "{message}"),
            log::Level::Warn => tracing::warn!(target: "dpumesh::filter", filter, "{message}"),
            log::Level::Error => tracing::error!(target: "dpumesh::filter", filter, "{message}"),
        }
        Ok(())
    }
}

// === impl clock ===

impl clock::Host for StoreState {
    fn wall_ns(&mut self) -> wasmtime::Result<u64> {
        Ok(self.services.clock.wall_ns())
    }

    fn monotonic_ns(&mut self) -> wasmtime::Result<u64> {
        Ok(self.services.clock.monotonic_ns())
    }
}

// === impl metrics ===

impl metrics::Host for StoreState {
    fn counter(
        &mut self,
        name: String,
        labels: Vec<(String, String)>,
    ) -> wasmtime::Result<Result<u32, metrics::MetricError>> {
        Ok(self.define_metric(MetricKind::Counter, name, labels))
    }

    fn gauge(
        &mut self,
        name: String,
        labels: Vec<(String, String)>,
    ) -> wasmtime::Result<Result<u32, metrics::MetricError>> {
        Ok(self.define_metric(MetricKind::Gauge, name, labels))
    }

    fn histogram(
        &mut self,
        name: String,
        labels: Vec<(String, String)>,
    ) -> wasmtime::Result<Result<u32, metrics::MetricError>> {
        Ok(self.define_metric(MetricKind::Histogram, name, labels))
    }

    fn increment(&mut self, id: u32, delta: u64) -> wasmtime::Result<()> {
        if let Some(MetricHandle::Counter(c)) = self.metrics.get(id as usize) {
            c.increment(delta);
        }
        Ok(())
    }

    fn increment_batch(&mut self, deltas: Vec<(u32, u64)>) -> wasmtime::Result<()> {
        for (id, delta) in deltas {
            metrics::Host::increment(self, id, delta)?;
        }
        Ok(())
    }

    fn gauge_set(&mut self, id: u32, value: f64) -> wasmtime::Result<()> {
        if let Some(MetricHandle::Gauge(g)) = self.metrics.get(id as usize) {
            g.set(value);
        }
        Ok(())
    }

    fn gauge_add(&mut self, id: u32, delta: f64) -> wasmtime::Result<()> {
        if let Some(MetricHandle::Gauge(g)) = self.metrics.get(id as usize) {
            g.increment(delta);
        }
        Ok(())
    }

    fn observe(&mut self, id: u32, value: f64) -> wasmtime::Result<()> {
        if let Some(MetricHandle::Histogram(h)) = self.metrics.get(id as usize) {
            h.record(value);
        }
        Ok(())
    }
}

// === impl shared-state ===

fn state_error(e: dpumesh_shared_state::StateError) -> shared_state::StateError {
    match e {
        dpumesh_shared_state::StateError::InvalidKey => shared_state::StateError::InvalidKey,
        dpumesh_shared_state::StateError::WrongType => shared_state::StateError::WrongType,
        dpumesh_shared_state::StateError::Full => shared_state::StateError::Full,
    }
}

impl shared_state::Host for StoreState {
    fn increment(
        &mut self,
        key: String,
        delta: i64,
        ttl_ms: u64,
    ) -> wasmtime::Result<Result<i64, shared_state::StateError>> {
        Ok(self
            .namespace
            .increment(&key, delta, ttl_ms)
            .map_err(state_error))
    }

    fn get(
        &mut self,
        key: String,
    ) -> wasmtime::Result<Result<Option<i64>, shared_state::StateError>> {
        Ok(self.namespace.get(&key).map_err(state_error))
    }

    fn compare_and_swap(
        &mut self,
        key: String,
        expected: Option<i64>,
        desired: i64,
        ttl_ms: u64,
    ) -> wasmtime::Result<Result<Result<(), Option<i64>>, shared_state::StateError>> {
        Ok(self
            .namespace
            .compare_and_swap(&key, expected, desired, ttl_ms)
            .map_err(state_error))
    }

    fn delete(&mut self, key: String) -> wasmtime::Result<Result<bool, shared_state::StateError>> {
        Ok(self.namespace.delete(&key).map_err(state_error))
    }

    fn token_bucket_take(
        &mut self,
        key: String,
        capacity: u64,
        refill_tokens: u64,
        refill_interval_ms: u64,
        cost: u64,
    ) -> wasmtime::Result<Result<shared_state::BucketResult, shared_state::StateError>> {
        let spec = BucketSpec {
            capacity,
            refill_tokens,
            refill_interval_ms,
        };
        Ok(self
            .namespace
            .token_bucket_take(&key, spec, cost)
            .map(|r| shared_state::BucketResult {
                allowed: r.allowed,
                remaining: r.remaining,
                reset_after_ms: r.reset_after_ms,
            })
            .map_err(state_error))
    }
}

// === impl crypto ===

fn algorithm(alg: crypto::Algorithm) -> dpumesh_keys::Algorithm {
    use dpumesh_keys::Algorithm as A;
    match alg {
        crypto::Algorithm::Hs256 => A::Hs256,
        crypto::Algorithm::Hs384 => A::Hs384,
        crypto::Algorithm::Hs512 => A::Hs512,
        crypto::Algorithm::Rs256 => A::Rs256,
        crypto::Algorithm::Rs384 => A::Rs384,
        crypto::Algorithm::Rs512 => A::Rs512,
        crypto::Algorithm::Ps256 => A::Ps256,
        crypto::Algorithm::Ps384 => A::Ps384,
        crypto::Algorithm::Ps512 => A::Ps512,
        crypto::Algorithm::Es256 => A::Es256,
        crypto::Algorithm::Es384 => A::Es384,
        crypto::Algorithm::Eddsa => A::EdDsa,
    }
}

impl crypto::Host for StoreState {
    fn verify(
        &mut self,
        alg: crypto::Algorithm,
        key_set: String,
        key_id: Option<String>,
        message: Vec<u8>,
        signature: Vec<u8>,
    ) -> wasmtime::Result<Result<String, crypto::VerifyError>> {
        use dpumesh_keys::VerifyError as K;
        Ok(self
            .services
            .keys
            .verify(
                algorithm(alg),
                &key_set,
                key_id.as_deref(),
                &message,
                &signature,
            )
            .map_err(|e| match e {
                K::UnknownKeySet => crypto::VerifyError::UnknownKeySet,
                K::UnknownKey => crypto::VerifyError::UnknownKey,
                K::KeyAlgorithmMismatch => crypto::VerifyError::KeyAlgorithmMismatch,
                K::InvalidSignature => crypto::VerifyError::InvalidSignature,
            }))
    }

    fn key_set_version(&mut self, key_set: String) -> wasmtime::Result<u64> {
        Ok(self.services.keys.version(&key_set))
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

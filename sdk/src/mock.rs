//! A mock proxy for native unit tests: `cargo test` runs a filter's logic with the same
//! shared-state, key-verification and header-editing semantics as the proxy, on a
//! fixed clock, without wasmtime.
//!
//! ```
//! use dpumesh_filter_sdk::mock::{MockProxy, MockRequest};
//! use dpumesh_filter_sdk::{Filter, Request, Verdict, LocalReply};
//!
//! struct DenyAdmin;
//! impl Filter for DenyAdmin {
//!     type Config = ();
//!     fn new(_: ()) -> Result<Self, String> { Ok(Self) }
//!     fn on_request(&mut self, req: &Request<'_>) -> Verdict {
//!         if req.path().starts_with("/admin") {
//!             LocalReply::new(403).into()
//!         } else {
//!             req.set_header("x-checked", "1").unwrap();
//!             Verdict::Continue
//!         }
//!     }
//! }
//!
//! let host = MockProxy::new().install();
//! let mut filter: DenyAdmin = dpumesh_filter_sdk::configure("").unwrap();
//! let req = MockRequest::get("/admin/users");
//! assert_eq!(host.on_request(&mut filter, &req).reply().unwrap().status, 403);
//! let req = MockRequest::get("/public");
//! assert!(host.on_request(&mut filter, &req).is_continue());
//! assert_eq!(req.header("x-checked").as_deref(), Some("1"));
//! ```

use std::cell::{Cell, Ref, RefCell};
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::Arc;

use dpumesh_clock::{ManualClock, SharedClock};
use dpumesh_head::RequestHead;
use dpumesh_keys::{KeySet, KeyStore};
use dpumesh_shared_state::{Namespace, SharedState, StateLimits};

use crate::log::Level;
use crate::metrics::{Kind, MetricError};
use crate::{Filter, HeadAccess, HeaderError, Peer, Request, RequestLine, ResponseInfo, Verdict};

/// Where the mock clock starts: 2023-11-14T22:13:20Z.
pub const DEFAULT_UNIX_SECS: u64 = 1_700_000_000;

thread_local! {
    static CURRENT: RefCell<Option<MockProxy>> = const { RefCell::new(None) };
}

#[derive(Debug)]
struct Metric {
    kind: Kind,
    name: String,
    labels: Vec<(String, String)>,
    value: f64,
}

#[derive(Debug)]
struct Inner {
    clock: Arc<ManualClock>,
    state: Arc<SharedState>,
    namespace: Namespace,
    keys: Arc<KeyStore>,
    logs: RefCell<Vec<(Level, String)>>,
    min_level: Cell<Level>,
    metrics: RefCell<Vec<Metric>>,
    /// Parsed payloads, as the proxy keeps them for `claims`.
    claims: RefCell<dpumesh_claims::ParsedClaims>,
}

/// The mock proxy. Cloning gives another handle to the same one.
///
/// The mock a filter's calls reach is the one [installed](MockProxy::install) on the
/// current thread; a default one is created on first use. Each test thread starts
/// fresh, so tests do not see each other's state.
#[derive(Debug, Clone)]
pub struct MockProxy {
    inner: Rc<Inner>,
}

impl Default for MockProxy {
    fn default() -> Self {
        Self::new()
    }
}

impl MockProxy {
    /// A fresh host: clock at [`DEFAULT_UNIX_SECS`], empty state, no keys, logging at
    /// debug and above.
    pub fn new() -> Self {
        let clock = ManualClock::at_unix_secs(DEFAULT_UNIX_SECS);
        let shared: SharedClock = clock.clone();
        let state = SharedState::new(shared, StateLimits::default());
        let namespace = state.namespace("mock");
        Self {
            inner: Rc::new(Inner {
                clock,
                state,
                namespace,
                keys: KeyStore::new(),
                logs: RefCell::new(Vec::new()),
                min_level: Cell::new(Level::Debug),
                metrics: RefCell::new(Vec::new()),
                claims: RefCell::new(dpumesh_claims::ParsedClaims::new()),
            }),
        }
    }

    /// Makes this the mock proxy of the current thread and returns it.
    pub fn install(self) -> Self {
        CURRENT.with(|current| *current.borrow_mut() = Some(self.clone()));
        self
    }

    /// The current thread's mock proxy (a fresh one if none was installed).
    pub fn current() -> Self {
        CURRENT.with(|current| {
            current
                .borrow_mut()
                .get_or_insert_with(MockProxy::new)
                .clone()
        })
    }

    /// Sets the wall clock to `secs` since the epoch.
    pub fn at_unix_secs(self, secs: u64) -> Self {
        self.inner.clock.set_wall_unix_secs(secs);
        self
    }

    /// Loads a JWKS document as key set `name`.
    pub fn with_jwks(self, name: &str, jwks: &str) -> Result<Self, String> {
        let set = KeySet::from_jwks(jwks).map_err(|e| e.to_string())?;
        self.inner.keys.insert(name, set);
        Ok(self)
    }

    /// Loads one HMAC secret as key set `name`.
    pub fn with_secret(self, name: &str, kid: Option<&str>, secret: &[u8]) -> Self {
        self.inner
            .keys
            .insert(name, KeySet::from_secret(kid, secret));
        self
    }

    /// Only log lines at `level` or above are enabled.
    pub fn with_log_level(self, level: Level) -> Self {
        self.inner.min_level.set(level);
        self
    }

    /// The clock, to advance it.
    pub fn clock(&self) -> &ManualClock {
        &self.inner.clock
    }

    /// Moves time forward by `millis`.
    pub fn advance_ms(&self, millis: u64) {
        self.inner.clock.advance_ms(millis);
    }

    /// Moves time forward by `secs`.
    pub fn advance_secs(&self, secs: u64) {
        self.inner.clock.advance_secs(secs);
    }

    /// The key store (to replace key sets mid-test).
    pub fn keys(&self) -> &KeyStore {
        &self.inner.keys
    }

    /// The filter's shared-state namespace.
    pub fn namespace(&self) -> &Namespace {
        &self.inner.namespace
    }

    /// The node-wide store behind the namespace.
    pub fn shared_state(&self) -> &Arc<SharedState> {
        &self.inner.state
    }

    /// Every log line so far.
    pub fn logs(&self) -> Vec<(Level, String)> {
        self.inner.logs.borrow().clone()
    }

    /// The value of a counter, gauge or histogram sum (0 when never defined).
    pub fn metric(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.inner
            .metrics
            .borrow()
            .iter()
            .find(|m| m.name == name && same_labels(&m.labels, labels))
            .map_or(0.0, |m| m.value)
    }

    /// Runs `filter.on_request` on `req` with this host installed.
    pub fn on_request<F: Filter>(&self, filter: &mut F, req: &MockRequest) -> Verdict {
        let previous = self.swap_in();
        let line = req.line();
        let verdict = filter.on_request(&Request::with_line(line, req));
        Self::restore(previous);
        verdict
    }

    /// Runs `filter.on_response` with this host installed.
    pub fn on_response<F: Filter>(&self, filter: &mut F, req: &MockRequest, info: &ResponseInfo) {
        let previous = self.swap_in();
        filter.on_response(&Request::lazy(req), info);
        Self::restore(previous);
    }

    /// Builds a filter from `config` with this host installed.
    pub fn configure<F: Filter>(&self, config: &str) -> Result<F, String> {
        let previous = self.swap_in();
        let result = crate::configure(config);
        Self::restore(previous);
        result
    }

    fn swap_in(&self) -> Option<MockProxy> {
        CURRENT.with(|current| current.borrow_mut().replace(self.clone()))
    }

    fn restore(previous: Option<MockProxy>) {
        if let Some(previous) = previous {
            CURRENT.with(|current| *current.borrow_mut() = Some(previous));
        }
    }

    pub(crate) fn log_enabled(&self, level: Level) -> bool {
        level >= self.inner.min_level.get()
    }

    pub(crate) fn push_log(&self, level: Level, message: &str) {
        if self.log_enabled(level) {
            self.inner
                .logs
                .borrow_mut()
                .push((level, message.to_owned()));
        }
    }

    pub(crate) fn define_metric(
        &self,
        kind: Kind,
        name: &str,
        labels: &[(&str, &str)],
    ) -> Result<u32, MetricError> {
        if !valid_name(name, true) {
            return Err(MetricError::InvalidName);
        }
        if labels
            .iter()
            .any(|(k, _)| *k == "filter" || !valid_name(k, false))
        {
            return Err(MetricError::InvalidLabel);
        }
        let mut metrics = self.inner.metrics.borrow_mut();
        if let Some(id) = metrics
            .iter()
            .position(|m| m.kind == kind && m.name == name && same_labels(&m.labels, labels))
        {
            return Ok(id as u32);
        }
        if metrics.len() >= 1024 {
            return Err(MetricError::TooMany);
        }
        metrics.push(Metric {
            kind,
            name: name.to_owned(),
            labels: labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            value: 0.0,
        });
        Ok(metrics.len() as u32 - 1)
    }

    pub(crate) fn update_metric(&self, id: u32, kind: Kind, f: impl FnOnce(f64) -> f64) {
        if let Some(metric) = self.inner.metrics.borrow_mut().get_mut(id as usize)
            && metric.kind == kind
        {
            metric.value = f(metric.value);
        }
    }
}

fn same_labels(have: &[(String, String)], want: &[(&str, &str)]) -> bool {
    have.len() == want.len()
        && want
            .iter()
            .all(|(k, v)| have.iter().any(|(hk, hv)| hk == k && hv == v))
}

/// Prometheus name rules: metric names may contain `:`, label names may not.
fn valid_name(name: &str, allow_colon: bool) -> bool {
    let ok = |c: char, first: bool| {
        c == '_'
            || c.is_ascii_alphabetic()
            || (allow_colon && c == ':')
            || (!first && c.is_ascii_digit())
    };
    let mut chars = name.chars();
    chars.next().is_some_and(|c| ok(c, true)) && chars.all(|c| ok(c, false))
}

/// A request head for tests, with a builder. Edits a filter makes are visible
/// afterwards through [`MockRequest::header`] and [`MockRequest::metadata`].
#[derive(Debug)]
pub struct MockRequest {
    head: RefCell<RequestHead>,
}

impl MockRequest {
    /// A request with `method` and target `/path?query`, scheme `http`, authority
    /// `example.com`, from `10.0.0.1:40000`.
    pub fn new(method: &str, target: &str) -> Self {
        let mut head = RequestHead::new(method, target);
        head.authority = "example.com".to_owned();
        head.source.addr = SocketAddr::from(([10, 0, 0, 1], 40000));
        Self {
            head: RefCell::new(head),
        }
    }

    /// A request with this head (to replay heads captured elsewhere).
    pub fn from_head(head: RequestHead) -> Self {
        Self {
            head: RefCell::new(head),
        }
    }

    /// A `GET` request.
    pub fn get(target: &str) -> Self {
        Self::new("GET", target)
    }

    /// A `POST` request.
    pub fn post(target: &str) -> Self {
        Self::new("POST", target)
    }

    /// Adds a header as the client sent it (any name, including proxy-owned ones).
    ///
    /// # Panics
    /// If the name or value is not valid HTTP: a test bug, not a filter bug.
    pub fn with_header(self, name: &str, value: &str) -> Self {
        self.head
            .borrow_mut()
            .append_received(name, value)
            .unwrap_or_else(|e| panic!("MockRequest::with_header({name:?}, {value:?}): {e}"));
        self
    }

    /// Sets the authority.
    pub fn with_authority(self, authority: &str) -> Self {
        self.head.borrow_mut().authority = authority.to_owned();
        self
    }

    /// Sets the scheme.
    pub fn with_scheme(self, scheme: &str) -> Self {
        self.head.borrow_mut().scheme = scheme.to_owned();
        self
    }

    /// Sets the source address (`ip:port`) and workload identity.
    ///
    /// # Panics
    /// If `addr` is not an `ip:port`.
    pub fn with_source(self, addr: &str, identity: Option<&str>) -> Self {
        {
            let mut head = self.head.borrow_mut();
            head.source.addr = addr.parse().expect("source address is ip:port");
            head.source.identity = identity.map(str::to_owned);
        }
        self
    }

    /// Sets the destination service.
    pub fn with_destination(self, service: &str) -> Self {
        self.head.borrow_mut().destination = Some(service.to_owned());
        self
    }

    /// Sets metadata as an earlier filter would have.
    pub fn with_metadata(self, key: &str, value: &str) -> Self {
        self.head.borrow_mut().set_metadata(key, value);
        self
    }

    /// The head as it is now.
    pub fn head(&self) -> Ref<'_, RequestHead> {
        self.head.borrow()
    }

    /// The first value of header `name` now (after the filter's edits).
    pub fn header(&self, name: &str) -> Option<String> {
        self.head.borrow().header(name)
    }

    /// Metadata now (after the filter ran).
    pub fn metadata(&self, key: &str) -> Option<String> {
        self.head.borrow().metadata(key).map(str::to_owned)
    }
}

impl HeadAccess for MockRequest {
    fn line(&self) -> RequestLine {
        RequestLine {
            method: HeadAccess::method(self),
            scheme: HeadAccess::scheme(self),
            authority: HeadAccess::authority(self),
            path: HeadAccess::path(self),
        }
    }

    // Each field on its own: a lazy request (the response phase) asks for them one at
    // a time, and the defaults would copy the whole line for each.
    fn method(&self) -> crate::Method {
        crate::Method::parse(&self.head.borrow().method)
    }

    fn scheme(&self) -> crate::Scheme {
        if self.head.borrow().scheme.eq_ignore_ascii_case("https") {
            crate::Scheme::Https
        } else {
            crate::Scheme::Http
        }
    }

    fn authority(&self) -> String {
        self.head.borrow().authority.clone()
    }

    fn path(&self) -> String {
        self.head.borrow().path.clone()
    }

    fn query(&self) -> Option<String> {
        self.head.borrow().query.clone()
    }

    fn header(&self, name: &str) -> Option<String> {
        self.head.borrow().header(name)
    }

    fn header_all(&self, name: &str) -> Vec<String> {
        self.head.borrow().header_all(name)
    }

    fn headers(&self, names: &[&str]) -> Vec<Option<String>> {
        let head = self.head.borrow();
        names.iter().map(|n| head.header(n)).collect()
    }

    fn header_names(&self) -> Vec<String> {
        self.head.borrow().header_names()
    }

    fn source(&self) -> Peer {
        let head = self.head.borrow();
        Peer {
            address: head.source.addr.ip().to_string(),
            port: head.source.addr.port(),
            identity: head.source.identity.clone(),
        }
    }

    fn destination(&self) -> Option<String> {
        self.head.borrow().destination.clone()
    }

    fn set_header(&self, name: &str, value: &str) -> Result<(), HeaderError> {
        self.head
            .borrow_mut()
            .set_header(name, value)
            .map_err(header_error)
    }

    fn append_header(&self, name: &str, value: &str) -> Result<(), HeaderError> {
        self.head
            .borrow_mut()
            .append_header(name, value)
            .map_err(header_error)
    }

    fn remove_header(&self, name: &str) -> Result<(), HeaderError> {
        self.head
            .borrow_mut()
            .remove_header(name)
            .map_err(header_error)
    }

    fn metadata(&self, key: &str) -> Option<String> {
        self.head.borrow().metadata(key).map(str::to_owned)
    }

    fn set_metadata(&self, key: &str, value: &str) {
        self.head.borrow_mut().set_metadata(key, value)
    }

    /// As the proxy does: the payload parsed once per distinct text, kept by the
    /// current mock proxy.
    fn claims(&self, names: &[&str]) -> Option<Vec<Option<crate::Claim>>> {
        let head = self.head.borrow();
        let payload = head.metadata(dpumesh_claims::PAYLOAD_KEY)?;
        let claims = MockProxy::current()
            .inner
            .claims
            .borrow_mut()
            .get(payload)?;
        Some(claims.claims(names))
    }
}

fn header_error(e: dpumesh_head::HeaderError) -> HeaderError {
    match e {
        dpumesh_head::HeaderError::InvalidName => HeaderError::InvalidName,
        dpumesh_head::HeaderError::InvalidValue => HeaderError::InvalidValue,
        dpumesh_head::HeaderError::ReadOnly => HeaderError::ReadOnly,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Counter;
    use crate::shared::{self, TokenBucket};

    #[test]
    fn each_thread_gets_a_fresh_host() {
        shared::increment("k", 1, 0).unwrap();
        let seen = std::thread::spawn(|| shared::get("k").unwrap())
            .join()
            .unwrap();
        assert_eq!(seen, None);
        assert_eq!(shared::get("k"), Ok(Some(1)));
    }

    #[test]
    fn clock_and_bucket_follow_the_mock_clock() {
        let host = MockProxy::new().install();
        assert_eq!(crate::clock::unix_secs(), DEFAULT_UNIX_SECS);
        let bucket = TokenBucket {
            capacity: 1,
            refill_tokens: 1,
            refill_interval_ms: 1000,
        };
        assert!(shared::token_bucket_take("b", bucket, 1).unwrap().allowed);
        assert!(!shared::token_bucket_take("b", bucket, 1).unwrap().allowed);
        host.advance_secs(1);
        assert!(shared::token_bucket_take("b", bucket, 1).unwrap().allowed);
        assert_eq!(crate::clock::unix_secs(), DEFAULT_UNIX_SECS + 1);
    }

    #[test]
    fn metrics_are_recorded_and_validated() {
        let host = MockProxy::new().install();
        let c = Counter::new("denied_total", &[("reason", "expired")]).unwrap();
        c.increment(2);
        Counter::new("denied_total", &[("reason", "expired")])
            .unwrap()
            .increment(1);
        assert_eq!(host.metric("denied_total", &[("reason", "expired")]), 3.0);
        assert_eq!(Counter::new("bad name", &[]), Err(MetricError::InvalidName));
        assert_eq!(
            Counter::new("ok", &[("filter", "x")]),
            Err(MetricError::InvalidLabel)
        );
    }

    #[test]
    fn logs_respect_the_level() {
        let host = MockProxy::new().with_log_level(Level::Warn).install();
        crate::log::info("quiet");
        crate::log!(Level::Error, "loud {}", 1);
        assert_eq!(host.logs(), vec![(Level::Error, "loud 1".to_owned())]);
    }

    #[test]
    fn crypto_uses_loaded_keys() {
        let _host = MockProxy::new()
            .with_secret("s", Some("k"), b"key")
            .install();
        assert_eq!(
            crate::crypto::verify(crate::crypto::Algorithm::Hs256, "s", None, b"m", b"bad"),
            Err(crate::crypto::VerifyError::InvalidSignature)
        );
        assert_eq!(
            crate::crypto::verify(crate::crypto::Algorithm::Rs256, "s", None, b"m", b"bad"),
            Err(crate::crypto::VerifyError::KeyAlgorithmMismatch)
        );
        assert_eq!(
            crate::crypto::verify(crate::crypto::Algorithm::Hs256, "x", None, b"m", b"bad"),
            Err(crate::crypto::VerifyError::UnknownKeySet)
        );
        assert!(crate::crypto::key_set_version("s") > 0);
    }

    #[test]
    fn mock_request_refuses_proxy_owned_edits_like_the_proxy() {
        let req = MockRequest::get("/x?a=1").with_header("Content-Length", "0");
        let request = Request::with_line(req.line(), &req);
        assert_eq!(
            request.set_header("content-length", "5"),
            Err(HeaderError::ReadOnly)
        );
        assert_eq!(request.query_param("a").as_deref(), Some("1"));
        assert_eq!(request.header("content-length").as_deref(), Some("0"));
    }
}

//! Metrics exported by the proxy. Define them once (in [`Filter::new`](crate::Filter::new))
//! and use the handle per request: a handle costs one host call, a definition several.

use std::fmt;

/// Why a metric could not be defined.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricError {
    /// Names must match `[a-zA-Z_:][a-zA-Z0-9_:]*`.
    InvalidName,
    /// Label names must match `[a-zA-Z_][a-zA-Z0-9_]*` and must not be `filter`.
    InvalidLabel,
    /// The instance defined too many metrics.
    TooMany,
}

impl fmt::Display for MetricError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::InvalidName => "invalid metric name",
            Self::InvalidLabel => "invalid label name",
            Self::TooMany => "too many metrics",
        })
    }
}

impl std::error::Error for MetricError {}

/// The kinds of metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// Monotonic counter.
    Counter,
    /// Gauge.
    Gauge,
    /// Histogram.
    Histogram,
}

fn define(kind: Kind, name: &str, labels: &[(&str, &str)]) -> Result<u32, MetricError> {
    #[cfg(target_arch = "wasm32")]
    {
        use crate::bindings::dpumesh::filter::metrics as wit;
        let labels: Vec<(String, String)> = labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        let result = match kind {
            Kind::Counter => wit::counter(name, &labels),
            Kind::Gauge => wit::gauge(name, &labels),
            Kind::Histogram => wit::histogram(name, &labels),
        };
        result.map_err(|e| match e {
            wit::MetricError::InvalidName => MetricError::InvalidName,
            wit::MetricError::InvalidLabel => MetricError::InvalidLabel,
            wit::MetricError::TooMany => MetricError::TooMany,
        })
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        crate::mock::MockHost::current().define_metric(kind, name, labels)
    }
}

/// A counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counter(u32);

impl Counter {
    /// Defines (or finds) counter `name` with `labels`.
    pub fn new(name: &str, labels: &[(&str, &str)]) -> Result<Self, MetricError> {
        define(Kind::Counter, name, labels).map(Self)
    }

    /// Adds `delta`. Inside a Wasm filter, increments are gathered during the call and
    /// handed to the proxy in one host call when it returns.
    pub fn increment(&self, delta: u64) {
        #[cfg(target_arch = "wasm32")]
        pending::add(self.0, delta);
        #[cfg(not(target_arch = "wasm32"))]
        crate::mock::MockHost::current().update_metric(self.0, Kind::Counter, |v| v + delta as f64);
    }
}

/// A gauge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gauge(u32);

impl Gauge {
    /// Defines (or finds) gauge `name` with `labels`.
    pub fn new(name: &str, labels: &[(&str, &str)]) -> Result<Self, MetricError> {
        define(Kind::Gauge, name, labels).map(Self)
    }

    /// Sets the gauge.
    pub fn set(&self, value: f64) {
        #[cfg(target_arch = "wasm32")]
        crate::bindings::dpumesh::filter::metrics::gauge_set(self.0, value);
        #[cfg(not(target_arch = "wasm32"))]
        crate::mock::MockHost::current().update_metric(self.0, Kind::Gauge, |_| value);
    }

    /// Adds `delta` (may be negative).
    pub fn add(&self, delta: f64) {
        #[cfg(target_arch = "wasm32")]
        crate::bindings::dpumesh::filter::metrics::gauge_add(self.0, delta);
        #[cfg(not(target_arch = "wasm32"))]
        crate::mock::MockHost::current().update_metric(self.0, Kind::Gauge, |v| v + delta);
    }
}

/// A histogram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Histogram(u32);

impl Histogram {
    /// Defines (or finds) histogram `name` with `labels`.
    pub fn new(name: &str, labels: &[(&str, &str)]) -> Result<Self, MetricError> {
        define(Kind::Histogram, name, labels).map(Self)
    }

    /// Records one observation (the mock host keeps the sum; count them with a counter
    /// if a test needs the count).
    pub fn observe(&self, value: f64) {
        #[cfg(target_arch = "wasm32")]
        crate::bindings::dpumesh::filter::metrics::observe(self.0, value);
        #[cfg(not(target_arch = "wasm32"))]
        crate::mock::MockHost::current().update_metric(self.0, Kind::Histogram, |v| v + value);
    }
}

/// Counter increments gathered during one export call: a host call per increment costs
/// more than the rest of a typical filter, so they are sent in one batch when the call
/// returns ([`flush`](pending::flush), called by the export glue).
#[cfg(target_arch = "wasm32")]
pub(crate) mod pending {
    use std::cell::RefCell;

    thread_local! {
        static PENDING: RefCell<Vec<(u32, u64)>> = const { RefCell::new(Vec::new()) };
    }

    pub(crate) fn add(id: u32, delta: u64) {
        PENDING.with_borrow_mut(|pending| match pending.iter_mut().find(|(i, _)| *i == id) {
            Some((_, sum)) => *sum = sum.saturating_add(delta),
            None => pending.push((id, delta)),
        });
    }

    /// Sends and clears the gathered increments.
    pub(crate) fn flush() {
        use crate::bindings::dpumesh::filter::metrics as wit;
        PENDING.with_borrow_mut(|pending| {
            match pending.as_slice() {
                [] => return,
                [(id, delta)] => wit::increment(*id, *delta),
                deltas => wit::increment_batch(deltas),
            }
            pending.clear();
        });
    }
}

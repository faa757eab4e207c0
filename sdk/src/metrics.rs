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
    crate::sys::define_metric(kind, name, labels)
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
        crate::sys::counter_add(self.0, delta);
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
        crate::sys::gauge_set(self.0, value);
    }

    /// Adds `delta` (may be negative).
    pub fn add(&self, delta: f64) {
        crate::sys::gauge_add(self.0, delta);
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

    /// Records one observation (the mock proxy keeps the sum; count them with a counter
    /// if a test needs the count).
    pub fn observe(&self, value: f64) {
        crate::sys::observe(self.0, value);
    }
}

//! Configuration of the breaker, parsed then checked.

use serde::Deserialize;

/// Failure rate over a sliding window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FailureRate {
    /// Trip when at least this percentage of requests failed (1-100).
    pub threshold_percent: u8,
    /// ... and at least this many requests were seen in the window.
    pub minimum_requests: u32,
    /// The window, in milliseconds.
    pub window_ms: u64,
}

/// The breaker's configuration. Every field has a default.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Eject after this many upstream failures in a row (5xx, connect failure, reset,
    /// timeout); 0 disables. Envoy `consecutive_5xx`.
    pub consecutive_failures: u32,
    /// Eject after this many gateway failures in a row (502, 503, 504, connect
    /// failure, reset, timeout); 0 disables. Envoy `consecutive_gateway_failure`.
    pub consecutive_gateway_failures: u32,
    /// Eject when the failure rate over the window is too high.
    pub failure_rate: Option<FailureRate>,
    /// First ejection lasts this long; the n-th lasts n times as long.
    pub base_ejection_ms: u64,
    /// Longest ejection.
    pub max_ejection_ms: u64,
    /// Requests let through at once when an ejection ends (half-open).
    pub half_open_probes: u32,
    /// A probe whose response never arrives frees its slot after this long.
    pub probe_timeout_ms: u64,
    /// Most requests in flight per service; 0 = no limit.
    pub max_concurrent: u32,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            consecutive_failures: 5,
            consecutive_gateway_failures: 0,
            failure_rate: None,
            base_ejection_ms: 30_000,
            max_ejection_ms: 300_000,
            half_open_probes: 1,
            probe_timeout_ms: 30_000,
            max_concurrent: 0,
        }
    }
}

impl Config {
    /// Checks the invariants the breaker relies on.
    pub fn check(self) -> Result<Self, String> {
        if self.base_ejection_ms == 0 {
            return Err("base_ejection_ms must be at least 1".to_owned());
        }
        if self.max_ejection_ms < self.base_ejection_ms {
            return Err("max_ejection_ms must be at least base_ejection_ms".to_owned());
        }
        if self.half_open_probes == 0 {
            return Err("half_open_probes must be at least 1".to_owned());
        }
        if self.probe_timeout_ms == 0 {
            return Err("probe_timeout_ms must be at least 1".to_owned());
        }
        if let Some(rate) = self.failure_rate {
            if !(1..=100).contains(&rate.threshold_percent) {
                return Err("failure_rate.threshold_percent must be 1-100".to_owned());
            }
            if rate.window_ms == 0 || rate.minimum_requests == 0 {
                return Err(
                    "failure_rate.window_ms and minimum_requests must be at least 1".to_owned(),
                );
            }
        }
        if self.consecutive_failures == 0
            && self.consecutive_gateway_failures == 0
            && self.failure_rate.is_none()
            && self.max_concurrent == 0
        {
            return Err("nothing to do: set consecutive_failures, consecutive_gateway_failures, failure_rate or max_concurrent".to_owned());
        }
        Ok(self)
    }
}

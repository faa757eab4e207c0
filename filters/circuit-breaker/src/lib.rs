//! `circuit-breaker`: per-service ejection when an upstream keeps failing.
//!
//! State is node-wide (shared state), keyed by destination service (the authority
//! when the router has not chosen one), so every worker sees the same breaker:
//!
//! - **closed**: requests pass; `on-response` counts upstream failures only — 5xx,
//!   connect failures, resets, timeouts — never local replies from other filters.
//!   Too many consecutive failures (or gateway failures), or a failure rate over the
//!   sliding window at or above the threshold with enough requests, ejects the service.
//! - **open** for `base × n` (n-th ejection, capped at `max`): requests get 503 with
//!   `x-dpumesh-circuit: open` and `retry-after`.
//! - **half-open** when the ejection ends: up to `half_open_probes` requests pass; a
//!   successful probe closes the breaker, a failed one ejects again for longer.
//! - `max_concurrent` caps requests in flight per service (503,
//!   `x-dpumesh-circuit: max-concurrent`).
//!
//! Where we differ from Envoy: Envoy ejects individual hosts (outlier detection) and
//! caps connections/requests per cluster (circuit breakers); this filter works per
//! destination service at the head level, and the proxy's load balancer (a later
//! issue) is where per-endpoint ejection belongs. The sliding window is two fixed
//! windows weighted by overlap, the usual approximation.

#![forbid(unsafe_code)]

pub mod config;

use dpumesh_filter_sdk::metrics::Counter;
use dpumesh_filter_sdk::shared::{self, StateError};
use dpumesh_filter_sdk::{
    FailureKind, Filter, LocalReply, Request, ResponseInfo, Verdict, export_filter, log,
};

use crate::config::Config;

/// The filter.
#[derive(Debug)]
pub struct CircuitBreaker {
    config: Config,
    ejections: Counter,
    rejected_open: Counter,
    rejected_half_open: Counter,
    rejected_concurrency: Counter,
}

/// Monotonic ms for `req`: when its chain started if the call brought it.
fn now_ms(req: &Request<'_>) -> i64 {
    (req.monotonic_ns() / 1_000_000) as i64
}

fn service(req: &Request<'_>) -> String {
    req.destination()
        .unwrap_or_else(|| req.authority().to_owned())
}

fn key(service: &str, what: &str) -> String {
    let mut key = String::with_capacity(service.len() + what.len() + 1);
    key.push_str(&service[..service.len().min(200)]);
    key.push('|');
    key.push_str(what);
    key
}

/// The metadata the DPU proxy sets for a 5xx answer that blames the service's own
/// dependency (`dpumesh_head::DEPENDENCY_FAILED_METADATA`).
const DEPENDENCY_FAILED: &str = "dpumesh.dependency-failed";

/// Whether the upstream failed (what the breaker counts).
fn upstream_failure(info: &ResponseInfo) -> bool {
    info.is_upstream_failure()
}

/// Whether it was a gateway failure (502/503/504 or no usable connection).
fn gateway_failure(info: &ResponseInfo) -> bool {
    match info.failure {
        FailureKind::None => matches!(info.status, 502..=504),
        FailureKind::ConnectFailure | FailureKind::UpstreamReset | FailureKind::Timeout => true,
        FailureKind::LocalReply | FailureKind::Internal => false,
    }
}

fn warn_state(e: StateError) {
    log::warn(&format!("circuit breaker state unavailable: {e}"));
}

impl CircuitBreaker {
    fn reject(
        &self,
        counter: &Counter,
        state: &str,
        service: &str,
        retry_after_ms: Option<i64>,
    ) -> Verdict {
        counter.increment(1);
        let mut reply = LocalReply::new(503)
            .header("content-type", "text/plain")
            .header("x-dpumesh-circuit", state)
            .body(format!("upstream {service} unavailable: circuit {state}\n"));
        if let Some(ms) = retry_after_ms {
            reply = reply.header("retry-after", (ms.max(1) as u64).div_ceil(1000).to_string());
        }
        reply.into()
    }

    /// Opens the breaker for `service` unless another worker already did.
    fn eject(&self, service: &str, now: i64, seen_open_until: Option<i64>) {
        let count = match shared::increment(&key(service, "ejections"), 1, self.decay_ms()) {
            Ok(n) => n.max(1) as u64,
            Err(e) => return warn_state(e),
        };
        let duration =
            (self.config.base_ejection_ms.saturating_mul(count)).min(self.config.max_ejection_ms);
        let until = now + duration as i64;
        match shared::compare_and_swap(&key(service, "open_until"), seen_open_until, until, 0) {
            Ok(Ok(())) => {
                self.ejections.increment(1);
                log::warn(&format!(
                    "circuit open for {service} for {duration} ms (ejection {count})"
                ));
                for what in ["consecutive", "consecutive_gw", "probes"] {
                    let _ = shared::delete(&key(service, what));
                }
            }
            // Another worker ejected first: undo our count.
            Ok(Err(_)) => {
                let _ = shared::increment(&key(service, "ejections"), -1, self.decay_ms());
            }
            Err(e) => warn_state(e),
        }
    }

    /// Ejection counts are forgotten after a long healthy spell.
    fn decay_ms(&self) -> u64 {
        self.config.max_ejection_ms.saturating_mul(10)
    }

    fn window_keys(
        &self,
        service: &str,
        now: i64,
        window: u64,
    ) -> (String, String, String, String, f64) {
        let index = now as u64 / window;
        let elapsed = (now as u64 % window) as f64 / window as f64;
        (
            key(service, &format!("w{index}|t")),
            key(service, &format!("w{index}|f")),
            key(service, &format!("w{}|t", index.wrapping_sub(1))),
            key(service, &format!("w{}|f", index.wrapping_sub(1))),
            1.0 - elapsed,
        )
    }

    /// Records one outcome in the sliding window; returns whether the rate trips.
    fn record_rate(&self, service: &str, now: i64, failed: bool) -> bool {
        let Some(rate) = self.config.failure_rate else {
            return false;
        };
        let (total_now, failed_now, total_prev, failed_prev, weight) =
            self.window_keys(service, now, rate.window_ms);
        let ttl = rate.window_ms.saturating_mul(2);
        let total = shared::increment(&total_now, 1, ttl).unwrap_or(0) as f64;
        let failures = if failed {
            shared::increment(&failed_now, 1, ttl).unwrap_or(0)
        } else {
            shared::get(&failed_now).ok().flatten().unwrap_or(0)
        } as f64;
        let prev_total = shared::get(&total_prev).ok().flatten().unwrap_or(0) as f64;
        let prev_failures = shared::get(&failed_prev).ok().flatten().unwrap_or(0) as f64;
        let total = total + prev_total * weight;
        let failures = failures + prev_failures * weight;
        total >= f64::from(rate.minimum_requests)
            && failures * 100.0 >= f64::from(rate.threshold_percent) * total
    }

    fn clear_window(&self, service: &str, now: i64) {
        if let Some(rate) = self.config.failure_rate {
            let (a, b, c, d, _) = self.window_keys(service, now, rate.window_ms);
            for k in [a, b, c, d] {
                let _ = shared::delete(&k);
            }
        }
    }
}

impl Filter for CircuitBreaker {
    type Config = Config;

    fn new(config: Config) -> Result<Self, String> {
        let config = config.check()?;
        let counter = |name: &str, labels: &[(&str, &str)]| {
            Counter::new(name, labels).map_err(|e| e.to_string())
        };
        Ok(Self {
            ejections: counter("circuit_ejections_total", &[])?,
            rejected_open: counter("circuit_rejected_total", &[("state", "open")])?,
            rejected_half_open: counter("circuit_rejected_total", &[("state", "half_open")])?,
            rejected_concurrency: counter(
                "circuit_rejected_total",
                &[("state", "max_concurrent")],
            )?,
            config,
        })
    }

    fn on_request(&mut self, req: &Request<'_>) -> Verdict {
        let service = service(req);
        let now = now_ms(req);
        let open_until = match shared::get(&key(&service, "open_until")) {
            Ok(v) => v,
            Err(e) => {
                warn_state(e);
                None
            }
        };
        if let Some(until) = open_until {
            if now < until {
                return self.reject(&self.rejected_open, "open", &service, Some(until - now));
            }
            // Ejection over: half-open, a few probes at a time.
            let probes_key = key(&service, "probes");
            match shared::increment(&probes_key, 1, self.config.probe_timeout_ms) {
                Ok(n) if n > i64::from(self.config.half_open_probes) => {
                    let _ = shared::increment(&probes_key, -1, self.config.probe_timeout_ms);
                    return self.reject(&self.rejected_half_open, "half-open", &service, None);
                }
                Ok(_) => req.set_metadata("circuit.probe", "1"),
                Err(e) => warn_state(e),
            }
        }
        if self.config.max_concurrent > 0 {
            let inflight = key(&service, "inflight");
            match shared::increment(&inflight, 1, 0) {
                Ok(n) if n > i64::from(self.config.max_concurrent) => {
                    let _ = shared::increment(&inflight, -1, 0);
                    if req.metadata("circuit.probe").is_some() {
                        let _ = shared::increment(
                            &key(&service, "probes"),
                            -1,
                            self.config.probe_timeout_ms,
                        );
                    }
                    return self.reject(
                        &self.rejected_concurrency,
                        "max-concurrent",
                        &service,
                        None,
                    );
                }
                Ok(_) => req.set_metadata("circuit.inflight", "1"),
                Err(e) => warn_state(e),
            }
        }
        req.set_metadata("circuit.service", &service);
        Verdict::Continue
    }

    fn on_response(&mut self, req: &Request<'_>, info: &ResponseInfo) {
        // Only requests this filter let through carry the service.
        let Some(service) = req.metadata("circuit.service") else {
            return;
        };
        let now = now_ms(req);
        if req.metadata("circuit.inflight").is_some() {
            let _ = shared::increment(&key(&service, "inflight"), -1, 0);
        }
        let probe = req.metadata("circuit.probe").is_some();
        // The proxy sets this when the service answered 5xx only because a service it
        // called failed (the host library says so on the answer).
        let dependency_failed = req.metadata(DEPENDENCY_FAILED).is_some();
        if info.failure == FailureKind::LocalReply
            || info.failure == FailureKind::Internal
            || dependency_failed
        {
            // A later filter denied it, the proxy failed, or the service's dependency
            // did: says nothing about this upstream. Free the probe slot for another
            // try.
            if probe {
                let _ =
                    shared::increment(&key(&service, "probes"), -1, self.config.probe_timeout_ms);
            }
            return;
        }
        let failed = upstream_failure(info);
        let open_until = shared::get(&key(&service, "open_until")).ok().flatten();
        if probe {
            if failed {
                self.eject(&service, now, open_until);
            } else if let Some(until) = open_until {
                // Close, unless someone else already re-ejected.
                if shared::compare_and_swap(&key(&service, "open_until"), Some(until), 0, 1)
                    .is_ok_and(|r| r.is_ok())
                {
                    let _ = shared::delete(&key(&service, "open_until"));
                    let _ = shared::delete(&key(&service, "probes"));
                    log::info(&format!("circuit closed for {service}"));
                }
            }
            return;
        }
        if open_until.is_some_and(|until| now < until) {
            return;
        }
        let mut trip = false;
        if failed {
            if self.config.consecutive_failures > 0 {
                let n = shared::increment(&key(&service, "consecutive"), 1, 0).unwrap_or(0);
                trip |= n >= i64::from(self.config.consecutive_failures);
            }
        } else {
            let _ = shared::delete(&key(&service, "consecutive"));
        }
        if self.config.consecutive_gateway_failures > 0 {
            if gateway_failure(info) {
                let n = shared::increment(&key(&service, "consecutive_gw"), 1, 0).unwrap_or(0);
                trip |= n >= i64::from(self.config.consecutive_gateway_failures);
            } else {
                let _ = shared::delete(&key(&service, "consecutive_gw"));
            }
        }
        trip |= self.record_rate(&service, now, failed);
        if trip {
            self.clear_window(&service, now);
            self.eject(&service, now, open_until);
        }
    }
}

export_filter!(CircuitBreaker);

#[cfg(test)]
mod tests {
    use dpumesh_filter_sdk::mock::{MockProxy, MockRequest};

    use super::*;

    fn respond(
        host: &MockProxy,
        f: &mut CircuitBreaker,
        status: u16,
        failure: FailureKind,
    ) -> Verdict {
        let req = MockRequest::get("/").with_destination("svc");
        let verdict = host.on_request(f, &req);
        if verdict.is_continue() {
            let info = ResponseInfo {
                status,
                latency_ns: 1,
                upstream: None,
                failure,
            };
            host.on_response(f, &req, &info);
        }
        verdict
    }

    #[test]
    fn trips_after_consecutive_failures_and_recovers_through_a_probe() {
        let host = MockProxy::new().install();
        let mut f: CircuitBreaker = host
            .configure(r#"{"consecutive_failures": 2, "base_ejection_ms": 1000}"#)
            .unwrap();
        assert!(respond(&host, &mut f, 500, FailureKind::None).is_continue());
        assert!(respond(&host, &mut f, 500, FailureKind::None).is_continue());
        let denied = respond(&host, &mut f, 200, FailureKind::None);
        let reply = denied.reply().expect("open");
        assert_eq!(reply.header_value("x-dpumesh-circuit"), Some("open"));
        host.advance_ms(1000);
        assert!(respond(&host, &mut f, 200, FailureKind::None).is_continue());
        assert!(respond(&host, &mut f, 200, FailureKind::None).is_continue());
        assert_eq!(host.metric("circuit_ejections_total", &[]), 1.0);
    }

    #[test]
    fn local_replies_are_never_counted() {
        let host = MockProxy::new().install();
        let mut f: CircuitBreaker = host.configure(r#"{"consecutive_failures": 1}"#).unwrap();
        for _ in 0..5 {
            assert!(respond(&host, &mut f, 503, FailureKind::LocalReply).is_continue());
        }
    }

    #[test]
    fn answers_that_blame_a_dependency_are_not_counted() {
        let host = MockProxy::new().install();
        let mut f: CircuitBreaker = host.configure(r#"{"consecutive_failures": 1}"#).unwrap();
        for _ in 0..5 {
            let req = MockRequest::get("/").with_destination("svc");
            assert!(host.on_request(&mut f, &req).is_continue());
            // What the proxy adds when the service's 502 says a service it called failed.
            let req = req.with_metadata(DEPENDENCY_FAILED, "1");
            let info = ResponseInfo {
                status: 502,
                latency_ns: 1,
                upstream: None,
                failure: FailureKind::None,
            };
            host.on_response(&mut f, &req, &info);
        }
        // Its own 502 still counts.
        assert!(respond(&host, &mut f, 502, FailureKind::None).is_continue());
        assert!(
            respond(&host, &mut f, 200, FailureKind::None)
                .reply()
                .is_some(),
            "open"
        );
    }

    #[test]
    fn configs_are_checked() {
        let host = MockProxy::new().install();
        for (config, needle) in [
            (r#"{"base_ejection_ms": 0}"#, "base_ejection_ms"),
            (
                r#"{"base_ejection_ms": 10, "max_ejection_ms": 5}"#,
                "max_ejection_ms",
            ),
            (r#"{"consecutive_failures": 0}"#, "nothing to do"),
            (
                r#"{"failure_rate": {"threshold_percent": 0, "minimum_requests": 1, "window_ms": 1}}"#,
                "threshold_percent",
            ),
        ] {
            let err = host.configure::<CircuitBreaker>(config).unwrap_err();
            assert!(err.contains(needle), "{config}: {err}");
        }
    }
}

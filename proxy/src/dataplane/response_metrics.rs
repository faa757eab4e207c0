//! The handles of the per-response metrics, kept by the shard.
//!
//! `metrics::counter!` with labels looks the metric up in the recorder's registry on
//! every use: the labels allocated (the service name cloned, the status formatted),
//! hashed, and a sharded map searched. On a request path that is otherwise a few
//! microseconds, that lookup per response showed in the shard's profile; the shard
//! looks each (service, status) up once and keeps the handles. Services come from the
//! node's routes (or a trusted peer node's) and statuses are 100–599; past
//! [`MAX_SERVICES`] names the shard records without keeping, so what it keeps stays
//! bounded whatever a peer sends.

use std::collections::HashMap;

/// Most services whose handles one shard keeps.
const MAX_SERVICES: usize = 4096;

/// `dpumesh_mesh_responses_total{service,status}`,
/// `dpumesh_mesh_request_duration_seconds{service}` and, for gRPC calls,
/// `dpumesh_mesh_grpc_responses_total{service,grpc_status}`, by service.
#[derive(Default)]
pub(super) struct ResponseMetrics {
    services: HashMap<String, ServiceMetrics, foldhash::fast::RandomState>,
}

struct ServiceMetrics {
    duration: metrics::Histogram,
    /// Few statuses per service in practice: a short list beats a map.
    responses: Vec<(u16, metrics::Counter)>,
    /// gRPC calls' answers by gRPC status (0–16), looked up when first seen.
    grpc: Vec<(u32, metrics::Counter)>,
}

impl ResponseMetrics {
    /// Counts one response of `service` with `status` that took `seconds`.
    pub(super) fn record(&mut self, service: &str, status: u16, seconds: f64) {
        let full = self.services.len() >= MAX_SERVICES;
        let metrics = match self.services.get_mut(service) {
            Some(m) => m,
            None if full => {
                duration_of(service).record(seconds);
                responses_of(service, status).increment(1);
                return;
            }
            None => self
                .services
                .entry(service.to_owned())
                .or_insert_with(|| ServiceMetrics {
                    duration: duration_of(service),
                    responses: Vec::new(),
                    grpc: Vec::new(),
                }),
        };
        metrics.duration.record(seconds);
        match metrics.responses.iter().find(|(s, _)| *s == status) {
            Some((_, counter)) => counter.increment(1),
            None => {
                let counter = responses_of(service, status);
                counter.increment(1);
                metrics.responses.push((status, counter));
            }
        }
    }
}

impl ResponseMetrics {
    /// Counts one answer to a gRPC call of `service` with gRPC status `code` (its
    /// HTTP status and duration are counted by [`ResponseMetrics::record`]).
    pub(super) fn record_grpc(&mut self, service: &str, code: u32) {
        let Some(metrics) = self.services.get_mut(service) else {
            // Not kept (past the cap, or not recorded yet): counted without keeping.
            grpc_responses_of(service, code).increment(1);
            return;
        };
        match metrics.grpc.iter().find(|(c, _)| *c == code) {
            Some((_, counter)) => counter.increment(1),
            None => {
                let counter = grpc_responses_of(service, code);
                counter.increment(1);
                metrics.grpc.push((code, counter));
            }
        }
    }
}

fn grpc_responses_of(service: &str, code: u32) -> metrics::Counter {
    metrics::counter!(
        "dpumesh_mesh_grpc_responses_total",
        "service" => service.to_owned(),
        "grpc_status" => code.to_string(),
    )
}

/// The registry lookups the kept handles save.
fn duration_of(service: &str) -> metrics::Histogram {
    metrics::histogram!("dpumesh_mesh_request_duration_seconds", "service" => service.to_owned())
}

fn responses_of(service: &str, status: u16) -> metrics::Counter {
    metrics::counter!(
        "dpumesh_mesh_responses_total",
        "service" => service.to_owned(),
        "status" => status.to_string(),
    )
}

#[cfg(test)]
mod tests {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    use super::*;

    #[test]
    fn responses_are_counted_by_service_and_status_with_handles_kept() {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        metrics::with_local_recorder(&recorder, || {
            let mut m = ResponseMetrics::default();
            m.record("frontend", 200, 0.001);
            m.record("frontend", 200, 0.002);
            m.record("frontend", 503, 0.003);
            m.record("user", 200, 0.004);
            m.record_grpc("frontend", 14);
            m.record_grpc("frontend", 14);
            m.record_grpc("nobody", 0);
            assert_eq!(m.services.len(), 2);
            assert_eq!(m.services["frontend"].grpc.len(), 1);
            assert_eq!(m.services["frontend"].responses.len(), 2);
            // Past the cap, responses are still counted, their handles not kept.
            for i in 0..MAX_SERVICES {
                m.record(&format!("s{i}"), 200, 0.0);
            }
            m.record("s-late", 200, 0.0);
            m.record("s-late", 200, 0.0);
            assert_eq!(m.services.len(), MAX_SERVICES);
            assert!(!m.services.contains_key("s-late"));
        });
        let mut counts = Vec::new();
        let mut durations = Vec::new();
        for (key, _, _, value) in snapshotter.snapshot().into_vec() {
            let labels: Vec<String> = key
                .key()
                .labels()
                .map(|l| format!("{}={}", l.key(), l.value()))
                .collect();
            match value {
                DebugValue::Counter(n) => counts.push((labels.join(","), n)),
                DebugValue::Histogram(v) => durations.push((labels.join(","), v.len())),
                DebugValue::Gauge(_) => {}
            }
        }
        // The service past the cap: both its responses counted and timed.
        assert!(counts.contains(&("service=s-late,status=200".to_owned(), 2)));
        assert!(durations.contains(&("service=s-late".to_owned(), 2)));
        // The rest (the services that filled the cap aside).
        counts.retain(|(labels, _)| !labels.starts_with("service=s"));
        durations.retain(|(labels, _)| !labels.starts_with("service=s"));
        counts.sort();
        durations.sort();
        assert_eq!(
            counts,
            [
                ("service=frontend,grpc_status=14".to_owned(), 2),
                ("service=frontend,status=200".to_owned(), 2),
                ("service=frontend,status=503".to_owned(), 1),
                ("service=nobody,grpc_status=0".to_owned(), 1),
                ("service=user,status=200".to_owned(), 1),
            ]
        );
        assert_eq!(
            durations,
            [
                ("service=frontend".to_owned(), 3),
                ("service=user".to_owned(), 1)
            ]
        );
    }
}

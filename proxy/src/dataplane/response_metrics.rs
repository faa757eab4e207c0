//! The handles of the per-response metrics, kept by the shard.
//!
//! `metrics::counter!` with labels looks the metric up in the recorder's registry on
//! every use: the labels allocated (the service name cloned, the status formatted),
//! hashed, and a sharded map searched. On a request path that is otherwise a few
//! microseconds, that lookup per response showed in the shard's profile; the shard
//! looks each (service, status) up once and keeps the handles. Services come from the
//! node's configuration and statuses are 100–599, so what it keeps is bounded.

use std::collections::HashMap;

/// `dpumesh_mesh_responses_total{service,status}` and
/// `dpumesh_mesh_request_duration_seconds{service}`, by service.
#[derive(Default)]
pub(super) struct ResponseMetrics {
    services: HashMap<String, ServiceMetrics, foldhash::fast::RandomState>,
}

struct ServiceMetrics {
    duration: metrics::Histogram,
    /// Few statuses per service in practice: a short list beats a map.
    responses: Vec<(u16, metrics::Counter)>,
}

impl ResponseMetrics {
    /// Counts one response of `service` with `status` that took `seconds`.
    pub(super) fn record(&mut self, service: &str, status: u16, seconds: f64) {
        let metrics = match self.services.get_mut(service) {
            Some(m) => m,
            None => self
                .services
                .entry(service.to_owned())
                .or_insert_with(|| ServiceMetrics {
                    duration: metrics::histogram!(
                        "dpumesh_mesh_request_duration_seconds",
                        "service" => service.to_owned()
                    ),
                    responses: Vec::new(),
                }),
        };
        metrics.duration.record(seconds);
        match metrics.responses.iter().find(|(s, _)| *s == status) {
            Some((_, counter)) => counter.increment(1),
            None => {
                let counter = metrics::counter!(
                    "dpumesh_mesh_responses_total",
                    "service" => service.to_owned(),
                    "status" => status.to_string(),
                );
                counter.increment(1);
                metrics.responses.push((status, counter));
            }
        }
    }
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
            assert_eq!(m.services.len(), 2);
            assert_eq!(m.services["frontend"].responses.len(), 2);
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
        counts.sort();
        durations.sort();
        assert_eq!(
            counts,
            [
                ("service=frontend,status=200".to_owned(), 2),
                ("service=frontend,status=503".to_owned(), 1),
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

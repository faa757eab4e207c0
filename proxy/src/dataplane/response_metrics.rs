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
use std::sync::Arc;

use crate::observe::record::status_class;

/// Most services whose handles one shard keeps.
const MAX_SERVICES: usize = 4096;

/// Most (source, route) edges into one service whose handles one shard keeps.
const MAX_EDGES: usize = 256;

/// The golden metrics' label budget, node-wide: distinct sources and routes beyond
/// these are labelled [`OVERFLOW`], so a caller that invents identities (client
/// certificates' principals) or a policy with a huge route table cannot grow the
/// metrics without bound.
#[derive(Debug, Default)]
pub struct LabelBudget {
    sources: parking_lot::Mutex<std::collections::HashSet<String>>,
    routes: parking_lot::Mutex<std::collections::HashSet<String>>,
}

/// The label of what is past the budget.
pub const OVERFLOW: &str = "overflow";
/// Distinct sources the golden metrics name.
pub const MAX_SOURCES: usize = 256;
/// Distinct routes the golden metrics name.
pub const MAX_ROUTES: usize = 1024;

impl LabelBudget {
    fn admit(
        set: &parking_lot::Mutex<std::collections::HashSet<String>>,
        cap: usize,
        label: &str,
    ) -> String {
        let mut set = set.lock();
        if set.contains(label) {
            return label.to_owned();
        }
        if set.len() >= cap {
            return OVERFLOW.to_owned();
        }
        set.insert(label.to_owned());
        label.to_owned()
    }

    /// `source` as the metrics name it (itself, or [`OVERFLOW`]).
    pub fn source(&self, source: &str) -> String {
        Self::admit(&self.sources, MAX_SOURCES, source)
    }

    /// `route` as the metrics name it.
    pub fn route(&self, route: &str) -> String {
        Self::admit(&self.routes, MAX_ROUTES, route)
    }
}

/// One edge's golden metrics: `dpumesh_requests_total{source,destination,route,class}`
/// and `dpumesh_request_latency_seconds{source,destination,route}`.
struct Edge {
    /// As the request named them (the labels may say [`OVERFLOW`]).
    source: Box<str>,
    route: Arc<str>,
    latency: metrics::Histogram,
    /// By status class, 1xx..5xx and other.
    classes: [Option<metrics::Counter>; 6],
    labels: [String; 3],
}

impl Edge {
    /// The edge `source` → `route`, labelled `labels` (source, destination, route).
    fn new(source: &str, route: &Arc<str>, labels: [String; 3]) -> Self {
        Self {
            source: source.into(),
            route: route.clone(),
            latency: metrics::histogram!(
                "dpumesh_request_latency_seconds",
                "source" => labels[0].clone(),
                "destination" => labels[1].clone(),
                "route" => labels[2].clone(),
            ),
            classes: Default::default(),
            labels,
        }
    }

    fn record(&mut self, status: u16, seconds: f64) {
        self.latency.record(seconds);
        let class = status_class(status);
        let i = match status / 100 {
            c @ 1..=5 => c as usize - 1,
            _ => 5,
        };
        let labels = &self.labels;
        self.classes[i]
            .get_or_insert_with(|| {
                metrics::counter!(
                    "dpumesh_requests_total",
                    "source" => labels[0].clone(),
                    "destination" => labels[1].clone(),
                    "route" => labels[2].clone(),
                    "class" => class,
                )
            })
            .increment(1);
    }
}

/// `dpumesh_mesh_responses_total{service,status}` and, for gRPC calls,
/// `dpumesh_mesh_grpc_responses_total{service,grpc_status}`, by service, and the
/// golden metrics by edge. A service's latency is its edges' (one histogram sample a
/// response: a second one per service cost the node 5 % of its requests a second in
/// `bench/mesh.sh`).
#[derive(Default)]
pub(super) struct ResponseMetrics {
    services: HashMap<String, ServiceMetrics, foldhash::fast::RandomState>,
    /// The node's label budget (shared by its shards).
    budget: Arc<LabelBudget>,
    /// Edges past [`MAX_EDGES`] of a service, or of services past the cap, by
    /// destination: one overflow edge each.
    overflow: HashMap<String, Edge, foldhash::fast::RandomState>,
}

struct ServiceMetrics {
    /// Few statuses per service in practice: a short list beats a map.
    responses: Vec<(u16, metrics::Counter)>,
    /// gRPC calls' answers by gRPC status (0–16), looked up when first seen.
    grpc: Vec<(u32, metrics::Counter)>,
    /// Golden metrics by (source, route): few per service in practice.
    edges: Vec<Edge>,
}

impl ResponseMetrics {
    /// Counts one response of `service` with `status`.
    pub(super) fn record(&mut self, service: &str, status: u16) {
        let full = self.services.len() >= MAX_SERVICES;
        let metrics = match self.services.get_mut(service) {
            Some(m) => m,
            None if full => {
                responses_of(service, status).increment(1);
                return;
            }
            None => self
                .services
                .entry(service.to_owned())
                .or_insert_with(|| ServiceMetrics {
                    responses: Vec::new(),
                    grpc: Vec::new(),
                    edges: Vec::new(),
                }),
        };
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
    /// Metrics whose label budget is `budget` (the node's).
    pub(super) fn with_budget(budget: Arc<LabelBudget>) -> Self {
        Self {
            budget,
            ..Self::default()
        }
    }

    /// Counts one exchange of `source` to `service` over `route` in the golden
    /// metrics (after [`ResponseMetrics::record`] counted its response).
    pub(super) fn record_edge(
        &mut self,
        source: &str,
        service: &str,
        route: &Arc<str>,
        status: u16,
        seconds: f64,
    ) {
        let budget = &self.budget;
        if let Some(metrics) = self.services.get_mut(service) {
            if let Some(edge) = metrics.edges.iter_mut().find(|e| {
                &*e.source == source && (Arc::ptr_eq(&e.route, route) || e.route == *route)
            }) {
                edge.record(status, seconds);
                return;
            }
            if metrics.edges.len() < MAX_EDGES {
                let labels = [
                    budget.source(source),
                    service.to_owned(),
                    budget.route(route),
                ];
                let mut edge = Edge::new(source, route, labels);
                edge.record(status, seconds);
                metrics.edges.push(edge);
                return;
            }
        }
        // Past the caps: one edge per destination, its source and route overflowed.
        let edge = match self.overflow.get_mut(service) {
            Some(edge) => edge,
            None => {
                let over: Arc<str> = Arc::from(OVERFLOW);
                let labels = [OVERFLOW.to_owned(), service.to_owned(), OVERFLOW.to_owned()];
                let mut edge = Edge::new(OVERFLOW, &over, labels);
                if self.overflow.len() >= MAX_SERVICES {
                    // Even the overflow is bounded: counted, not kept.
                    edge.record(status, seconds);
                    return;
                }
                self.overflow.entry(service.to_owned()).or_insert(edge)
            }
        };
        edge.record(status, seconds);
    }

    /// Counts one answer to a gRPC call of `service` with gRPC status `code` (its
    /// HTTP status is counted by [`ResponseMetrics::record`]).
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

/// The registry lookup the kept handles save.
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
            m.record("frontend", 200);
            m.record("frontend", 200);
            m.record("frontend", 503);
            m.record("user", 200);
            m.record_grpc("frontend", 14);
            m.record_grpc("frontend", 14);
            m.record_grpc("nobody", 0);
            assert_eq!(m.services.len(), 2);
            assert_eq!(m.services["frontend"].grpc.len(), 1);
            assert_eq!(m.services["frontend"].responses.len(), 2);
            // Past the cap, responses are still counted, their handles not kept.
            for i in 0..MAX_SERVICES {
                m.record(&format!("s{i}"), 200);
            }
            m.record("s-late", 200);
            m.record("s-late", 200);
            assert_eq!(m.services.len(), MAX_SERVICES);
            assert!(!m.services.contains_key("s-late"));
        });
        let mut counts = Vec::new();
        for (key, _, _, value) in snapshotter.snapshot().into_vec() {
            let labels: Vec<String> = key
                .key()
                .labels()
                .map(|l| format!("{}={}", l.key(), l.value()))
                .collect();
            match value {
                DebugValue::Counter(n) => counts.push((labels.join(","), n)),
                DebugValue::Histogram(_) | DebugValue::Gauge(_) => {}
            }
        }
        // The service past the cap: both its responses counted.
        assert!(counts.contains(&("service=s-late,status=200".to_owned(), 2)));
        // The rest (the services that filled the cap aside).
        counts.retain(|(labels, _)| !labels.starts_with("service=s"));
        counts.sort();
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
    }

    #[test]
    fn golden_metrics_count_edges_by_class_and_overflow_past_the_budget() {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        metrics::with_local_recorder(&recorder, || {
            let mut m = ResponseMetrics::with_budget(Arc::default());
            let route: Arc<str> = Arc::from("*/");
            for (source, status) in [
                ("ingress", 200),
                ("ingress", 200),
                ("ingress", 503),
                ("search", 200),
            ] {
                m.record("frontend", status);
                m.record_edge(source, "frontend", &route, status, 0.001);
            }
            // Sources past the node's budget are labelled overflow.
            for i in 0..MAX_SOURCES + 5 {
                m.record("geo", 200);
                m.record_edge(&format!("client-{i}"), "geo", &route, 200, 0.001);
            }
        });
        let mut counts = std::collections::BTreeMap::new();
        for (key, _, _, value) in snapshotter.snapshot().into_vec() {
            if key.key().name() != "dpumesh_requests_total" {
                continue;
            }
            let labels: Vec<String> = key
                .key()
                .labels()
                .map(|l| format!("{}={}", l.key(), l.value()))
                .collect();
            if let DebugValue::Counter(n) = value {
                *counts.entry(labels.join(",")).or_insert(0) += n;
            }
        }
        assert_eq!(
            counts["source=ingress,destination=frontend,route=*/,class=2xx"],
            2
        );
        assert_eq!(
            counts["source=ingress,destination=frontend,route=*/,class=5xx"],
            1
        );
        assert_eq!(
            counts["source=search,destination=frontend,route=*/,class=2xx"],
            1
        );
        // 256 sources known (two above, the rest geo's callers): two more of geo's
        // callers fit its edges as `overflow`; past its edges, one edge takes the rest.
        assert_eq!(
            counts["source=overflow,destination=geo,route=*/,class=2xx"],
            2
        );
        assert_eq!(
            counts["source=overflow,destination=geo,route=overflow,class=2xx"],
            5
        );
        let geo_sources = counts
            .keys()
            .filter(|k| k.contains("destination=geo"))
            .count();
        assert_eq!(geo_sources, MAX_SOURCES - 2 + 2);
    }
}

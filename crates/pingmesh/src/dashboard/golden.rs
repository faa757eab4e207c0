//! The mesh's golden metrics as the dashboard draws them: each node's
//! `dpumesh_requests_total` and `dpumesh_request_latency_seconds` summed into edges
//! (caller → service), their rates since the previous look, and a rolling window of
//! per-service points for the charts.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use serde::Serialize;

use super::prometheus::Sample;

/// One edge's counters, summed over routes and nodes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EdgeTotals {
    pub requests: f64,
    /// 5xx answers.
    pub errors: f64,
    /// Cumulative latency buckets: upper bound (s) → count.
    pub buckets: BTreeMap<OrderedBound, f64>,
}

/// A bucket bound usable as a map key (`+Inf` included).
#[derive(Debug, Clone, Copy)]
pub struct OrderedBound(pub f64);

impl PartialEq for OrderedBound {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other).is_eq()
    }
}

impl Eq for OrderedBound {}

impl PartialOrd for OrderedBound {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for OrderedBound {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

/// Edges by (source, destination).
pub type Totals = BTreeMap<(String, String), EdgeTotals>;

/// Adds one node's golden samples to `totals`.
pub fn add(totals: &mut Totals, samples: &[Sample]) {
    for s in samples {
        let (Some(source), Some(destination)) =
            (s.labels.get("source"), s.labels.get("destination"))
        else {
            continue;
        };
        let key = (source.clone(), destination.clone());
        match s.name.as_str() {
            "dpumesh_requests_total" => {
                let edge = totals.entry(key).or_default();
                edge.requests += s.value;
                if s.labels.get("class").map(String::as_str) == Some("5xx") {
                    edge.errors += s.value;
                }
            }
            "dpumesh_request_latency_seconds_bucket" => {
                let Some(le) = s.labels.get("le").and_then(|l| parse_bound(l)) else {
                    continue;
                };
                *totals
                    .entry(key)
                    .or_default()
                    .buckets
                    .entry(OrderedBound(le))
                    .or_default() += s.value;
            }
            _ => {}
        }
    }
}

fn parse_bound(le: &str) -> Option<f64> {
    match le {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        other => other.parse().ok(),
    }
}

/// The `q` quantile (0–1) of cumulative `buckets`, as Prometheus's
/// `histogram_quantile` reads it (linear within a bucket); `None` without samples.
pub fn quantile(buckets: &[(f64, f64)], q: f64) -> Option<f64> {
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let mut below = (0.0, 0.0);
    for &(bound, count) in buckets {
        if count >= rank {
            if bound.is_infinite() {
                // Past the last finite bound: that bound is all that can be said.
                return Some(below.0);
            }
            let in_bucket = count - below.1;
            let share = if in_bucket > 0.0 {
                (rank - below.1) / in_bucket
            } else {
                1.0
            };
            return Some(below.0 + (bound - below.0) * share);
        }
        below = (bound, count);
    }
    Some(below.0)
}

/// One edge of the service graph.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GraphEdge {
    pub source: String,
    pub destination: String,
    pub requests_total: f64,
    /// Per second since the previous look.
    pub rps: f64,
    /// Non-5xx share since the previous look (1 when idle).
    pub success_rate: f64,
    /// p99 latency since the previous look, ms (`None` when idle).
    pub p99_ms: Option<f64>,
}

/// The service graph: services (and `ingress`) and the calls between them.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Graph {
    pub nodes: Vec<String>,
    pub edges: Vec<GraphEdge>,
}

/// What changed from `before` to `now` over `secs`.
fn delta(now: &EdgeTotals, before: Option<&EdgeTotals>, secs: f64) -> (f64, f64, Option<f64>) {
    let zero = EdgeTotals::default();
    let before = before.unwrap_or(&zero);
    let requests = (now.requests - before.requests).max(0.0);
    let errors = (now.errors - before.errors).max(0.0);
    let buckets: Vec<(f64, f64)> = now
        .buckets
        .iter()
        .map(|(b, c)| (b.0, (c - before.buckets.get(b).unwrap_or(&0.0)).max(0.0)))
        .collect();
    let success = if requests > 0.0 {
        1.0 - errors / requests
    } else {
        1.0
    };
    (
        requests / secs.max(1e-3),
        success,
        quantile(&buckets, 0.99).map(|s| s * 1e3),
    )
}

/// The graph of `now`, its rates against `before` (taken `secs` earlier; without
/// it, the rates are since each edge's start).
pub fn graph(now: &Totals, before: Option<(&Totals, f64)>) -> Graph {
    let mut nodes = BTreeSet::new();
    let edges = now
        .iter()
        .map(|((source, destination), totals)| {
            nodes.insert(source.clone());
            nodes.insert(destination.clone());
            let (rps, success_rate, p99_ms) = match before {
                Some((b, secs)) => {
                    delta(totals, b.get(&(source.clone(), destination.clone())), secs)
                }
                None => delta(totals, None, f64::INFINITY),
            };
            GraphEdge {
                source: source.clone(),
                destination: destination.clone(),
                requests_total: totals.requests,
                rps,
                success_rate,
                p99_ms,
            }
        })
        .collect();
    Graph {
        nodes: nodes.into_iter().collect(),
        edges,
    }
}

/// One moment of a service's chart.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Point {
    pub t_ms: u64,
    pub rps: f64,
    pub success_rate: f64,
    pub p99_ms: Option<f64>,
}

/// One moment of a node pair's network chart.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PairPoint {
    pub t_ms: u64,
    pub rtt_p50_us: f64,
    pub drop_rate: f64,
}

/// The rolling window the charts draw.
#[derive(Debug, Clone, Default, Serialize)]
pub struct History {
    pub window_ms: u64,
    /// By destination service: its incoming edges together.
    pub services: BTreeMap<String, VecDeque<Point>>,
    /// By `prober→target`.
    pub pairs: BTreeMap<String, VecDeque<PairPoint>>,
}

impl History {
    pub fn new(window: Duration) -> Self {
        Self {
            window_ms: window.as_millis() as u64,
            ..Self::default()
        }
    }

    /// Adds the services' points of `now` (against `before`, `secs` earlier) at `t_ms`.
    pub fn add_services(&mut self, t_ms: u64, now: &Totals, before: &Totals, secs: f64) {
        let mut by_service: BTreeMap<&str, (EdgeTotals, EdgeTotals)> = BTreeMap::new();
        for ((source, destination), totals) in now {
            let entry = by_service.entry(destination.as_str()).or_default();
            merge(&mut entry.0, totals);
            if let Some(b) = before.get(&(source.clone(), destination.clone())) {
                merge(&mut entry.1, b);
            }
        }
        for (service, (now, before)) in by_service {
            let (rps, success_rate, p99_ms) = delta(&now, Some(&before), secs);
            self.services
                .entry(service.to_owned())
                .or_default()
                .push_back(Point {
                    t_ms,
                    rps,
                    success_rate,
                    p99_ms,
                });
        }
        self.trim(t_ms);
    }

    /// Adds a pair's network point.
    pub fn add_pair(&mut self, pair: String, point: PairPoint) {
        let t = point.t_ms;
        self.pairs.entry(pair).or_default().push_back(point);
        self.trim(t);
    }

    fn trim(&mut self, t_ms: u64) {
        let oldest = t_ms.saturating_sub(self.window_ms);
        for points in self.services.values_mut() {
            while points.front().is_some_and(|p| p.t_ms < oldest) {
                points.pop_front();
            }
        }
        for points in self.pairs.values_mut() {
            while points.front().is_some_and(|p| p.t_ms < oldest) {
                points.pop_front();
            }
        }
        self.services.retain(|_, p| !p.is_empty());
        self.pairs.retain(|_, p| !p.is_empty());
    }
}

fn merge(into: &mut EdgeTotals, from: &EdgeTotals) {
    into.requests += from.requests;
    into.errors += from.errors;
    for (b, c) in &from.buckets {
        *into.buckets.entry(*b).or_default() += c;
    }
}

#[cfg(test)]
mod tests {
    use super::super::prometheus;
    use super::*;

    const NODE: &str = "\
dpumesh_requests_total{source=\"ingress\",destination=\"frontend\",route=\"*/\",class=\"2xx\"} 90
dpumesh_requests_total{source=\"ingress\",destination=\"frontend\",route=\"*/\",class=\"5xx\"} 10
dpumesh_requests_total{source=\"frontend\",destination=\"user\",route=\"call\",class=\"2xx\"} 100
dpumesh_request_latency_seconds_bucket{source=\"ingress\",destination=\"frontend\",route=\"*/\",le=\"0.001\"} 50
dpumesh_request_latency_seconds_bucket{source=\"ingress\",destination=\"frontend\",route=\"*/\",le=\"0.01\"} 100
dpumesh_request_latency_seconds_bucket{source=\"ingress\",destination=\"frontend\",route=\"*/\",le=\"+Inf\"} 100
";

    #[test]
    fn edges_sum_nodes_and_rates_come_from_the_previous_look() {
        let mut before = Totals::new();
        add(&mut before, &prometheus::parse(NODE));
        let mut now = Totals::new();
        // Two nodes, each twice the first look.
        let doubled = NODE.replace(" 90\n", " 180\n").replace(" 10\n", " 20\n");
        add(&mut now, &prometheus::parse(&doubled));
        add(&mut now, &prometheus::parse(NODE));
        let g = graph(&now, Some((&before, 2.0)));
        assert_eq!(g.nodes, ["frontend", "ingress", "user"]);
        let e = g
            .edges
            .iter()
            .find(|e| e.destination == "frontend")
            .unwrap();
        assert_eq!(e.requests_total, 300.0);
        // (300 - 100) / 2 s; 20 of the 200 new ones failed.
        assert_eq!(e.rps, 100.0);
        assert!((e.success_rate - 0.9).abs() < 1e-9);
        // 100 new in the 1–10 ms bucket's range and 50... the p99 falls in (1, 10] ms.
        let p99 = e.p99_ms.unwrap();
        assert!(p99 > 1.0 && p99 <= 10.0, "{p99}");
    }

    #[test]
    fn quantiles_read_buckets_as_prometheus_does() {
        let b = [(0.001, 50.0), (0.01, 100.0), (f64::INFINITY, 100.0)];
        assert_eq!(quantile(&b, 0.5), Some(0.001));
        assert!((quantile(&b, 0.75).unwrap() - 0.0055).abs() < 1e-9);
        assert_eq!(quantile(&[(f64::INFINITY, 0.0)], 0.99), None);
    }

    #[test]
    fn the_window_keeps_only_its_span() {
        let mut h = History::new(Duration::from_secs(10));
        let mut t = Totals::new();
        add(&mut t, &prometheus::parse(NODE));
        for i in 0..20 {
            h.add_services(i * 1000, &t, &Totals::new(), 1.0);
        }
        let points = &h.services["frontend"];
        assert_eq!(points.front().unwrap().t_ms, 9000);
        assert_eq!(points.len(), 11);
    }
}

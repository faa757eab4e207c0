//! The mesh overview: each node's admin API (`/filters`, `/metrics`) read and
//! summed up — pods, chains and filter generations, request and denial rates,
//! per-filter latency — and the golden metrics of every node summed into the service
//! graph ([`super::golden`]). Rates are the difference from the previous look; the
//! dashboard's sampler looks every two seconds and keeps the charts' window.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use parking_lot::Mutex;
use serde::Serialize;

use super::golden::{self, Graph, History, Totals};
use super::prometheus::{self, Sample};

/// One node as the dashboard shows it.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct NodeView {
    pub name: String,
    pub admin: String,
    pub up: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    pub generation: Option<u64>,
    pub pods: f64,
    /// `/filters`' chains as the node reports them.
    pub chains: serde_json::Value,
    pub requests_total: f64,
    /// Responses per second since the previous look.
    pub request_rate: f64,
    /// Denials by filter: total and per second.
    pub denials: BTreeMap<String, f64>,
    pub denial_rate: BTreeMap<String, f64>,
    /// Mean time in each filter (µs), since the node started.
    pub filter_latency_us: BTreeMap<String, f64>,
}

/// The mesh overview.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct MeshView {
    pub nodes: Vec<NodeView>,
    /// Who calls whom, how often and how well.
    pub graph: Graph,
}

/// How long the charts look back.
pub const HISTORY: Duration = Duration::from_secs(15 * 60);

#[derive(Debug, Clone)]
struct Previous {
    at: Instant,
    requests: f64,
    denials: BTreeMap<String, f64>,
}

/// Reads the nodes' admin APIs.
#[derive(Debug)]
pub struct Overview {
    nodes: Vec<(String, String)>,
    previous: Mutex<HashMap<String, Previous>>,
    /// The golden totals of the previous look, and when.
    golden: Mutex<Option<(Instant, Totals)>>,
    history: Mutex<History>,
    latest: Mutex<Option<MeshView>>,
}

impl Overview {
    /// `nodes`: names and admin base URLs (`http://HOST:PORT`).
    pub fn new(nodes: Vec<(String, String)>) -> Self {
        Self {
            nodes,
            previous: Mutex::new(HashMap::new()),
            golden: Mutex::new(None),
            history: Mutex::new(History::new(HISTORY)),
            latest: Mutex::new(None),
        }
    }

    /// Looks at every node (at once, each with a one-second limit).
    pub async fn collect(&self) -> MeshView {
        let mut nodes = Vec::new();
        let mut totals = Totals::new();
        // A few nodes, a second's limit each: one after the other keeps it simple.
        for (name, admin) in &self.nodes {
            let filters = get(admin, "/filters").await;
            let metrics = get(admin, "/metrics").await;
            let (name, admin) = (name.clone(), admin.clone());
            let mut view = NodeView {
                name: name.clone(),
                admin,
                ..NodeView::default()
            };
            match (filters, metrics) {
                (Ok(f), Ok(m)) => {
                    view.up = true;
                    if let Ok(v) = serde_json::from_str::<serde_json::Value>(&f) {
                        view.generation = v["generation"].as_u64();
                        view.chains = v["chains"].clone();
                    }
                    let samples = prometheus::parse(&m);
                    golden::add(&mut totals, &samples);
                    self.read_metrics(&mut view, &samples);
                }
                (Err(e), _) | (_, Err(e)) => view.error = Some(e),
            }
            nodes.push(view);
        }
        let now = Instant::now();
        let mut previous = self.golden.lock();
        let graph = match previous.as_ref() {
            Some((at, before)) => {
                let secs = now.duration_since(*at).as_secs_f64();
                let t_ms = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() as u64);
                self.history
                    .lock()
                    .add_services(t_ms, &totals, before, secs);
                golden::graph(&totals, Some((before, secs)))
            }
            None => golden::graph(&totals, None),
        };
        *previous = Some((now, totals));
        let view = MeshView { nodes, graph };
        *self.latest.lock() = Some(view.clone());
        view
    }

    /// The last look (taking one if there was none yet).
    pub async fn latest(&self) -> MeshView {
        let last = self.latest.lock().clone();
        match last {
            Some(view) => view,
            None => self.collect().await,
        }
    }

    /// The charts' window.
    pub fn history(&self) -> History {
        self.history.lock().clone()
    }

    /// Adds the network heatmap's pairs to the window.
    pub fn add_heatmap(&self, t_ms: u64, heatmap: &crate::analyzer::Heatmap) {
        let mut history = self.history.lock();
        for (i, prober) in heatmap.nodes.iter().enumerate() {
            for (j, target) in heatmap.nodes.iter().enumerate() {
                if let Some(Some(cell)) = heatmap.cells.get(i).and_then(|r| r.get(j)) {
                    history.add_pair(
                        format!("{prober}→{target}"),
                        golden::PairPoint {
                            t_ms,
                            rtt_p50_us: cell.rtt_p50_us,
                            drop_rate: cell.drop_rate,
                        },
                    );
                }
            }
        }
    }

    fn read_metrics(&self, view: &mut NodeView, samples: &[Sample]) {
        let mut sums: BTreeMap<String, (f64, f64)> = BTreeMap::new();
        for s in samples {
            let filter = s.labels.get("filter").cloned().unwrap_or_default();
            match s.name.as_str() {
                "dpumesh_pods" => view.pods = s.value,
                "dpumesh_mesh_responses_total" => view.requests_total += s.value,
                "dpumesh_denials_total" => *view.denials.entry(filter).or_default() += s.value,
                "dpumesh_filter_duration_seconds_sum" => {
                    sums.entry(filter).or_default().0 += s.value
                }
                "dpumesh_filter_duration_seconds_count" => {
                    sums.entry(filter).or_default().1 += s.value
                }
                _ => {}
            }
        }
        view.filter_latency_us = sums
            .into_iter()
            .filter(|(_, (_, n))| *n > 0.0)
            .map(|(f, (sum, n))| (f, sum / n * 1e6))
            .collect();
        let now = Instant::now();
        let mut previous = self.previous.lock();
        if let Some(p) = previous.get(&view.name) {
            let secs = now.duration_since(p.at).as_secs_f64().max(1e-3);
            view.request_rate = ((view.requests_total - p.requests) / secs).max(0.0);
            view.denial_rate = view
                .denials
                .iter()
                .map(|(f, v)| {
                    (
                        f.clone(),
                        ((v - p.denials.get(f).unwrap_or(&0.0)) / secs).max(0.0),
                    )
                })
                .collect();
        }
        previous.insert(
            view.name.clone(),
            Previous {
                at: now,
                requests: view.requests_total,
                denials: view.denials.clone(),
            },
        );
    }
}

/// GETs `path` from `base` (`http://HOST:PORT`) within a second.
async fn get(base: &str, path: &str) -> Result<String, String> {
    let authority = base
        .strip_prefix("http://")
        .ok_or_else(|| format!("{base}: not an http:// URL"))?
        .trim_end_matches('/')
        .to_owned();
    let fetch = async {
        let stream = tokio::net::TcpStream::connect(&authority)
            .await
            .map_err(|e| format!("{authority}: {e}"))?;
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .map_err(|e| format!("{authority}: {e}"))?;
        tokio::spawn(conn);
        let req = hyper::Request::get(path)
            .header("host", &authority)
            .body(Empty::<Bytes>::new())
            .map_err(|e| e.to_string())?;
        let resp = sender
            .send_request(req)
            .await
            .map_err(|e| format!("{authority}{path}: {e}"))?;
        if !resp.status().is_success() {
            return Err(format!("{authority}{path}: {}", resp.status()));
        }
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("{authority}{path}: {e}"))?
            .to_bytes();
        String::from_utf8(body.to_vec()).map_err(|_| format!("{authority}{path}: not UTF-8"))
    };
    tokio::time::timeout(Duration::from_secs(1), fetch)
        .await
        .map_err(|_| format!("{authority}{path}: no answer within 1 s"))?
}

//! The web dashboard, served beside the analyzer's JSON API: plain HTML, JS and CSS
//! embedded in the binary. It shows the mesh (nodes, pods, chains and their filter
//! generations, request rate, denials by filter, per-filter latency — gathered from
//! each node's admin API by [`overview`]), a node × node heatmap of network RTT and
//! drop rate, and the detected problems with their impact class; it polls every
//! two seconds.

pub mod golden;
pub mod overview;
mod prometheus;
pub mod tap;

use std::convert::Infallible;
use std::sync::Arc;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};

use crate::analyzer::Analyzer;
use crate::analyzer::service::answer;
use overview::Overview;

/// The Prometheus recorder of this process (installed on first use unless another
/// one is): what `/metrics` renders for a real TSDB to scrape.
pub fn prometheus() -> &'static metrics_exporter_prometheus::PrometheusHandle {
    static HANDLE: std::sync::OnceLock<metrics_exporter_prometheus::PrometheusHandle> =
        std::sync::OnceLock::new();
    HANDLE.get_or_init(|| {
        // Another recorder may already be installed (an embedding program); then
        // /metrics shows only what this handle records.
        dpumesh_prometheus::install(
            metrics_exporter_prometheus::PrometheusBuilder::new(),
            dpumesh_prometheus::UPKEEP_EVERY,
        )
    })
}

const INDEX: &str = include_str!("index.html");
const SCRIPT: &str = include_str!("dashboard.js");
const STYLE: &str = include_str!("dashboard.css");
/// The dashboard's own small chart and graph drawing (SVG), served beside it: no CDN.
const CHARTS: &str = include_str!("charts.js");

/// How often the dashboard looks at the nodes and the analyzer for its charts.
pub const SAMPLE_EVERY: std::time::Duration = std::time::Duration::from_secs(2);

fn json(body: String) -> Response<Full<Bytes>> {
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/json")
        .header("cache-control", "no-store")
        .body(Full::new(Bytes::from(body)))
        .expect("static headers")
}

/// `a=b&c=d`, percent-decoded.
fn params(query: Option<&str>) -> Vec<(String, String)> {
    let decode = |s: &str| {
        let bytes = s.as_bytes();
        let mut out = Vec::with_capacity(bytes.len());
        let mut i = 0;
        while i < bytes.len() {
            let hex = |b: u8| (b as char).to_digit(16);
            match (
                bytes[i],
                bytes.get(i + 1).copied().and_then(hex),
                bytes.get(i + 2).copied().and_then(hex),
            ) {
                (b'%', Some(h), Some(l)) => {
                    out.push((h * 16 + l) as u8);
                    i += 3;
                }
                (b'+', _, _) => {
                    out.push(b' ');
                    i += 1;
                }
                (b, _, _) => {
                    out.push(b);
                    i += 1;
                }
            }
        }
        String::from_utf8_lossy(&out).into_owned()
    };
    query
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (decode(k), decode(v))
        })
        .collect()
}

fn asset(content_type: &str, body: &'static str) -> Response<Full<Bytes>> {
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", content_type)
        .header("cache-control", "no-cache")
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .expect("static headers")
}

/// Answers one request: the dashboard's files, `/v1/mesh`, `/metrics` (Prometheus),
/// and the analyzer's API.
pub async fn route(
    analyzer: &Analyzer,
    overview: &Overview,
    relay: &tap::TapRelay,
    method: &Method,
    path: &str,
    query: Option<&str>,
) -> Response<Full<Bytes>> {
    match (method, path) {
        (&Method::GET, "/charts.js") => asset("text/javascript; charset=utf-8", CHARTS),
        (&Method::GET, "/v1/history") => json(
            serde_json::to_string(&overview.history())
                .unwrap_or_else(|e| serde_json::json!({ "error": e.to_string() }).to_string()),
        ),
        (&Method::GET, "/v1/tap") => {
            let params = params(query);
            let since = params
                .iter()
                .find(|(k, _)| k == "since")
                .and_then(|(_, v)| v.parse().ok())
                .unwrap_or(0);
            let page = relay.poll(tap::node_query(&params), since);
            json(serde_json::to_string(&page).unwrap_or_default())
        }
        (&Method::GET, "/" | "/index.html") => asset("text/html; charset=utf-8", INDEX),
        (&Method::GET, "/dashboard.js") => asset("text/javascript; charset=utf-8", SCRIPT),
        (&Method::GET, "/dashboard.css") => asset("text/css; charset=utf-8", STYLE),
        (&Method::GET, "/metrics") => {
            // The gauges are the latest analysis's.
            let _ = analyzer.report();
            Response::builder()
                .status(StatusCode::OK)
                .header("content-type", "text/plain; version=0.0.4")
                .body(Full::new(Bytes::from(prometheus().render())))
                .expect("static headers")
        }
        (&Method::GET, "/v1/mesh") => {
            let body = serde_json::to_string(&overview.latest().await)
                .unwrap_or_else(|e| serde_json::json!({ "error": e.to_string() }).to_string());
            Response::builder()
                .status(StatusCode::OK)
                .header("content-type", "application/json")
                .header("cache-control", "no-store")
                .body(Full::new(Bytes::from(body)))
                .expect("static headers")
        }
        _ => answer(analyzer, method, path),
    }
}

/// Looks at the nodes and the analyzer every [`SAMPLE_EVERY`] for the charts' window
/// (whether or not a page is open: after a spike, the charts show when it was), and
/// closes a tap nobody polls.
async fn sample(analyzer: Arc<Analyzer>, overview: Arc<Overview>, relay: Arc<tap::TapRelay>) {
    let mut every = tokio::time::interval(SAMPLE_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        overview.collect().await;
        let report = analyzer.report();
        overview.add_heatmap(report.at_ms, &report.heatmap);
        relay.reap();
    }
}

/// Serves the dashboard and the JSON API on `listener` until the task is dropped.
pub async fn serve(
    listener: tokio::net::TcpListener,
    analyzer: Arc<Analyzer>,
    overview: Arc<Overview>,
    relay: Arc<tap::TapRelay>,
) {
    let sampler = tokio::spawn(sample(analyzer.clone(), overview.clone(), relay.clone()));
    let _stop_sampler = AbortOnDrop(sampler);
    // The dashboard only reads, but it is asked for by its own address only: a page
    // from another site, its name rebound to this address, gets nothing.
    let port = listener.local_addr().map_or(0, |a| a.port());
    let access = Arc::new(dpumesh_identity::admin::AdminAccess::new(
        port,
        None,
        Vec::new(),
    ));
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let (analyzer, overview, access, relay) = (
            analyzer.clone(),
            overview.clone(),
            access.clone(),
            relay.clone(),
        );
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                let (analyzer, overview, access, relay) = (
                    analyzer.clone(),
                    overview.clone(),
                    access.clone(),
                    relay.clone(),
                );
                async move {
                    let host = req
                        .headers()
                        .get(hyper::header::HOST)
                        .and_then(|v| v.to_str().ok());
                    if let Err(refused) = access.check_host(host) {
                        return Ok::<_, Infallible>(
                            Response::builder()
                                .status(StatusCode::MISDIRECTED_REQUEST)
                                .header("content-type", "text/plain")
                                .body(Full::new(Bytes::from(format!("{refused}\n"))))
                                .expect("static headers"),
                        );
                    }
                    Ok::<_, Infallible>(
                        route(
                            &analyzer,
                            &overview,
                            &relay,
                            req.method(),
                            req.uri().path(),
                            req.uri().query(),
                        )
                        .await,
                    )
                }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .await;
        });
    }
}

/// Aborts a task when dropped (the sampler stops with the server).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

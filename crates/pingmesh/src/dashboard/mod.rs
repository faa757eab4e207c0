//! The web dashboard, served beside the analyzer's JSON API: plain HTML, JS and CSS
//! embedded in the binary. It shows the mesh (nodes, pods, chains and their filter
//! generations, request rate, denials by filter, per-filter latency — gathered from
//! each node's admin API by [`overview`]), a node × node heatmap of network RTT and
//! drop rate, and the detected problems with their impact class; it polls every
//! two seconds.

pub mod overview;
mod prometheus;

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
    method: &Method,
    path: &str,
) -> Response<Full<Bytes>> {
    match (method, path) {
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
            let body = serde_json::to_string(&overview.collect().await)
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

/// Serves the dashboard and the JSON API on `listener` until the task is dropped.
pub async fn serve(
    listener: tokio::net::TcpListener,
    analyzer: Arc<Analyzer>,
    overview: Arc<Overview>,
) {
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
        let (analyzer, overview, access) = (analyzer.clone(), overview.clone(), access.clone());
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                let (analyzer, overview, access) =
                    (analyzer.clone(), overview.clone(), access.clone());
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
                        route(&analyzer, &overview, req.method(), req.uri().path()).await,
                    )
                }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .await;
        });
    }
}

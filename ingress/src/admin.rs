//! The ingress's admin API, on a thread of its own (never on a shard): `/healthz`,
//! `/readyz` (ready while no node it sends to is down, else which and why), `/nodes`
//! (each node's state) and `/metrics` (Prometheus: reconnects, lost links, answers the
//! ingress gave itself). Beside it, the prober: every [`PROBE_EVERY`] it connects to
//! the nodes that are down (with the same backoff as the shards), so a node that came
//! back is seen as reachable without traffic having to find out; the probe's link is
//! dropped at once (the shards make their own).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::Instant;

use bytes::Bytes;
use dpumesh_dpa::fabric::{Fabric, QpCaps};
use dpumesh_dpa::reconnect::Reconnect;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

use dpumesh_fabric_client::health::{Health, PROBE_EVERY};

/// The process's Prometheus recorder (installed once; another recorder already in
/// place, e.g. in a test that runs a node in the same process, keeps its metrics).
fn prometheus() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        dpumesh_prometheus::install(PrometheusBuilder::new(), dpumesh_prometheus::UPKEEP_EVERY)
    })
}

/// The running admin API and prober.
pub struct Admin {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Admin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admin").field("addr", &self.addr).finish()
    }
}

impl Admin {
    /// Listens at `addr` and probes the nodes `health` says are down over `fabric`.
    pub fn start<F: Fabric>(
        addr: SocketAddr,
        health: Arc<Health>,
        fabric: F,
    ) -> anyhow::Result<Self> {
        prometheus();
        let listener = std::net::TcpListener::bind(addr)
            .map_err(|e| anyhow::anyhow!("cannot listen on {addr}: {e}"))?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let (served, stopping) = (health.clone(), stop.clone());
        // Reads only, but asked for by their own address only (no DNS rebinding).
        let access = Arc::new(dpumesh_identity::admin::AdminAccess::new(
            addr.port(),
            None,
            Vec::new(),
        ));
        let server = std::thread::Builder::new()
            .name("dpumesh-ingress-admin".into())
            .spawn(move || {
                rt.block_on(async move {
                    let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
                        return;
                    };
                    while !stopping.load(Ordering::Relaxed) {
                        let accepted = tokio::time::timeout(PROBE_EVERY, listener.accept()).await;
                        let Ok(Ok((stream, _))) = accepted else {
                            continue;
                        };
                        let (health, access) = (served.clone(), access.clone());
                        tokio::spawn(async move {
                            let service = hyper::service::service_fn(move |req| {
                                let (health, access) = (health.clone(), access.clone());
                                async move {
                                    let host = req
                                        .headers()
                                        .get(http::header::HOST)
                                        .and_then(|v| v.to_str().ok());
                                    Ok::<_, Infallible>(match access.check_host(host) {
                                        Ok(()) => handle(&health, &req),
                                        Err(refused) => reply(
                                            StatusCode::MISDIRECTED_REQUEST,
                                            format!("{refused}\n"),
                                        ),
                                    })
                                }
                            });
                            let _ = hyper::server::conn::http1::Builder::new()
                                .serve_connection(TokioIo::new(stream), service)
                                .await;
                        });
                    }
                });
            })?;
        let stopping = stop.clone();
        let prober = std::thread::Builder::new()
            .name("dpumesh-ingress-probe".into())
            .spawn(move || probe(&fabric, &health, &stopping))?;
        Ok(Self {
            addr,
            stop,
            threads: vec![server, prober],
        })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Admin {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Connects to the nodes that are down until `stop`; a connect that succeeds marks the
/// node up (its link is dropped: the shards make their own when they need one).
fn probe<F: Fabric>(fabric: &F, health: &Health, stop: &AtomicBool) {
    let (Ok(pd), Ok(cq)) = (fabric.alloc_pd(), fabric.create_cq(64)) else {
        tracing::warn!("the ingress cannot probe its nodes (no fabric resources)");
        return;
    };
    let mut backoff = Reconnect::<SocketAddr>::default();
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(PROBE_EVERY);
        for node in health.down_nodes() {
            let now = Instant::now();
            if !backoff.may_try(&node, now) {
                continue;
            }
            match fabric.connect(&pd, node, &cq, QpCaps::default()) {
                Ok(_qp) => {
                    backoff.connected(&node);
                    health.up(node);
                    tracing::info!(%node, "node reachable again");
                }
                Err(e) => {
                    backoff.failed(&node, now);
                    health.down(node, &e.to_string(), now);
                }
            }
        }
    }
}

fn reply(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response
}

fn handle(health: &Health, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    let now = Instant::now();
    match (req.method(), req.uri().path()) {
        (&Method::GET, "/healthz") => reply(StatusCode::OK, "ok\n".to_owned()),
        (&Method::GET, "/readyz") => match health.readiness(now) {
            Ok(()) => reply(StatusCode::OK, "ready\n".to_owned()),
            Err(why) => reply(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("not ready: {why}\n"),
            ),
        },
        (&Method::GET, "/nodes") => {
            let mut body = String::new();
            for (node, state) in health.describe(now) {
                body.push_str(&format!("{node} {state}\n"));
            }
            reply(StatusCode::OK, body)
        }
        (&Method::GET, "/metrics") => {
            dpumesh_identity::metrics::refresh();
            reply(StatusCode::OK, prometheus().render())
        }
        _ => reply(StatusCode::NOT_FOUND, "not found\n".to_owned()),
    }
}

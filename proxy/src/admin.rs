//! The admin API: `/healthz`, `/readyz`, `/metrics` (Prometheus text), `/filters`
//! (what runs where), `POST /reload`, `/store` and `/cache` (stats, and `DELETE` to
//! purge), and `/tap` (the live tap, [`crate::admin_tap`]). Reads are open; the mutations (`POST /reload`, `DELETE /store`,
//! `DELETE /cache`) need the admin token, and every request's `Host` must name the
//! admin address ([`dpumesh_identity::admin`]).

use std::convert::Infallible;
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use dpumesh_runtime::HealthState;
use dpumesh_supervise::Supervisor;
use http::{HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio::net::TcpListener;

use dpumesh_identity::admin::{AdminAccess, AdminRefusal};

use crate::policy::Policy;

/// The process-wide Prometheus recorder (a process has one global recorder).
pub fn prometheus() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        let builder = PrometheusBuilder::new()
            .set_buckets_for_metric(
                Matcher::Suffix("seconds".to_owned()),
                &[
                    5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3, 1e-2, 0.1, 1.0,
                ],
            )
            .expect("bucket list is not empty")
            // The golden latency covers whole exchanges: microseconds to seconds
            // (`histogram_quantile` reads p50/p95/p99 from these).
            .set_buckets_for_metric(
                Matcher::Full("dpumesh_request_latency_seconds".to_owned()),
                &[
                    5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25,
                    0.5, 1.0, 2.5, 5.0, 10.0,
                ],
            )
            .expect("bucket list is not empty");
        // Another recorder may already be installed (e.g. by an embedding program);
        // then /metrics shows only what this handle records.
        dpumesh_prometheus::install(builder, dpumesh_prometheus::UPKEEP_EVERY)
    })
}

/// Serves the admin API on `listener` until the task is dropped. `/readyz` also
/// reports the threads of `threads` (besides the filter workers').
#[allow(clippy::too_many_arguments)]
pub async fn serve(
    listener: TcpListener,
    access: AdminAccess,
    policy: Arc<Policy>,
    threads: Vec<Arc<Supervisor>>,
    awaited: Vec<Awaited>,
    store: Option<Arc<dpumesh_store::Agent>>,
    cache: Option<Arc<crate::http_cache::HttpCache>>,
    observer: Option<Arc<crate::observe::Observer>>,
) {
    let threads = Arc::new(threads);
    let awaited = Arc::new(awaited);
    let access = Arc::new(access);
    loop {
        let Ok((stream, peer)) = listener.accept().await else {
            continue;
        };
        let (policy, threads, awaited, store, cache, access, observer) = (
            policy.clone(),
            threads.clone(),
            awaited.clone(),
            store.clone(),
            cache.clone(),
            access.clone(),
            observer.clone(),
        );
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                let (policy, threads, awaited, store, cache, access, observer) = (
                    policy.clone(),
                    threads.clone(),
                    awaited.clone(),
                    store.clone(),
                    cache.clone(),
                    access.clone(),
                    observer.clone(),
                );
                async move {
                    if let Err(refused) = allowed(&access, &req) {
                        return Ok::<_, Infallible>(refusal(&refused).map(BodyExt::boxed_unsync));
                    }
                    if req.uri().path() == "/tap" {
                        if req.method() != Method::GET {
                            let r = reply(
                                StatusCode::METHOD_NOT_ALLOWED,
                                "text/plain",
                                "method not allowed\n".to_owned(),
                            );
                            return Ok(r.map(BodyExt::boxed_unsync));
                        }
                        if let Err(refused) = crate::admin_tap::allowed(&access, &req, peer) {
                            return Ok(refusal(&refused).map(BodyExt::boxed_unsync));
                        }
                        return Ok(crate::admin_tap::tap(observer.as_deref(), &query(&req)));
                    }
                    let parts = Parts {
                        store: store.as_deref(),
                        cache: cache.as_deref(),
                    };
                    let response = handle(&policy, &threads, &awaited, parts, req).await;
                    Ok::<_, Infallible>(response.map(BodyExt::boxed_unsync))
                }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

/// The rules of an admin API on `port`: its mutations need `mesh_token` (a node of a
/// mesh with identities) or else the token in the config's `admin_token_file`
/// (created with a random token when missing).
pub fn access(
    config: &dpumesh_config::LoadedConfig,
    port: u16,
    mesh_token: Option<String>,
) -> anyhow::Result<AdminAccess> {
    let token = match (mesh_token, &config.config.admin_token_file) {
        (Some(token), _) => Some(token),
        (None, Some(file)) => {
            let path = config.resolve(file);
            // A file named but not there yet gets a fresh random token (owner-only),
            // as a first run would want; one that exists is read as it is.
            if dpumesh_identity::ca::ensure_secret(&path)
                .map_err(|e| anyhow::anyhow!("admin_token_file {}: {e}", path.display()))?
            {
                tracing::info!(path = %path.display(), "wrote a new admin token");
            }
            let text = std::fs::read_to_string(&path).map_err(|e| {
                anyhow::anyhow!("admin_token_file {}: cannot read: {e}", path.display())
            })?;
            let token = text.trim().to_owned();
            anyhow::ensure!(
                !token.is_empty(),
                "admin_token_file {}: empty (an empty token would let anyone in)",
                path.display()
            );
            Some(token)
        }
        (None, None) => None,
    };
    Ok(AdminAccess::new(port, token, Vec::new()))
}

/// Whether `req` may be served: its `Host` names this API, and a mutation carries the
/// admin token.
fn allowed(access: &AdminAccess, req: &Request<Incoming>) -> Result<(), AdminRefusal> {
    let header = |name| req.headers().get(name).and_then(|v| v.to_str().ok());
    access.check_host(header(http::header::HOST))?;
    let mutation = matches!(
        (req.method(), req.uri().path()),
        (&Method::POST, "/reload") | (&Method::DELETE, "/store" | "/cache")
    );
    if mutation {
        access.check_mutation(header(http::header::AUTHORIZATION))?;
    }
    Ok(())
}

fn refusal(refused: &AdminRefusal) -> Response<Full<Bytes>> {
    metrics::counter!("dpumesh_admin_refused_total", "why" => match refused {
        AdminRefusal::Host(_) => "host",
        AdminRefusal::Unauthorized => "unauthorized",
        AdminRefusal::NoToken => "no_token",
    })
    .increment(1);
    let status = StatusCode::from_u16(refused.status()).unwrap_or(StatusCode::FORBIDDEN);
    let mut response = reply(status, "text/plain", format!("{refused}\n"));
    if matches!(refused, AdminRefusal::Unauthorized) {
        response.headers_mut().insert(
            http::header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Bearer realm=\"dpumesh-admin\""),
        );
    }
    response
}

/// The node's optional parts the admin API shows.
#[derive(Clone, Copy)]
struct Parts<'a> {
    store: Option<&'a dpumesh_store::Agent>,
    cache: Option<&'a crate::http_cache::HttpCache>,
}

fn reply(status: StatusCode, content_type: &'static str, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static(content_type),
    );
    response
}

/// Something the server waits for without being unready for it (a node's pods
/// registering), saying what is missing. `/readyz` names it and stays 200: a DPU
/// proxy is Ready when it can serve. Under DPF (25.7 and later) the host stays
/// NotReady until its DPU's service pods are Ready, so a proxy that waited for the
/// host's pods would wait for ever. Until they come, what the node gets for their
/// service is answered 503 naming it.
pub type Awaited = Arc<dyn Fn() -> Result<(), String> + Send + Sync>;

/// Ready when no supervised thread is down, every check passes and every worker runs
/// the published generation; otherwise why not.
fn readiness(policy: &Policy, threads: &[Arc<Supervisor>]) -> Result<(), String> {
    policy.pool().supervisor().ready()?;
    for supervisor in threads {
        supervisor.ready()?;
    }
    if !policy.settled() {
        return Err("workers are switching to the new generation".to_owned());
    }
    Ok(())
}

/// `/readyz`'s answer: 503 with the reason when the server cannot serve; otherwise
/// 200, listing what it still waits for (one line each).
fn readyz(
    policy: &Policy,
    threads: &[Arc<Supervisor>],
    awaited: &[Awaited],
) -> (StatusCode, String) {
    if let Err(why) = readiness(policy, threads) {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {why}\n"),
        );
    }
    let mut body = "ready\n".to_owned();
    for missing in awaited.iter().filter_map(|a| a().err()) {
        body.push_str(&format!("waiting: {missing}\n"));
    }
    (StatusCode::OK, body)
}

async fn handle(
    policy: &Arc<Policy>,
    threads: &[Arc<Supervisor>],
    awaited: &[Awaited],
    parts: Parts<'_>,
    req: Request<Incoming>,
) -> Response<Full<Bytes>> {
    let json = "application/json";
    let store = parts.store;
    match (req.method(), req.uri().path()) {
        (_, "/store") => store_endpoint(store, &req),
        (_, "/cache") => cache_endpoint(parts.cache, &req),
        (&Method::GET, "/healthz") => reply(StatusCode::OK, "text/plain", "ok\n".to_owned()),
        (&Method::GET, "/readyz") => {
            let (status, body) = readyz(policy, threads, awaited);
            reply(status, "text/plain", body)
        }
        (&Method::GET, "/metrics") => {
            refresh_gauges(policy);
            if let Some(store) = store {
                let stats = store.stats();
                metrics::gauge!("dpumesh_store_objects").set(stats.objects as f64);
                metrics::gauge!("dpumesh_store_stored_bytes").set(stats.bytes as f64);
                metrics::gauge!("dpumesh_store_free_slots").set(stats.free_slots as f64);
            }
            if let Some(cache) = parts.cache {
                let (entries, bytes) = cache.size();
                metrics::gauge!("dpumesh_http_cache_entries").set(entries as f64);
                metrics::gauge!("dpumesh_http_cache_bytes").set(bytes as f64);
            }
            reply(
                StatusCode::OK,
                "text/plain; version=0.0.4",
                prometheus().render(),
            )
        }
        (&Method::GET, "/filters") => reply(StatusCode::OK, json, filters(policy).to_string()),
        (&Method::POST, "/reload") => {
            let policy = policy.clone();
            // Compiling is CPU-bound: off the async threads.
            let result = tokio::task::spawn_blocking(move || policy.reload()).await;
            match result {
                Ok(Ok(done)) => reply(
                    StatusCode::OK,
                    json,
                    serde_json::json!({
                        "generation": done.generation,
                        "build_ms": done.build.as_secs_f64() * 1e3,
                    })
                    .to_string(),
                ),
                Ok(Err(e)) => reply(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    json,
                    serde_json::json!({"error": e.to_string()}).to_string(),
                ),
                Err(e) => reply(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    json,
                    serde_json::json!({"error": format!("reload task failed: {e}")}).to_string(),
                ),
            }
        }
        (_, "/healthz" | "/readyz" | "/metrics" | "/filters" | "/reload") => reply(
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            "method not allowed\n".to_owned(),
        ),
        (_, path) => reply(
            StatusCode::NOT_FOUND,
            "text/plain",
            format!(
                "no admin endpoint {path}; try /healthz /readyz /metrics /filters /reload /store /cache /tap\n"
            ),
        ),
    }
}

/// Gauges read at scrape time rather than kept up to date on the request path.
fn refresh_gauges(policy: &Policy) {
    dpumesh_identity::metrics::refresh();
    let snapshot = policy.snapshot();
    for chain in snapshot.generation.chains() {
        for filter in chain.filters() {
            let labels = [
                ("chain", chain.name().to_owned()),
                ("filter", filter.name().to_owned()),
            ];
            metrics::gauge!("dpumesh_filter_instances", &labels)
                .set(filter.live_instances() as f64);
            let degraded = matches!(filter.health().state(), HealthState::Degraded { .. });
            metrics::gauge!("dpumesh_filter_degraded", &labels).set(f64::from(u8::from(degraded)));
        }
    }
    let state = policy.runtime().shared_state();
    metrics::gauge!("dpumesh_shared_state_entries").set(state.len() as f64);
    metrics::counter!("dpumesh_shared_state_evicted_total").absolute(state.evictions());
    metrics::gauge!("dpumesh_workers").set(policy.pool().workers() as f64);
}

fn filters(policy: &Policy) -> serde_json::Value {
    let snapshot = policy.snapshot();
    let generation = snapshot.generation.number();
    let chains: Vec<serde_json::Value> = snapshot
        .generation
        .chains()
        .iter()
        .map(|chain| {
            let filters: Vec<serde_json::Value> = chain
                .filters()
                .iter()
                .map(|f| {
                    let state = match f.health().state() {
                        HealthState::Healthy => serde_json::json!("healthy"),
                        HealthState::Degraded { retry_in_ms } => {
                            serde_json::json!({"degraded": {"retry_in_ms": retry_in_ms}})
                        }
                    };
                    serde_json::json!({
                        "name": f.name(),
                        // `component`, or the proxy-wasm ABI a plugin declares.
                        "kind": f.proxy_wasm_abi().map_or_else(
                            || "component".to_owned(),
                            |abi| format!("proxy-wasm {abi}")
                        ),
                        "version": f.version_hash(),
                        // Whether its instances run as core instances.
                        "core": f.runs_as_core(),
                        "generation": generation,
                        "state": state,
                        "instances": f.live_instances(),
                        "failure_policy": f.settings().failure_policy,
                        "degradations": f.health().degradations(),
                    })
                })
                .collect();
            serde_json::json!({"chain": chain.name(), "fused": chain.is_fused(), "filters": filters})
        })
        .collect();
    serde_json::json!({
        "generation": generation,
        "workers": policy.pool().worker_generations(),
        "last_reload_error": policy.last_error(),
        "chains": chains,
    })
}

/// `GET /store`: the BlueCache agent's counts. `DELETE /store?key=K` or
/// `?prefix=P`: purges (the answer says how many objects went).
fn store_endpoint(
    store: Option<&dpumesh_store::Agent>,
    req: &Request<Incoming>,
) -> Response<Full<Bytes>> {
    let Some(store) = store else {
        return reply(
            StatusCode::NOT_FOUND,
            "text/plain",
            "this node runs no BlueCache store (no `store:` in the mesh file)\n".to_owned(),
        );
    };
    counts_and_purge(
        req,
        "/store?key=KEY or /store?prefix=PREFIX",
        || {
            let s = store.stats();
            serde_json::json!({
                "objects": s.objects,
                "bytes": s.bytes,
                "capacity": s.capacity,
                "slots": s.slots,
                "free_slots": s.free_slots,
                "pushed_bytes": s.pushed_bytes,
                "pulled_bytes": s.pulled_bytes,
                "evictions": s.evictions,
                "cancelled": s.cancelled,
                "memory_bytes": s.memory_bytes,
                "backend": s.backend,
                "engine": s.engine,
            })
        },
        |purge| match purge {
            Purge::Key(key) => store.purge_key(key),
            Purge::Prefix(prefix) => store.purge_prefix(prefix),
        },
    )
}

/// What `DELETE ?key=` or `?prefix=` names.
enum Purge<'a> {
    Key(&'a str),
    Prefix(&'a str),
}

/// `GET`: `counts` as JSON; `DELETE` with one `key` or `prefix` query parameter:
/// `purge`, answered with how many went (`usage` says how to ask otherwise).
fn counts_and_purge(
    req: &Request<Incoming>,
    usage: &str,
    counts: impl FnOnce() -> serde_json::Value,
    purge: impl FnOnce(Purge<'_>) -> usize,
) -> Response<Full<Bytes>> {
    let json = "application/json";
    match *req.method() {
        Method::GET => reply(StatusCode::OK, json, counts().to_string()),
        Method::DELETE => {
            let query = query(req);
            let removed = match query.as_slice() {
                [(k, key)] if k == "key" => purge(Purge::Key(key)),
                [(k, prefix)] if k == "prefix" => purge(Purge::Prefix(prefix)),
                _ => {
                    return reply(
                        StatusCode::BAD_REQUEST,
                        "text/plain",
                        format!("say what to purge: DELETE {usage}\n"),
                    );
                }
            };
            reply(
                StatusCode::OK,
                json,
                serde_json::json!({ "removed": removed }).to_string(),
            )
        }
        _ => reply(
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            "method not allowed (GET or DELETE)\n".to_owned(),
        ),
    }
}

fn query(req: &Request<Incoming>) -> Vec<(String, String)> {
    req.uri()
        .query()
        .map(|q| {
            q.split('&')
                .filter(|p| !p.is_empty())
                .map(|p| {
                    let (k, v) = p.split_once('=').unwrap_or((p, ""));
                    (unescape(k), unescape(v))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// `GET /cache`: the HTTP cache's counts. `DELETE /cache?key=HOST/PATH?QUERY` or
/// `?prefix=HOST/PATH`: purges stored responses (keys are the host, lower-case with
/// its port if it had one, then the path and query).
fn cache_endpoint(
    cache: Option<&crate::http_cache::HttpCache>,
    req: &Request<Incoming>,
) -> Response<Full<Bytes>> {
    use std::sync::atomic::Ordering::Relaxed;
    let Some(cache) = cache else {
        return reply(
            StatusCode::NOT_FOUND,
            "text/plain",
            "this node runs no HTTP cache (no `store:` in the mesh file)\n".to_owned(),
        );
    };
    counts_and_purge(
        req,
        "/cache?key=HOST/PATH or /cache?prefix=HOST/PATH",
        || {
            let s = &cache.stats;
            let (entries, bytes) = cache.size();
            serde_json::json!({
                "entries": entries,
                "bytes": bytes,
                "hits": s.hits.load(Relaxed),
                "misses": s.misses.load(Relaxed),
                "revalidated": s.revalidated.load(Relaxed),
                "stored": s.stored.load(Relaxed),
                "not_stored": s.not_stored.load(Relaxed),
                "hit_bytes": s.hit_bytes.load(Relaxed),
                "evictions": cache.store_agent().stats().evictions,
            })
        },
        |purge| match purge {
            Purge::Key(key) => cache.invalidate(key),
            Purge::Prefix(prefix) => cache.purge_prefix(prefix),
        },
    )
}

/// A query value's `%XX` escapes and `+` decoded (an invalid escape is kept as
/// written).
fn unescape(text: &str) -> String {
    let bytes = text.as_bytes();
    let hex = |b: u8| (b as char).to_digit(16);
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if bytes.get(i + 1).and_then(|b| hex(*b)).is_some()
                && bytes.get(i + 2).and_then(|b| hex(*b)).is_some() =>
            {
                let hi = hex(bytes[i + 1]).expect("checked");
                let lo = hex(bytes[i + 2]).expect("checked");
                out.push((hi * 16 + lo) as u8);
                i += 2;
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod unescape_tests {
    #[test]
    fn query_values_are_decoded() {
        assert_eq!(super::unescape("cache%2FGET+x"), "cache/GET x");
        assert_eq!(super::unescape("100%"), "100%");
        assert_eq!(super::unescape("%zz%4"), "%zz%4");
    }
}

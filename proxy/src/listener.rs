//! The loopback HTTP listener: parses a request, routes it, runs its chain on a worker
//! and answers the verdict — the local reply of a denial, or `200` with a JSON echo of
//! where the request would go and the head the filters left. It stands in for the
//! ingress and the data path so the proxy can be exercised on its own.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use dpumesh_runtime::{Decision, FailureKind, RequestHead, ResponseInfo};
use http::{HeaderValue, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use crate::policy::Policy;

/// Serves `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, policy: Arc<Policy>) {
    loop {
        let Ok((stream, peer)) = listener.accept().await else {
            continue;
        };
        let policy = policy.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let policy = policy.clone();
                async move { Ok::<_, Infallible>(handle(&policy, req, peer).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain"),
    );
    response
}

async fn handle(
    policy: &Policy,
    req: Request<Incoming>,
    peer: SocketAddr,
) -> Response<Full<Bytes>> {
    let started = Instant::now();
    let mut head = match RequestHead::from_request(&req, peer) {
        Ok(head) => head,
        Err(e) => return text(StatusCode::BAD_REQUEST, format!("dpumesh: {e}\n")),
    };
    let snapshot = policy.snapshot();
    let Some(route) = snapshot.routes.find(&head.authority, &head.path) else {
        return text(
            StatusCode::NOT_FOUND,
            format!(
                "dpumesh: no route for host {:?} path {:?}\n",
                head.authority, head.path
            ),
        );
    };
    let service = route.service.to_owned();
    head.destination = Some(service.clone());
    let chain = route.chain;
    let done = match policy
        .pool()
        .request(snapshot.generation.clone(), chain, head)
        .await
    {
        Ok(done) => done,
        Err(e) => return text(StatusCode::SERVICE_UNAVAILABLE, format!("dpumesh: {e}\n")),
    };
    // The snapshot the request was routed in: its generation is the ticket's.
    let generation = snapshot.generation.number();
    let chain_name = snapshot.generation.chains()[chain].name();
    let outcome = done.outcome;
    let (response, info) = match &outcome.decision {
        Decision::Deny {
            filter,
            reply,
            cause,
        } => {
            let request_id = outcome
                .head
                .metadata("trace.request_id")
                .map(str::to_owned)
                .or_else(|| outcome.head.header("x-request-id"));
            tracing::info!(
                target: "dpumesh::access",
                chain = %chain_name,
                filter = %filter,
                status = reply.status,
                reason = %reply.body.lines().next().unwrap_or(""),
                fault = matches!(cause, dpumesh_runtime::DenyCause::Fault(_)),
                request_id = request_id.as_deref().unwrap_or("-"),
                "request denied"
            );
            metrics::counter!(
                "dpumesh_denials_total",
                "chain" => chain_name.to_owned(),
                "filter" => filter.to_string(),
                "status" => reply.status.to_string(),
            )
            .increment(1);
            let mut response = Response::new(Full::new(Bytes::from(reply.body.clone())));
            *response.status_mut() =
                StatusCode::from_u16(reply.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            for (name, value) in &reply.headers {
                // Checked by the runtime when the filter replied.
                if let (Ok(n), Ok(v)) = (
                    http::HeaderName::from_bytes(name.as_bytes()),
                    HeaderValue::from_str(value),
                ) {
                    response.headers_mut().append(n, v);
                }
            }
            let info = ResponseInfo {
                status: reply.status,
                latency_ns: started.elapsed().as_nanos() as u64,
                upstream: None,
                failure: FailureKind::LocalReply,
            };
            (response, info)
        }
        Decision::Continue => {
            let headers: Vec<(String, String)> = outcome
                .head
                .headers()
                .iter()
                .map(|(n, v)| {
                    (
                        n.as_str().to_owned(),
                        String::from_utf8_lossy(v.as_bytes()).into_owned(),
                    )
                })
                .collect();
            let body = serde_json::json!({
                "service": service,
                "chain": chain_name,
                "generation": generation,
                "headers": headers,
                "metadata": outcome.head.metadata_entries().collect::<Vec<_>>(),
            });
            let mut response = Response::new(Full::new(Bytes::from(format!("{body}\n"))));
            response.headers_mut().insert(
                http::header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            let info = ResponseInfo {
                status: 200,
                latency_ns: started.elapsed().as_nanos() as u64,
                upstream: Some(service),
                failure: FailureKind::None,
            };
            (response, info)
        }
        Decision::Pause { park, callouts } => {
            // This loopback listener is a test bench for policies: it makes no calls.
            // The request is given up (its response phase runs) and answered 502.
            let info = ResponseInfo {
                status: 502,
                latency_ns: started.elapsed().as_nanos() as u64,
                upstream: None,
                failure: FailureKind::LocalReply,
            };
            let _ = policy.pool().abandon_with(done.ticket, *park, info, |_| {});
            let upstream = callouts.first().map_or("", |c| c.upstream.as_str());
            return text(
                StatusCode::BAD_GATEWAY,
                format!(
                    "dpumesh: a filter paused the request for an HTTP call (upstream {upstream:?}); the loopback listener makes no calls: run the policy in a node\n"
                ),
            );
        }
    };
    let mut response = response;
    if let Ok(v) = HeaderValue::from_str(&generation.to_string()) {
        response.headers_mut().insert("x-dpumesh-generation", v);
    }
    // The response phase (circuit-breaker accounting) runs on the worker and filter
    // versions the request phase ran on.
    let ticket = done.ticket;
    let head = outcome.head;
    let pool_result = policy.pool().response(ticket, head, info).await;
    if let Err(e) = pool_result {
        tracing::warn!(error = %e, "response phase not run");
    }
    snapshot.durations[chain].record(started.elapsed().as_secs_f64());
    response
}

//! The egress port: the bridged server's way out. An HTTP proxy on a local port: a
//! request in absolute form (`GET http://user/me`, as `HTTP_PROXY` clients send) or
//! with the service in `Host` is a call to that service through the mesh, made as the
//! bridge's service (the node knows the pod, so the callee's chain sees its identity).
//! A request body of a stated length under [`WHOLE_BELOW`] goes whole; any other
//! streams to the callee as the server sends it (an upload of any size, a gRPC
//! client stream), at the callee's pace.
//! Answers come back as the mesh gave them (any status, trailers included); one
//! whose body streams (a download, server-sent events) is forwarded as it comes, at
//! the server's pace: a server that stops reading stops the callee, and one that
//! hangs up ends the call.

use std::convert::Infallible;

use dpumesh_head::whole_body::WholeBody;
use dpumesh_host::body::RequestBody;
use dpumesh_host::{HttpRequest, Outbound};
use http::{Request, Response, StatusCode};
use http_body::Body as _;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};

/// Bodies of a stated length below this go whole (one descriptor); others stream.
pub const WHOLE_BELOW: u64 = 1 << 20;

/// Serves the egress port until the runtime ends.
pub async fn serve(listener: tokio::net::TcpListener, outbound: Outbound) {
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "egress accept failed");
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let outbound = outbound.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request| {
                let outbound = outbound.clone();
                async move { Ok::<_, Infallible>(call(&outbound, request).await) }
            });
            let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

fn plain(status: StatusCode, text: String) -> Response<RequestBody> {
    let mut response = Response::new(RequestBody::Whole(WholeBody::bytes(format!("{text}\n"))));
    *response.status_mut() = status;
    response
}

/// The service a request names: its absolute URI's host, else its `Host`.
pub fn service_of(request: &Request<Incoming>) -> Option<String> {
    let host = request.uri().host().map(str::to_owned).or_else(|| {
        request
            .headers()
            .get(http::header::HOST)
            .and_then(|h| h.to_str().ok())
            .map(|h| h.rsplit_once(':').map_or(h, |(name, _)| name).to_owned())
    })?;
    (!host.is_empty()).then_some(host)
}

async fn call(outbound: &Outbound, request: Request<Incoming>) -> Response<RequestBody> {
    let Some(service) = service_of(&request) else {
        return plain(
            StatusCode::BAD_REQUEST,
            "egress: name the service (http://<service>/path, or Host: <service>)".into(),
        );
    };
    let target = request
        .uri()
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_owned();
    let (parts, body) = request.into_parts();
    let stated = parts
        .headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let mut headers = parts.headers;
    for name in dpumesh_head::HOP_BY_HOP {
        headers.remove(name);
    }
    headers.remove("proxy-authorization");
    headers.remove(http::header::HOST);
    let mut call = HttpRequest::new(parts.method, format!("http://{service}{target}"));
    if body.is_end_stream() || stated.is_some_and(|n| n < WHOLE_BELOW) {
        let collected = match body.collect().await {
            Ok(c) => c,
            Err(e) => {
                return plain(
                    StatusCode::BAD_REQUEST,
                    format!("egress: the request body could not be read: {e}"),
                );
            }
        };
        call.trailers = collected.trailers().cloned().unwrap_or_default();
        call.body = collected.to_bytes();
    } else {
        // As the server sends it; a stated length goes with it.
        call.stream = Some(dpumesh_host::body::BodyStream::new(body));
    }
    call.headers = headers;
    let (tx, rx) = tokio::sync::oneshot::channel();
    outbound.call(call, move |answer| {
        let _ = tx.send(answer);
    });
    match rx.await {
        Ok(Ok(answer)) => answer.into_http(),
        Ok(Err(why)) => plain(StatusCode::BAD_GATEWAY, format!("egress: {why}")),
        Err(_) => plain(
            StatusCode::BAD_GATEWAY,
            "egress: the service's event loop stopped".into(),
        ),
    }
}

//! Serving a `tower::Service` (a tonic gRPC server, an axum router, hyper's
//! `service_fn`) on the host library: [`handler`] turns it into a [`Handler`] the
//! event loop runs, so a tonic service joins the mesh over the data path, with no
//! socket and no copy of tonic.
//!
//! Each request becomes an `http::Request<RequestBody>` (its body and trailers whole,
//! or, for requests the loop streams (`LoopConfig::stream_requests`), its body as it
//! arrives; the mesh's [`Caller`] in its extensions). The service's `http::Response` answers
//! with what its body has ready at once (a unary call's message and its trailers,
//! where gRPC keeps its status); a body that waits for more (server streaming,
//! server-sent events) streams the rest as it comes ([`crate::body`]). A body of a
//! known length under 1 MiB is read whole.
//!
//! **Where the future runs.** The service's future is an asynchronous step
//! ([`ExecutionContext::respond_future`]): polled on the loop's thread when the
//! request starts, and again whenever it is woken. A gRPC unary call on a service that
//! computes its answer (tonic's decoding, the method, the encoding) finishes in that
//! first poll: no hand-off, no thread switch. A future that waits (a client socket, a
//! timer) holds no thread meanwhile. Futures that use tokio's timers or sockets need
//! a tokio runtime entered on the loop's thread (`Runtime::enter`), whose own threads
//! drive the I/O.
//!
//! [`Handler`]: crate::Handler
//! [`ExecutionContext::respond_future`]: crate::ExecutionContext::respond_future

use std::fmt::Display;

use bytes::Bytes;
use dpumesh_head::whole_body::WholeBody;
use http_body_util::BodyExt;
use tower_service::Service;

use crate::body::RequestBody;
use crate::context::ExecutionContext;
use crate::http::{Caller, HttpRequest, HttpResponse};

/// A handler serving every request with `service`. `service` is cloned per request,
/// as tower servers do (tonic's and axum's clones share their state).
pub fn handler<S, B>(service: S) -> impl Fn(&mut ExecutionContext) + Send + Sync + 'static
where
    S: Service<http::Request<RequestBody>, Response = http::Response<B>>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
    S::Error: Display,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Display,
{
    move |ctx: &mut ExecutionContext| {
        let request = to_http(ctx.take_request());
        let mut service = service.clone();
        ctx.respond_future(move |_| async move {
            std::future::poll_fn(|cx| service.poll_ready(cx))
                .await
                .map_err(|e| format!("the service is not ready: {e}"))?;
            let response = service
                .call(request)
                .await
                .map_err(|e| format!("the service failed: {e}"))?;
            from_http(response).await
        });
    }
}

/// The request as `http` types: the URL is the path and query; the caller rides in
/// the extensions (a tonic method reads it with `request.extensions().get::<Caller>()`).
fn to_http(request: HttpRequest) -> http::Request<RequestBody> {
    let HttpRequest {
        method,
        url,
        headers,
        body,
        trailers,
        caller,
        stream,
    } = request;
    let body = match stream.and_then(|s| s.take()) {
        Some(stream) => RequestBody::Stream(stream),
        None => RequestBody::Whole(WholeBody::new(body, trailers)),
    };
    let mut out = http::Request::new(body);
    *out.method_mut() = method;
    // A received request's URL is its path and query, which the node checked; one
    // that is not a URI (never from the data path) becomes `/`.
    *out.uri_mut() = url.parse().unwrap_or_else(|_| http::Uri::from_static("/"));
    *out.headers_mut() = headers;
    // gRPC is HTTP/2 only, and tonic checks the version it is given.
    *out.version_mut() = http::Version::HTTP_2;
    if let Some(caller) = caller {
        out.extensions_mut().insert::<Caller>(caller);
    }
    out
}

/// A body whose exact length is below this is read whole.
const WHOLE_BELOW: usize = 1 << 20;

/// The service's response: what its body has ready when it answers goes whole (a
/// unary call's message and trailers, in the first poll); a body that then waits (a
/// server-streaming call, server-sent events) sends what it had and streams the rest
/// as it comes.
async fn from_http<B>(response: http::Response<B>) -> Result<HttpResponse, String>
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Display,
{
    use std::task::Poll;
    let (parts, body) = response.into_parts();
    if body
        .size_hint()
        .exact()
        .is_some_and(|n| n <= WHOLE_BELOW as u64)
    {
        // A body of a known, small length (a `content-length` a bridged server sent)
        // is one answer: waiting for it costs less than three descriptors.
        let collected = body
            .collect()
            .await
            .map_err(|e| format!("the service's response body failed: {e}"))?;
        let trailers = collected.trailers().cloned().unwrap_or_default();
        return Ok(HttpResponse {
            status: parts.status.as_u16(),
            headers: parts.headers,
            body: collected.to_bytes(),
            trailers,
            stream: None,
        });
    }
    let mut body = Box::pin(body);
    let mut data = bytes::BytesMut::new();
    let mut trailers = http::HeaderMap::new();
    loop {
        // Now or never: a frame that is not ready ends the whole part.
        let next = std::future::poll_fn(|cx| match body.as_mut().poll_frame(cx) {
            Poll::Ready(frame) => Poll::Ready(Some(frame)),
            Poll::Pending => Poll::Ready(None),
        })
        .await;
        match next {
            Some(Some(Ok(frame))) => match frame.into_data() {
                Ok(bytes) => data.extend_from_slice(&bytes),
                Err(frame) => {
                    if let Ok(t) = frame.into_trailers() {
                        trailers.extend(t);
                    }
                }
            },
            Some(Some(Err(e))) => {
                return Err(format!("the service's response body failed: {e}"));
            }
            Some(None) => break,
            None => {
                let rest = body.map_err(|e| crate::body::BoxError::from(e.to_string()));
                let mut response = HttpResponse::streaming(parts.status.as_u16(), rest);
                response.headers = parts.headers;
                response.body = data.freeze();
                return Ok(response);
            }
        }
    }
    Ok(HttpResponse {
        status: parts.status.as_u16(),
        headers: parts.headers,
        body: data.freeze(),
        trailers,
        stream: None,
    })
}

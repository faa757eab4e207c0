//! Serving a `tower::Service` (a tonic gRPC server, an axum router, hyper's
//! `service_fn`) on the host library: [`handler`] turns it into a [`Handler`] the
//! event loop runs, so a tonic service joins the mesh over the data path, with no
//! socket and no copy of tonic.
//!
//! Each request becomes an `http::Request<WholeBody>` (its body and trailers whole,
//! the mesh's [`Caller`] in its extensions); the service's `http::Response` is read
//! whole (body and trailers, where gRPC keeps its status) and answers.
//!
//! **Where the future runs.** The handler polls the service's future once, on the
//! loop's thread. A gRPC unary call on a service that computes its answer (tonic's
//! decoding, the method, the encoding) finishes in that poll: no hand-off, no
//! thread switch. A future that waits (a database client, a timer) is finished on the
//! loop's pool, where it blocks that worker thread until it is done; such a service
//! gives the pool threads a runtime with [`EventLoop::with_worker_scope`]
//! (a tokio runtime entered in each worker) and enough of them.
//!
//! [`Handler`]: crate::Handler
//! [`EventLoop::with_worker_scope`]: crate::EventLoop::with_worker_scope

use std::fmt::Display;
use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use bytes::Bytes;
use dpumesh_head::whole_body::WholeBody;
use http_body_util::BodyExt;
use tower_service::Service;

use crate::context::ExecutionContext;
use crate::http::{Caller, HttpRequest, HttpResponse};

/// A handler serving every request with `service`. `service` is cloned per request,
/// as tower servers do (tonic's and axum's clones share their state).
pub fn handler<S, B>(service: S) -> impl Fn(&mut ExecutionContext) + Send + Sync + 'static
where
    S: Service<http::Request<WholeBody>, Response = http::Response<B>>
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
        let mut call = Box::pin(async move {
            std::future::poll_fn(|cx| service.poll_ready(cx))
                .await
                .map_err(|e| format!("the service is not ready: {e}"))?;
            let response = service
                .call(request)
                .await
                .map_err(|e| format!("the service failed: {e}"))?;
            from_http(response).await
        });
        match call.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
            Poll::Ready(answer) => {
                ctx.respond(move |_| answer);
            }
            Poll::Pending => {
                ctx.run_internal(move |_| block_on(call));
            }
        }
    }
}

/// The request as `http` types: the URL is the path and query; the caller rides in
/// the extensions (a tonic method reads it with `request.extensions().get::<Caller>()`).
fn to_http(request: HttpRequest) -> http::Request<WholeBody> {
    let HttpRequest {
        method,
        url,
        headers,
        body,
        trailers,
        caller,
    } = request;
    let mut out = http::Request::new(WholeBody::new(body, trailers));
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

/// The service's response, read whole.
async fn from_http<B>(response: http::Response<B>) -> Result<HttpResponse, String>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Display,
{
    let (parts, body) = response.into_parts();
    let collected = body
        .collect()
        .await
        .map_err(|e| format!("the service's response body failed: {e}"))?;
    let trailers = collected.trailers().cloned().unwrap_or_default();
    Ok(HttpResponse {
        status: parts.status.as_u16(),
        headers: parts.headers,
        body: collected.to_bytes(),
        trailers,
    })
}

/// Wakes the thread blocked on a future.
struct Unpark(std::thread::Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
}

/// Runs `future` to its end on this thread (a pool worker), parked while it waits.
fn block_on<F: Future>(future: F) -> F::Output {
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut future = pin!(future);
    loop {
        if let Poll::Ready(out) = future.as_mut().poll(&mut cx) {
            return out;
        }
        std::thread::park();
    }
}

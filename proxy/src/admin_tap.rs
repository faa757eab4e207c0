//! `GET /tap`: the node's live tap over its admin API, as newline-delimited JSON
//! records ([`crate::observe::Record`]), streamed as requests match until the client
//! goes away. Parameters: `service`, `route`, `source`, `method`, `path` (a prefix),
//! `status` (`503` or `5xx`), `rate` (records a second at most).
//!
//! A tap shows traffic (redacted, but paths, callers and timings): it needs the admin
//! token where the API has one, and without one it is served to loopback callers only.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use http_body_util::combinators::UnsyncBoxBody;
use hyper::body::{Body, Frame, Incoming};

use dpumesh_identity::admin::{AdminAccess, AdminRefusal};

use crate::observe::Observer;
use crate::observe::tap::{TapQuery, TapStream};

/// A line sent when no record came for this long, so a gone client is noticed (its
/// tap closed) even when nothing matches.
const KEEPALIVE: Duration = Duration::from_secs(5);
/// Records gathered into one frame at most.
const BATCH: usize = 64;

pub type AdminBody = UnsyncBoxBody<Bytes, Infallible>;

/// Whether `peer` may open a tap.
pub fn allowed(
    access: &AdminAccess,
    req: &Request<Incoming>,
    peer: SocketAddr,
) -> Result<(), AdminRefusal> {
    let authorization = req
        .headers()
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    match access.check_mutation(authorization) {
        Err(AdminRefusal::NoToken) if peer.ip().is_loopback() => Ok(()),
        other => other,
    }
}

/// Answers `GET /tap?...` with the stream, or says why not.
/// `params`: the request's decoded query parameters.
pub fn tap(observer: Option<&Observer>, params: &[(String, String)]) -> Response<AdminBody> {
    let Some(observer) = observer else {
        return text(
            StatusCode::NOT_FOUND,
            "this proxy has no data plane to tap\n",
        );
    };
    let query = match TapQuery::from_params(params.iter().map(|(k, v)| (k.as_str(), v.as_str()))) {
        Ok(q) => q,
        Err(e) => return text(StatusCode::BAD_REQUEST, &format!("{e}\n")),
    };
    let stream = match observer.taps.subscribe(query) {
        Ok(s) => s,
        Err(e) => return text(StatusCode::SERVICE_UNAVAILABLE, &format!("{e}\n")),
    };
    let body = TapBody {
        stream,
        keepalive: Box::pin(tokio::time::sleep(KEEPALIVE)),
    };
    let mut response = Response::new(body.boxed_unsync());
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/x-ndjson"),
    );
    response.headers_mut().insert(
        http::header::CACHE_CONTROL,
        http::HeaderValue::from_static("no-store"),
    );
    response
}

fn text(status: StatusCode, body: &str) -> Response<AdminBody> {
    let mut response =
        Response::new(http_body_util::Full::new(Bytes::from(body.to_owned())).boxed_unsync());
    *response.status_mut() = status;
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain"),
    );
    response
}

/// The stream's body: records as they come, batched when several are queued.
struct TapBody {
    stream: TapStream,
    keepalive: Pin<Box<tokio::time::Sleep>>,
}

impl Body for TapBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.stream.poll_next(cx) {
            Poll::Ready(Some(first)) => {
                let mut out = Vec::with_capacity(1024);
                let mut next = Some(first);
                let mut n = 0;
                while let Some(record) = next {
                    if serde_json::to_writer(&mut out, &*record).is_ok() {
                        out.push(b'\n');
                    }
                    n += 1;
                    next = if n < BATCH {
                        self.stream.try_next()
                    } else {
                        None
                    };
                }
                let at = tokio::time::Instant::now() + KEEPALIVE;
                self.keepalive.as_mut().reset(at);
                Poll::Ready(Some(Ok(Frame::data(Bytes::from(out)))))
            }
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => match self.keepalive.as_mut().poll(cx) {
                Poll::Ready(()) => {
                    let at = tokio::time::Instant::now() + KEEPALIVE;
                    self.keepalive.as_mut().reset(at);
                    Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"\n")))))
                }
                Poll::Pending => Poll::Pending,
            },
        }
    }
}

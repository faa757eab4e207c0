//! Forwarding the mesh's requests to the bridged server: a `tower::Service` the host
//! library's adapter serves with (each request an asynchronous step on the loop).
//!
//! A WebSocket (the mesh delivers its upgrade request with `upgrade: websocket` and
//! a streamed body) is upgraded with the server too: the bridge's `101` answers with
//! a streamed body carrying what the server sends, and the request's body (what the
//! client sends) is written to the server's connection ([`tunnel`]).
//!
//! A `CONNECT` (a client's tunnel to this service, `CONNECT <service>:<port>`)
//! opens a TCP connection to the server, whatever the port named: the mesh's route
//! chose the service, and the bridge reaches its own server only (never an address
//! the client names). The bridge answers `200` and the bytes flow as a WebSocket's.
//!
//! What the server is told of the caller: the mesh's word, in
//! `x-forwarded-client-cert` (`URI=<the caller's SPIFFE ID>`, as Envoy sets it for a
//! verified peer). The header is always removed first, so a value a client sent
//! through the ingress never reaches the server as the mesh's.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use dpumesh_config::BridgeProtocol;
use dpumesh_head::whole_body::WholeBody;
use dpumesh_host::Caller;
use dpumesh_host::body::RequestBody;
use http::{HeaderValue, Request, Response, StatusCode};
use http_body_util::{BodyExt, Either};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use crate::h1;

/// The header the caller's identity is given in.
pub const CLIENT_CERT: &str = "x-forwarded-client-cert";

/// The longest the bridge waits for the server (the node's own deadline answers the
/// caller sooner; this bounds what a server that never answers holds).
const PATIENCE: Duration = Duration::from_secs(300);

/// What the bridge answers with: the server's body (through hyper, or the lean
/// HTTP/1.1 client), or its own, or a WebSocket's bytes from the server.
pub type Body = Either<Either<Incoming, h1::Body>, Either<WholeBody, dpumesh_host::body::Receiver>>;

/// Forwards to one server.
#[derive(Clone)]
pub struct Forward {
    /// Streamed uploads, WebSockets, h2c and gRPC.
    client: Client<HttpConnector, RequestBody>,
    /// HTTP/1.1 requests with whole bodies (most): [`h1`].
    lean: h1::Client,
    to: String,
    protocol: BridgeProtocol,
}

impl Forward {
    /// A forwarder to `to` (`host:port`) speaking `protocol`.
    pub fn new(to: &str, protocol: BridgeProtocol) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let mut builder = Client::builder(TokioExecutor::new());
        builder.pool_idle_timeout(Duration::from_secs(90));
        if protocol != BridgeProtocol::Http1 {
            builder.http2_only(true);
        }
        Self {
            client: builder.build(connector),
            lean: h1::Client::new(to),
            to: to.to_owned(),
            protocol,
        }
    }

    /// The answer when the server cannot be reached or does not answer: 502 (504),
    /// or for gRPC the trailers-only UNAVAILABLE (DEADLINE_EXCEEDED) a gRPC client
    /// reads.
    fn failed(&self, status: StatusCode, why: String) -> Response<Body> {
        tracing::warn!(to = %self.to, %why, "the bridged server did not answer");
        let text = format!("bridge: {why}\n");
        let (status, headers, body) = if self.protocol == BridgeProtocol::Grpc {
            let head = dpumesh_head::wire::ResponseHead {
                status: status.as_u16(),
                ..Default::default()
            };
            let reply = dpumesh_head::grpc::local_reply(&head, text.as_bytes());
            (StatusCode::OK, reply.headers, Bytes::new())
        } else {
            let mut h = http::HeaderMap::new();
            h.insert(
                http::header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain"),
            );
            (status, h, Bytes::from(text))
        };
        let mut response = Response::new(Either::Right(Either::Left(WholeBody::bytes(body))));
        *response.status_mut() = status;
        *response.headers_mut() = headers;
        response
    }
}

impl tower_service::Service<Request<RequestBody>> for Forward {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<RequestBody>) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            if request.method() == http::Method::CONNECT {
                return Ok(this.connect(request).await);
            }
            let websocket = request.headers().contains_key(http::header::UPGRADE)
                && this.protocol == BridgeProtocol::Http1;
            let request = match this.to_server(request) {
                Ok(r) => r,
                Err(why) => return Ok(this.failed(StatusCode::BAD_GATEWAY, why)),
            };
            if websocket {
                return Ok(this.tunnel(request).await);
            }
            let (parts, body) = request.into_parts();
            let body = match body {
                RequestBody::Whole(whole) if this.protocol == BridgeProtocol::Http1 => {
                    return Ok(this.lean(parts, whole).await);
                }
                other => other,
            };
            let request = Request::from_parts(parts, body);
            let answer = tokio::time::timeout(PATIENCE, this.client.request(request)).await;
            Ok(this.answer(answer, |b| Either::Left(Either::Left(b))))
        })
    }
}

impl Forward {
    /// An HTTP/1.1 request with a whole body, through the lean client.
    async fn lean(&self, parts: http::request::Parts, body: WholeBody) -> Response<Body> {
        let (data, trailers) = body.into_parts();
        let answer = tokio::time::timeout(PATIENCE, self.lean.send(&parts, data, &trailers)).await;
        self.answer(answer, |b| Either::Left(Either::Right(b)))
    }

    /// The server's answer (its body as `body` makes it ours), or why there is none:
    /// 502 when it failed, 504 when it did not answer within [`PATIENCE`].
    fn answer<B, E: std::fmt::Display>(
        &self,
        answer: Result<Result<Response<B>, E>, tokio::time::error::Elapsed>,
        body: impl FnOnce(B) -> Body,
    ) -> Response<Body> {
        match answer {
            Ok(Ok(response)) => response.map(body),
            Ok(Err(e)) => {
                let why = format!("the server at {} failed: {e}", self.to);
                self.failed(StatusCode::BAD_GATEWAY, why)
            }
            Err(_) => {
                let why = format!("the server at {} did not answer in {PATIENCE:?}", self.to);
                self.failed(StatusCode::GATEWAY_TIMEOUT, why)
            }
        }
    }

    /// The request as the server gets it: to its address, the caller in
    /// [`CLIENT_CERT`], the framing the client library's.
    fn to_server(&self, request: Request<RequestBody>) -> Result<Request<RequestBody>, String> {
        let (mut parts, body) = request.into_parts();
        let target = parts
            .uri
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .to_owned();
        parts.uri = format!("http://{}{target}", self.to)
            .parse()
            .map_err(|e| format!("bad target {target:?}: {e}"))?;
        parts.version = if self.protocol == BridgeProtocol::Http1 {
            http::Version::HTTP_11
        } else {
            http::Version::HTTP_2
        };
        let headers = &mut parts.headers;
        // A streamed body's length, as its client stated it (the ingress held the
        // body to it): kept, so the server gets the length it may need rather than a
        // chunked body. A whole body's length is its own.
        let stated = matches!(body, RequestBody::Stream(_))
            .then(|| headers.get(http::header::CONTENT_LENGTH).cloned())
            .flatten();
        for name in dpumesh_head::HOP_BY_HOP {
            headers.remove(name);
        }
        if let Some(len) = stated {
            headers.insert(http::header::CONTENT_LENGTH, len);
        }
        headers.remove(CLIENT_CERT);
        let identity = parts
            .extensions
            .get::<Caller>()
            .and_then(|c| c.identity.as_deref());
        if let Some(v) = identity.and_then(|id| HeaderValue::from_str(&format!("URI={id}")).ok()) {
            headers.insert(CLIENT_CERT, v);
        }
        if self.protocol == BridgeProtocol::Grpc {
            headers.insert(http::header::TE, HeaderValue::from_static("trailers"));
        }
        Ok(Request::from_parts(parts, body))
    }

    /// A WebSocket: the upgrade asked of the server (its handshake with no body),
    /// then bytes both ways between the request's streamed body, the server's
    /// connection and the answer's streamed body, until either side closes.
    async fn tunnel(&self, request: Request<RequestBody>) -> Response<Body> {
        let (mut parts, body) = request.into_parts();
        parts.headers.insert(
            http::header::CONNECTION,
            HeaderValue::from_static("upgrade"),
        );
        parts
            .headers
            .insert(http::header::UPGRADE, HeaderValue::from_static("websocket"));
        let handshake = Request::from_parts(parts, RequestBody::Whole(WholeBody::default()));
        let mut response =
            match tokio::time::timeout(PATIENCE, self.client.request(handshake)).await {
                Ok(Ok(r)) => r,
                Ok(Err(e)) => {
                    let why = format!("the server at {} failed the upgrade: {e}", self.to);
                    return self.failed(StatusCode::BAD_GATEWAY, why);
                }
                Err(_) => {
                    let why = format!("the server at {} did not answer the upgrade", self.to);
                    return self.failed(StatusCode::GATEWAY_TIMEOUT, why);
                }
            };
        if response.status() != StatusCode::SWITCHING_PROTOCOLS {
            // The server refused: its answer goes back as it is.
            return response.map(|b| Either::Left(Either::Left(b)));
        }
        let upgraded = match hyper::upgrade::on(&mut response).await {
            Ok(u) => u,
            Err(e) => {
                let why = format!("the server's connection was not upgraded: {e}");
                return self.failed(StatusCode::BAD_GATEWAY, why);
            }
        };
        let (rd, wr) = tokio::io::split(hyper_util::rt::TokioIo::new(upgraded));
        let (mut parts, _) = response.into_parts();
        for name in dpumesh_head::HOP_BY_HOP {
            parts.headers.remove(name);
        }
        Response::from_parts(parts, Either::Right(Either::Right(carry(rd, wr, body))))
    }

    /// A `CONNECT`: a TCP connection to the server, then bytes both ways as a
    /// WebSocket's (the request's streamed body to the server, the server's bytes as
    /// the answer's streamed body) until either side closes.
    async fn connect(&self, request: Request<RequestBody>) -> Response<Body> {
        let connection =
            tokio::time::timeout(PATIENCE, tokio::net::TcpStream::connect(&self.to)).await;
        let stream = match connection {
            Ok(Ok(stream)) => stream,
            Ok(Err(e)) => {
                let why = format!("cannot connect to the server at {}: {e}", self.to);
                return self.failed(StatusCode::BAD_GATEWAY, why);
            }
            Err(_) => {
                let why = format!("the server at {} did not take the connection", self.to);
                return self.failed(StatusCode::GATEWAY_TIMEOUT, why);
            }
        };
        let _ = stream.set_nodelay(true);
        let (rd, wr) = stream.into_split();
        Response::new(Either::Right(Either::Right(carry(
            rd,
            wr,
            request.into_body(),
        ))))
    }
}

/// Carries a tunnel's bytes: the request's body (what the client sends) is written to
/// `wr` until it ends (then `wr` is shut down), and what `rd` gives comes back as the
/// returned body, a part at a time as it comes, until `rd` ends.
fn carry<R, W>(mut rd: R, mut wr: W, body: RequestBody) -> dpumesh_host::body::Receiver
where
    R: tokio::io::AsyncRead + Unpin + Send + 'static,
    W: tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    // The client's bytes to the server.
    tokio::spawn(async move {
        let mut body = body;
        while let Some(Ok(frame)) = body.frame().await {
            if let Some(data) = frame.data_ref()
                && wr.write_all(data).await.is_err()
            {
                return;
            }
        }
        let _ = wr.shutdown().await;
    });
    // The server's bytes to the client, a part at a time as they come.
    let (mut tx, rx) = dpumesh_host::body::channel(dpumesh_host::body::STREAM_WINDOW_PARTS);
    tokio::spawn(async move {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            match rd.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if tx
                        .send(bytes::Bytes::copy_from_slice(&buf[..n]))
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
            }
        }
    });
    rx
}

//! WebSocket through the mesh: the upgrade request crosses as any request does (its
//! route, its chain: a client without a token is refused before anything is
//! upgraded), with `upgrade: websocket` kept in its head and its body streamed. The
//! service answers `101` with a streamed body; then the client's connection becomes a
//! tunnel: what the client sends goes to the service as the request's streamed body
//! ([`Upload`]), what the service sends comes back as the answer's streamed body,
//! each with the streams' back-pressure, until either side closes. The mesh reads no
//! WebSocket frame: a huge frame flows through in windows like any bytes, and a
//! connection with nothing moving ends at its route's `stream_idle_timeout`.
//!
//! HTTP/1.1 only (RFC 6455); HTTP/2's extended CONNECT (RFC 8441) is not offered.
//!
//! `CONNECT <service>:<port>` (RFC 9110 §9.3.6, over HTTP/1.1 or HTTP/2) is a tunnel
//! the same way: the authority is the request's host, so the route and its chain
//! decide as for any request to that host (no route, 404; no token, 401). The
//! service answers `2xx` with a streamed body, then bytes flow both ways. The mesh
//! is no open proxy: the port is the service's business (a bridge connects to its
//! own server whatever it says), and a host no route serves reaches nothing.

use std::time::Duration;

use dpumesh_error::{ErrorKind, ProxyError};
use dpumesh_fabric_client::{Answer, StreamBody, Upload, UploadError};
use http::{HeaderValue, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::body::ClientBody;

/// The most the client's side reads at once (one part for the service).
const READ: usize = 64 << 10;

/// What a tunnel carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// An upgraded WebSocket connection.
    WebSocket,
    /// A `CONNECT` tunnel.
    Connect,
}

impl Kind {
    /// The tunnel `req` asks for, if any.
    pub(crate) fn of(req: &Request<Incoming>) -> Option<Self> {
        if req.method() == http::Method::CONNECT {
            Some(Self::Connect)
        } else if is_websocket(req) {
            Some(Self::WebSocket)
        } else {
            None
        }
    }

    /// Whether the service's answer opens the tunnel.
    fn opens(self, status: u16) -> bool {
        match self {
            Self::WebSocket => status == StatusCode::SWITCHING_PROTOCOLS.as_u16(),
            Self::Connect => (200..300).contains(&status),
        }
    }

    fn what(self) -> &'static str {
        match self {
            Self::WebSocket => "switched protocols",
            Self::Connect => "accepted the CONNECT",
        }
    }

    /// The tunnels opened (`dpumesh_ingress_websockets_total`,
    /// `dpumesh_ingress_connects_total`) and their bytes by direction
    /// (`…_bytes_total`).
    fn metrics(self) -> (&'static str, &'static str) {
        match self {
            Self::WebSocket => (
                "dpumesh_ingress_websockets_total",
                "dpumesh_ingress_websocket_bytes_total",
            ),
            Self::Connect => (
                "dpumesh_ingress_connects_total",
                "dpumesh_ingress_connect_bytes_total",
            ),
        }
    }
}

/// Whether `req` asks for a WebSocket (HTTP/1.1 `Upgrade: websocket` with
/// `Connection: upgrade`).
pub(crate) fn is_websocket(req: &Request<Incoming>) -> bool {
    let h = req.headers();
    req.version() == http::Version::HTTP_11
        && h.get(http::header::UPGRADE)
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"websocket"))
        && h.get_all(http::header::CONNECTION).iter().any(|v| {
            v.to_str().is_ok_and(|s| {
                s.split(',')
                    .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
            })
        })
}

/// The client's answer to an upgrade request or a `CONNECT`: a `101` (a `200`) that
/// turns the connection into a tunnel (run on its own task until either side closes),
/// or the service's (or the chain's) refusal as it came.
pub(crate) fn answer<S: 'static>(
    kind: Kind,
    answer: Answer,
    upload: Option<Upload>,
    on_upgrade: hyper::upgrade::OnUpgrade,
    idle: Duration,
    share: S,
) -> Result<Response<ClientBody>, ProxyError> {
    let mut answer = answer;
    let opens =
        dpumesh_head::wire::decode_response(&answer.head).is_ok_and(|h| kind.opens(h.status));
    let (true, Some(down), Some(upload)) = (opens, answer.stream.take(), upload) else {
        if opens {
            // A 101 (a 2xx) without a stream to carry it: nothing can flow.
            return Err(ProxyError::new(
                ErrorKind::BadResponse,
                format!(
                    "the service {} without a stream to carry the bytes",
                    kind.what()
                ),
            ));
        }
        // Refused (401 from the chain, the service's own answer): the client reads
        // it and nothing is upgraded.
        return crate::respond(answer);
    };
    let mut response = crate::respond(Answer {
        head: answer.head,
        body: bytes::Bytes::new(),
        stream: None,
    })?;
    let headers = response.headers_mut();
    match kind {
        Kind::WebSocket => {
            headers.insert(
                http::header::CONNECTION,
                HeaderValue::from_static("upgrade"),
            );
            headers.insert(http::header::UPGRADE, HeaderValue::from_static("websocket"));
        }
        Kind::Connect => {
            // A 2xx to a CONNECT has no content, and says no framing (RFC 9110
            // §9.3.6): what follows is the tunnel's.
            headers.remove(http::header::CONTENT_LENGTH);
            headers.remove(http::header::TRANSFER_ENCODING);
        }
    }
    let (opened, bytes) = kind.metrics();
    metrics::counter!(opened).increment(1);
    tokio::task::spawn_local(async move {
        let _share = share;
        match on_upgrade.await {
            Ok(upgraded) => run(upgraded, upload, down, idle, bytes).await,
            Err(e) => tracing::debug!(error = %e, "the client's connection was not upgraded"),
        }
    });
    Ok(response)
}

/// Carries bytes both ways until both directions are closed; counts them.
async fn run(
    upgraded: hyper::upgrade::Upgraded,
    upload: Upload,
    down: StreamBody,
    idle: Duration,
    bytes: &'static str,
) {
    let (rd, wr) = tokio::io::split(TokioIo::new(upgraded));
    let (sent, received) = tokio::join!(to_service(rd, upload, idle), to_client(wr, down));
    metrics::counter!(bytes, "direction" => "to_service").increment(sent);
    metrics::counter!(bytes, "direction" => "to_client").increment(received);
}

type Reader = tokio::io::ReadHalf<TokioIo<hyper::upgrade::Upgraded>>;
type Writer = tokio::io::WriteHalf<TokioIo<hyper::upgrade::Upgraded>>;

/// The client's bytes to the service, until the client closes (the service's body
/// ends), fails or idles (it is aborted), or the service's side is over; how many.
async fn to_service(mut rd: Reader, mut upload: Upload, idle: Duration) -> u64 {
    let mut buf = vec![0u8; READ];
    let mut total = 0u64;
    loop {
        let n = tokio::select! {
            n = tokio::time::timeout(idle, rd.read(&mut buf)) => match n {
                Ok(Ok(0)) => {
                    let _ = upload.finish(Vec::new());
                    return total;
                }
                Ok(Ok(n)) => n,
                Ok(Err(e)) => {
                    upload.abort(&format!("the client's connection failed: {e}"));
                    return total;
                }
                Err(_) => {
                    upload.abort("the client sent nothing for the idle limit");
                    return total;
                }
            },
            () = upload.cancelled_or_lost() => return total,
        };
        total += n as u64;
        match upload.write(&buf[..n]).await.and_then(|()| upload.flush()) {
            Ok(()) => {}
            Err(UploadError::Cancelled) => return total,
            Err(UploadError::Failed(e)) => {
                tracing::debug!(error = %e, "a tunnel's bytes could not be sent on");
                return total;
            }
        }
    }
}

/// The service's bytes to the client, until its stream ends (then the client's side
/// is shut down); how many.
async fn to_client(mut wr: Writer, mut down: StreamBody) -> u64 {
    let mut total = 0u64;
    while let Some(Ok(frame)) = down.frame().await {
        if let Some(data) = frame.data_ref() {
            total += data.len() as u64;
            if wr.write_all(data).await.is_err() {
                break;
            }
        }
    }
    let _ = wr.shutdown().await;
    total
}

//! The ingress (DESIGN §1): the only place TCP and HTTP are terminated. It parses a
//! request once into the structured head (method, path, query, host, headers), routes
//! it by host and path to a node that runs the service, and hands the head to that
//! node's DPU proxy over the fabric while the body waits in registered memory for the
//! proxy to read into the service's host pool. The response (head and body) comes back
//! the same way and is written to the client.
//!
//! Strict by construction: hyper's parser refuses conflicting `Content-Length` /
//! `Transfer-Encoding`, obfuscated or unknown transfer codings and invalid header
//! bytes; heads above `max_head` get 431, bodies above `max_body` 413 (before a byte
//! of them is read when `Content-Length` says so), a body not received within
//! `body_timeout` 408, no answer within `request_timeout` 504. Nothing downstream
//! parses HTTP again: the proxy and the service get the head as fields and the body
//! with its exact length, so a request cannot be read two ways (no smuggling).

mod uplink;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use dpumesh_dpa::fabric::Fabric;
use dpumesh_head::RequestHead;
use dpumesh_head::wire;
use dpumesh_proxy::config::{LoadedConfig, ProxyConfig};
use dpumesh_proxy::routes::{RouteTable, strip_port};
use http::{HeaderValue, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::TcpListener;

pub use uplink::{Answer, Call, Slot, Slots, Uplink};

/// How the ingress runs.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Where clients connect.
    pub listen: SocketAddr,
    /// Largest request head.
    pub max_head: usize,
    /// Largest request or response body.
    pub max_body: usize,
    /// Time to receive a request body.
    pub body_timeout: Duration,
    /// Time to get an answer.
    pub request_timeout: Duration,
    /// Requests in flight at once.
    pub slots: u32,
    /// The policy file (its routes say which service a request is for).
    pub policy: PathBuf,
    /// Fabric addresses of the nodes running each service.
    pub services: BTreeMap<String, Vec<SocketAddr>>,
}

struct State {
    settings: Settings,
    config: ProxyConfig,
    routes: RouteTable,
    uplink: Uplink,
    rr: AtomicUsize,
}

/// A running ingress.
pub struct Ingress {
    addr: SocketAddr,
    runtime: Option<tokio::runtime::Runtime>,
}

impl std::fmt::Debug for Ingress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ingress").field("addr", &self.addr).finish()
    }
}

impl Ingress {
    /// Starts listening; requests go out over `fabric`.
    pub fn start<F: Fabric>(fabric: F, settings: Settings) -> anyhow::Result<Self> {
        let loaded = LoadedConfig::read(&settings.policy)?;
        let routes = RouteTable::new(&loaded.config, |_| Some(0));
        let uplink = Uplink::start(fabric, settings.slots.max(1), settings.max_body as u64)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("dpumesh-ingress")
            .enable_all()
            .build()?;
        let listener = runtime
            .block_on(TcpListener::bind(settings.listen))
            .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", settings.listen))?;
        let addr = listener.local_addr()?;
        let state = Arc::new(State {
            settings,
            config: loaded.config,
            routes,
            uplink,
            rr: AtomicUsize::new(0),
        });
        runtime.spawn(serve(listener, state));
        Ok(Self {
            addr,
            runtime: Some(runtime),
        })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Ingress {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_timeout(Duration::from_secs(1));
        }
    }
}

async fn serve(listener: TcpListener, state: Arc<State>) {
    loop {
        let Ok((stream, peer)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let state = state.clone();
        let max_head = state.settings.max_head;
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let state = state.clone();
                async move { Ok::<_, Infallible>(handle(&state, req, peer).await) }
            });
            let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            builder
                .http1()
                .timer(TokioTimer::new())
                .max_buf_size(max_head)
                .header_read_timeout(Duration::from_secs(10));
            builder.http2().max_header_list_size(max_head as u32);
            let _ = builder
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

fn text(status: StatusCode, message: impl std::fmt::Display) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(format!("dpumesh: {message}\n"))));
    *response.status_mut() = status;
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain"),
    );
    response
}

/// The head of `req` as the mesh carries it: the proxy listener's, without the
/// hop-by-hop and framing headers (the body's exact length travels with it).
fn head_of(req: &Request<Incoming>, peer: SocketAddr) -> Result<RequestHead, String> {
    let mut head = dpumesh_proxy::listener::head_of(req, peer)?;
    let mut headers = head.take_headers();
    for name in dpumesh_head::HOP_BY_HOP {
        headers.remove(name);
    }
    head.set_headers(headers);
    Ok(head)
}

impl State {
    /// The service for a request and the node to send it to (round robin).
    fn route(&self, head: &RequestHead) -> Option<(String, SocketAddr)> {
        let host = strip_port(&head.authority);
        let service = if self.config.services.contains_key(host) {
            host.to_owned()
        } else {
            self.routes
                .find(&head.authority, &head.path)?
                .service
                .to_owned()
        };
        let nodes = self.settings.services.get(&service)?;
        if nodes.is_empty() {
            return None;
        }
        let n = self.rr.fetch_add(1, Ordering::Relaxed);
        Some((service, nodes[n % nodes.len()]))
    }
}

/// Why a request's framing is ambiguous (RFC 9112 §6.3: a message with both
/// `Transfer-Encoding` and `Content-Length` "ought to be handled as an error"; a
/// front end and a back end reading it two ways is request smuggling).
fn framing_error(req: &Request<Incoming>) -> Option<String> {
    let h = req.headers();
    let te = h.get_all(http::header::TRANSFER_ENCODING).iter().count();
    let cl = h.get_all(http::header::CONTENT_LENGTH).iter().count();
    if te > 0 && cl > 0 {
        return Some("both Content-Length and Transfer-Encoding: ambiguous framing refused".into());
    }
    if cl > 1 {
        return Some("several Content-Length fields: ambiguous framing refused".into());
    }
    if te > 1 {
        return Some("several Transfer-Encoding fields: ambiguous framing refused".into());
    }
    if let Some(v) = h.get(http::header::TRANSFER_ENCODING)
        && !v.as_bytes().eq_ignore_ascii_case(b"chunked")
    {
        return Some(format!(
            "transfer coding {:?} is not supported (only chunked)",
            String::from_utf8_lossy(v.as_bytes())
        ));
    }
    None
}

async fn handle(state: &State, req: Request<Incoming>, peer: SocketAddr) -> Response<Full<Bytes>> {
    let settings = &state.settings;
    if let Some(e) = framing_error(&req) {
        let mut response = text(StatusCode::BAD_REQUEST, e);
        // The rest of the connection cannot be trusted: close it.
        response
            .headers_mut()
            .insert(http::header::CONNECTION, HeaderValue::from_static("close"));
        return response;
    }
    let head = match head_of(&req, peer) {
        Ok(h) => h,
        Err(e) => return text(StatusCode::BAD_REQUEST, e),
    };
    let Some((service, node)) = state.route(&head) else {
        return text(
            StatusCode::NOT_FOUND,
            format!(
                "no route for host {:?} path {:?}",
                head.authority, head.path
            ),
        );
    };
    // Refuse what cannot fit before reading a byte of it.
    if let Some(len) = req
        .headers()
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        && len > settings.max_body as u64
    {
        return text(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "request body of {len} bytes exceeds the {}-byte limit",
                settings.max_body
            ),
        );
    }
    let head_bytes = match wire::encode_request(&head) {
        Ok(b) if b.len() <= settings.max_head => b,
        Ok(b) => {
            return text(
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                format!(
                    "request head of {} bytes exceeds the {}-byte limit",
                    b.len(),
                    settings.max_head
                ),
            );
        }
        Err(e) => return text(StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE, e),
    };
    let slots = state.uplink.slots().clone();
    let slot = match tokio::time::timeout(settings.request_timeout, slots.acquire()).await {
        Ok(slot) => slot,
        Err(_) => return text(StatusCode::SERVICE_UNAVAILABLE, "ingress is at capacity"),
    };
    // The body goes straight into the slot's registered buffer.
    let mut body = req.into_body();
    let mut len: u64 = 0;
    let read = async {
        while let Some(frame) = body.frame().await {
            let frame =
                frame.map_err(|e| (StatusCode::BAD_REQUEST, format!("bad request body: {e}")))?;
            if let Ok(data) = frame.into_data() {
                if len + data.len() as u64 > settings.max_body as u64 {
                    return Err((
                        StatusCode::PAYLOAD_TOO_LARGE,
                        format!("request body exceeds the {}-byte limit", settings.max_body),
                    ));
                }
                slots
                    .write(&slot, len, &data)
                    .map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e))?;
                len += data.len() as u64;
            }
        }
        Ok(())
    };
    match tokio::time::timeout(settings.body_timeout, read).await {
        Ok(Ok(())) => {}
        Ok(Err((status, message))) => return text(status, message),
        Err(_) => {
            return text(
                StatusCode::REQUEST_TIMEOUT,
                format!(
                    "request body not received within {} ms",
                    settings.body_timeout.as_millis()
                ),
            );
        }
    }
    let (reply, answer) = tokio::sync::oneshot::channel();
    state.uplink.call(Call {
        node,
        slot,
        head: head_bytes,
        body_len: len as u32,
        deadline: settings.request_timeout,
        reply,
    });
    // The node answers 504 itself at the deadline; this is the guard if it cannot.
    let answer =
        match tokio::time::timeout(settings.request_timeout + Duration::from_secs(2), answer).await
        {
            Ok(Ok(Ok(answer))) => answer,
            Ok(Ok(Err(e))) => return text(StatusCode::BAD_GATEWAY, e),
            Ok(Err(_)) => return text(StatusCode::BAD_GATEWAY, "the uplink dropped the request"),
            Err(_) => {
                return text(
                    StatusCode::GATEWAY_TIMEOUT,
                    format!("service {service:?} did not answer in time"),
                );
            }
        };
    respond(answer)
}

/// The client's response from a node's answer. The service's head is checked again
/// here: a pod is not trusted to write well-formed bytes.
fn respond(answer: Answer) -> Response<Full<Bytes>> {
    let head = match wire::decode_response(&answer.head) {
        Ok(h) => h,
        Err(e) => {
            return text(
                StatusCode::BAD_GATEWAY,
                format!("malformed response head: {e}"),
            );
        }
    };
    let Ok(status) = StatusCode::from_u16(head.status) else {
        return text(
            StatusCode::BAD_GATEWAY,
            format!("bad status {}", head.status),
        );
    };
    let mut response = Response::new(Full::new(answer.body));
    *response.status_mut() = status;
    for (name, value) in &head.headers {
        if matches!(
            name.as_str(),
            "content-length"
                | "transfer-encoding"
                | "connection"
                | "keep-alive"
                | "te"
                | "upgrade"
                | "proxy-connection"
        ) {
            continue;
        }
        response.headers_mut().append(name.clone(), value.clone());
    }
    response
}

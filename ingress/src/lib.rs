//! The ingress: the only place TCP and HTTP are terminated. It parses a
//! request once into the structured head (method, path, query, host, headers), routes
//! it by host and path to a node that runs the service, and hands the head to that
//! node's DPU proxy over the fabric while the body waits in registered memory for the
//! proxy to read into the service's host pool. The response (head and body) comes back
//! the same way and is written to the client.
//!
//! Strict by construction: hyper's parser refuses conflicting `Content-Length`s,
//! obfuscated or unknown transfer codings and invalid header bytes; a request with
//! both `Content-Length` and `Transfer-Encoding` (which hyper would read as chunked)
//! is found by [`framing`] and refused with 400 and `connection: close`; paths are
//! normalized ([`path`]) before anything matches them; heads above `max_head` get 431, bodies above `max_body` 413 (before a byte
//! of them is read when `Content-Length` says so), a body not received within
//! `body_timeout` 408, no answer within `request_timeout` 504. Nothing downstream
//! parses HTTP again: the proxy and the service get the head as fields and the body
//! with its exact length, so a request cannot be read two ways (no smuggling).

/// `AsyncWrite` for a reader's wrapper (`framing::Sniff`, `idle::Watched`): writes go
/// through to its `inner` unchanged.
macro_rules! write_through {
    ($wrapper:ident) => {
        impl<T: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for $wrapper<T> {
            fn poll_write(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
                buf: &[u8],
            ) -> std::task::Poll<std::io::Result<usize>> {
                std::pin::Pin::new(&mut self.inner).poll_write(cx, buf)
            }
            fn poll_write_vectored(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
                bufs: &[std::io::IoSlice<'_>],
            ) -> std::task::Poll<std::io::Result<usize>> {
                std::pin::Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
            }
            fn is_write_vectored(&self) -> bool {
                self.inner.is_write_vectored()
            }
            fn poll_flush(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<std::io::Result<()>> {
                std::pin::Pin::new(&mut self.inner).poll_flush(cx)
            }
            fn poll_shutdown(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<std::io::Result<()>> {
                std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
            }
        }
    };
}
pub(crate) use write_through;

pub mod admin;
mod body;
pub mod eject;
pub mod fair;
pub mod framing;
mod header_timer;
mod idle;
mod routes;
pub mod tls;
mod traced;
mod tunnel;
mod upload;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use bytes::Bytes;
use dpumesh_dpa::fabric::Fabric;
use dpumesh_error::{ErrorKind, ProxyError};
use dpumesh_head::RequestHead;
use dpumesh_head::whole_body::WholeBody;

use crate::body::ClientBody;
use dpumesh_head::wire;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;

pub use dpumesh_fabric_client::health;
use dpumesh_fabric_client::{Answer, Client};

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
    /// Time to receive a request head once its first byte came (slow clients), and
    /// the first one from the accept.
    pub header_timeout: Duration,
    /// How long a client connection with no request open is kept.
    pub idle_timeout: Duration,
    /// How long an HTTP/1 connection with no request open keeps its buffers before
    /// it is parked (`idle`).
    pub park_after: Duration,
    /// Most header fields in a request head (more: 431).
    pub max_headers: usize,
    /// Time to get an answer.
    pub request_timeout: Duration,
    /// Requests in flight at once (split over the threads).
    pub slots: u32,
    /// Of those, how many one client address may hold at once (across the threads).
    pub slots_per_client: u32,
    /// Threads, each a shard with its own listener, connections and links to every
    /// node (default: the machine's cores).
    pub threads: Option<usize>,
    /// The policy file (its routes say which service a request is for).
    pub policy: PathBuf,
    /// Fabric addresses of the nodes running each service.
    pub services: BTreeMap<String, Vec<SocketAddr>>,
    /// Where the admin API listens (`/healthz`, `/readyz`, `/nodes`, `/metrics`), if
    /// anywhere.
    pub admin: Option<SocketAddr>,
    /// How request paths are normalized.
    pub path: dpumesh_config::PathConfig,
    /// Services that route around the nodes the Pingmesh analyzer judges
    /// unreachable, and where to ask it.
    pub eject: Option<eject::EjectSettings>,
    /// HTTPS for clients (none: plaintext HTTP/1.1 and h2c).
    pub tls: Option<tls::TlsSettings>,
}

pub use dpumesh_head::path::ORIGINAL_PATH_METADATA;

/// What every shard reads: settings and routes.
struct Routing {
    settings: Settings,
    /// The policy's routes: the only way in (a host naming a service is no route);
    /// reloaded when the policy file changes.
    routes: Arc<routes::Routes>,
    /// Round robin over a service's nodes.
    next_node: AtomicUsize,
    /// Nodes the Pingmesh analyzer judges unreachable (opted-in services avoid them).
    ejected: Option<Arc<eject::Ejected>>,
    /// The slots each client address holds.
    share: Arc<fair::ClientShare>,
    /// The ingress is stopping: new requests are refused (503), those in flight
    /// finish within the drain grace.
    draining: std::sync::atomic::AtomicBool,
    /// TLS for clients, when configured.
    tls: Option<Arc<tls::Terminator>>,
    /// The span exporter, when OpenTelemetry's environment names a collector.
    traces: Option<Arc<dpumesh_traces::Exporter>>,
}

/// A shard's view: the shared routing and its own fabric side.
struct State<F: Fabric> {
    routing: Arc<Routing>,
    fabric: Rc<Client<F>>,
    /// hyper's header-read timeouts of this thread's connections.
    header_timer: header_timer::HeaderTimer,
}

/// A running ingress.
pub struct Ingress {
    addr: SocketAddr,
    health: Arc<health::Health>,
    admin: Option<admin::Admin>,
    _eject: Option<eject::Poller>,
    stops: Vec<tokio::sync::oneshot::Sender<()>>,
    threads: Vec<JoinHandle<()>>,
    /// The certificate reloader's stop and thread.
    reloader: Option<(crossbeam_channel::Sender<()>, JoinHandle<()>)>,
    /// The policy file's watcher (routes): its stop and thread.
    route_watcher: Option<(crossbeam_channel::Sender<()>, JoinHandle<()>)>,
}

impl std::fmt::Debug for Ingress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ingress").field("addr", &self.addr).finish()
    }
}

/// A listener on `addr` that other threads may bind too (`SO_REUSEPORT`: the kernel
/// spreads connections over them).
fn listener(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    use rustix::net::{AddressFamily, SocketType, sockopt};
    let family = if addr.is_ipv4() {
        AddressFamily::INET
    } else {
        AddressFamily::INET6
    };
    let fd = rustix::net::socket_with(
        family,
        SocketType::STREAM,
        rustix::net::SocketFlags::CLOEXEC,
        None,
    )?;
    sockopt::set_socket_reuseaddr(&fd, true)?;
    sockopt::set_socket_reuseport(&fd, true)?;
    rustix::net::bind(&fd, &addr)?;
    rustix::net::listen(&fd, 1024)?;
    Ok(std::net::TcpListener::from(fd))
}

impl Ingress {
    /// Starts the shard threads; requests go out over `fabric` (each thread makes its
    /// own links with it).
    pub fn start<F: Fabric + Clone>(fabric: F, settings: Settings) -> anyhow::Result<Self> {
        let routes = Arc::new(routes::Routes::load(&settings.policy)?);
        let threads = settings
            .threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
            .max(1);
        // The first listener picks the port (when 0); the others join it.
        let first = listener(settings.listen)
            .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", settings.listen))?;
        let addr = first.local_addr()?;
        let mut listeners = vec![first];
        for _ in 1..threads {
            listeners
                .push(listener(addr).map_err(|e| anyhow::anyhow!("cannot listen on {addr}: {e}"))?);
        }
        let slots = (settings.slots.max(1) as usize).div_ceil(threads) as u32;
        let slot_size = settings.max_body as u64;
        let health = Arc::new(health::Health::new(
            settings.services.values().flatten().copied(),
        ));
        let admin = match settings.admin {
            Some(at) => Some(admin::Admin::start(at, health.clone(), fabric.clone())?),
            None => None,
        };
        let (ejected, eject_poller) = match settings.eject.clone() {
            Some(e) => {
                let (ejected, poller) = eject::start(e)?;
                (Some(ejected), Some(poller))
            }
            None => (None, None),
        };
        let terminator = match settings.tls.clone() {
            Some(t) => Some(
                tls::Terminator::load(t, std::time::SystemTime::now())
                    .map_err(|e| anyhow::anyhow!("ingress TLS: {e}"))?,
            ),
            None => None,
        };
        let reloader = match &terminator {
            Some(t) => Some(tls::spawn_reloader(t.clone())?),
            None => None,
        };
        let route_watcher = Some(routes::spawn_watcher(routes.clone())?);
        let routing = Arc::new(Routing {
            tls: terminator,
            share: fair::ClientShare::new(settings.slots_per_client),
            settings,
            routes,
            next_node: AtomicUsize::new(0),
            ejected,
            draining: std::sync::atomic::AtomicBool::new(false),
            traces: dpumesh_traces::Exporter::from_env("dpumesh-ingress").map(Arc::new),
        });
        let mut stops = Vec::new();
        let mut handles = Vec::new();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<anyhow::Result<()>>();
        for (i, listener) in listeners.into_iter().enumerate() {
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let (fabric, routing, ready) = (fabric.clone(), routing.clone(), ready_tx.clone());
            let health = health.clone();
            let failed = ready_tx.clone();
            let handle = std::thread::Builder::new()
                .name(format!("dpumesh-ingress-{i}"))
                .spawn(move || {
                    let run = || -> anyhow::Result<()> {
                        let rt = tokio::runtime::Builder::new_current_thread()
                            .enable_all()
                            .build()?;
                        let local = tokio::task::LocalSet::new();
                        let client = Client::new("ingress", fabric, slots, slot_size, health)?;
                        local.block_on(&rt, async move {
                            listener.set_nonblocking(true)?;
                            let listener = TcpListener::from_std(listener)?;
                            client.spawn_pump();
                            let _ = ready.send(Ok(()));
                            let state = Rc::new(State {
                                routing,
                                fabric: client,
                                header_timer: header_timer::HeaderTimer::start(),
                            });
                            tokio::select! {
                                () = serve(listener, state.clone()) => {}
                                _ = stopped => {}
                            }
                            drain(&state).await;
                            Ok::<_, anyhow::Error>(())
                        })?;
                        Ok(())
                    };
                    if let Err(e) = run() {
                        tracing::error!(error = %e, "ingress shard stopped");
                        // Heard only while starting; later, the log says it.
                        let _ = failed.send(Err(e));
                    }
                })?;
            stops.push(stop);
            handles.push(handle);
        }
        drop(ready_tx);
        for _ in 0..threads {
            match ready_rx.recv() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(e),
                Err(_) => anyhow::bail!("an ingress shard failed to start (see its log)"),
            }
        }
        Ok(Self {
            addr,
            health,
            admin,
            _eject: eject_poller,
            stops,
            threads: handles,
            reloader,
            route_watcher,
        })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Where the admin API listens.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin.as_ref().map(admin::Admin::addr)
    }

    /// What the ingress knows of its nodes.
    pub fn health(&self) -> &Arc<health::Health> {
        &self.health
    }
}

impl Drop for Ingress {
    fn drop(&mut self) {
        for stop in self.stops.drain(..) {
            let _ = stop.send(());
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        for (stop, thread) in [self.reloader.take(), self.route_watcher.take()]
            .into_iter()
            .flatten()
        {
            let _ = stop.send(());
            let _ = thread.join();
        }
    }
}

/// Stops a shard gracefully: no new connections (the listener went with `serve`), new
/// requests on open connections refused, requests in flight given until the grace
/// (the request timeout, at most 5 s) to finish; what is left is answered 503.
async fn drain<F: Fabric>(state: &State<F>) {
    state
        .routing
        .draining
        .store(true, std::sync::atomic::Ordering::Relaxed);
    let grace = state
        .routing
        .settings
        .request_timeout
        .min(Duration::from_secs(5));
    let deadline = tokio::time::Instant::now() + grace;
    while state.fabric.in_flight() > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    state.fabric.fail_all(&ProxyError::new(
        ErrorKind::ShuttingDown,
        "the ingress is shutting down",
    ));
    // Let the handlers write those answers before the runtime ends.
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
}

/// Runs futures on the current thread's local task set (hyper's HTTP/2 streams).
#[derive(Clone, Copy)]
struct LocalExec;

impl<F> hyper::rt::Executor<F> for LocalExec
where
    F: std::future::Future + 'static,
{
    fn execute(&self, fut: F) {
        tokio::task::spawn_local(fut);
    }
}

async fn serve<F: Fabric>(listener: TcpListener, state: Rc<State<F>>) {
    loop {
        let Ok((stream, peer)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let state = state.clone();
        tokio::task::spawn_local(async move {
            let Some(terminator) = state.routing.tls.clone() else {
                return connection(stream, state, peer, None).await;
            };
            // The handshake is bounded as a head is: a client that opens and stalls
            // holds nothing for longer.
            let accept = tokio_rustls::TlsAcceptor::from(terminator.config()).accept(stream);
            match tokio::time::timeout(state.routing.settings.header_timeout, accept).await {
                Ok(Ok(stream)) => {
                    let session = tls::Session::of(stream.get_ref().1);
                    connection(stream, state, peer, Some(Rc::new(session))).await;
                }
                Ok(Err(e)) => {
                    metrics::counter!("dpumesh_ingress_tls_handshake_failures_total", "reason" => "handshake")
                        .increment(1);
                    tracing::debug!(%peer, error = %e, "TLS handshake failed");
                }
                Err(_) => {
                    metrics::counter!("dpumesh_ingress_tls_handshake_failures_total", "reason" => "timeout")
                        .increment(1);
                }
            }
        });
    }
}

/// A client stream the ingress can wait on bare while its connection is parked
/// (`idle`).
pub(crate) trait Parkable:
    tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static
{
    /// Ready when the client sent something or closed (or for nothing: the
    /// connection is then parked again at once).
    fn readable(&self) -> impl std::future::Future<Output = std::io::Result<()>> + '_;
}

impl Parkable for tokio::net::TcpStream {
    fn readable(&self) -> impl std::future::Future<Output = std::io::Result<()>> + '_ {
        tokio::net::TcpStream::readable(self)
    }
}

/// rustls holds no record hyper could have read when the connection was parked (its
/// last read was pending): the socket says when one comes.
impl Parkable for tokio_rustls::server::TlsStream<tokio::net::TcpStream> {
    fn readable(&self) -> impl std::future::Future<Output = std::io::Result<()>> + '_ {
        self.get_ref().0.readable()
    }
}

/// Serves one client connection (plaintext, or TLS with its `session`) until it
/// closes: with hyper while requests come, parked between them once idle for
/// `park_after` (`idle`'s doc).
async fn connection<F: Fabric, IO: Parkable>(
    mut stream: IO,
    state: Rc<State<F>>,
    peer: SocketAddr,
    session: Option<Rc<tls::Session>>,
) {
    let timeouts = timeouts(&state.routing.settings);
    let activity = idle::Activity::new();
    let mut resumed = false;
    loop {
        let dock: idle::Dock<IO> = Arc::new(parking_lot::Mutex::new(None));
        // Boxed: hyper's connection (its buffers, and its state inline in this
        // future) is allocated while it serves and freed when it is parked; the task
        // of a parked connection holds the stream and its clock.
        Box::pin(served(
            stream,
            state.clone(),
            peer,
            session.clone(),
            &activity,
            dock.clone(),
            resumed,
        ))
        .await;
        let Some(parked) = dock.lock().take() else {
            return;
        };
        stream = parked;
        let gauge = metrics::gauge!("dpumesh_ingress_connections_parked");
        gauge.increment(1.0);
        let idle_out =
            hyper::rt::Timer::sleep_until(&state.header_timer, activity.idle_deadline(timeouts));
        let woke = tokio::select! {
            r = stream.readable() => r.is_ok(),
            () = idle_out => {
                idle::timed_out(idle::Why::Idle);
                false
            }
        };
        gauge.decrement(1.0);
        if !woke {
            // Closed as hyper would have: a TLS stream says close_notify. Bounded: a
            // client that reads nothing cannot hold it.
            let _ = tokio::time::timeout(
                Duration::from_secs(1),
                tokio::io::AsyncWriteExt::shutdown(&mut stream),
            )
            .await;
            return;
        }
        resumed = true;
    }
}

/// A connection's clocks, from the settings.
fn timeouts(settings: &Settings) -> idle::Timeouts {
    idle::Timeouts {
        head: settings.header_timeout,
        idle: settings.idle_timeout,
        park: settings.park_after,
    }
}

/// One hyper connection over `stream`, until the client closes it, it is cut off, or
/// it is parked (the stream left in `dock`).
async fn served<F: Fabric, IO: Parkable>(
    stream: IO,
    state: Rc<State<F>>,
    peer: SocketAddr,
    session: Option<Rc<tls::Session>>,
    activity: &Arc<idle::Activity>,
    dock: idle::Dock<IO>,
    resumed: bool,
) {
    let settings = &state.routing.settings;
    let (max_head, max_headers) = (settings.max_head, settings.max_headers);
    // Which HTTP/1 requests on this connection had both framings (hyper drops the
    // Content-Length before the handler could see it).
    // Shared with the connection's reader, which an upgrade (a WebSocket) hands to
    // hyper as a `Send` stream.
    let ambiguous = Arc::new(parking_lot::Mutex::new(framing::Ambiguous::default()));
    let stream = framing::Sniff::new(stream, framing::Tracker::new(max_head, ambiguous.clone()));
    // The reader times heads and idle spells (hyper's own header timer would also
    // close a kept-alive connection between requests), and parks the connection.
    let stream = idle::Watched::new(
        stream,
        activity.clone(),
        state.header_timer.clone(),
        timeouts(settings),
        dock,
        resumed,
    );
    let activity = activity.clone();
    let alpn = session.as_ref().map_or(tls::Alpn::None, |s| s.alpn);
    let served = std::cell::Cell::new(0u64);
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let state = state.clone();
        let session = session.clone();
        let index = served.replace(served.get() + 1);
        // Every HTTP/1.x request is judged (1.0 too); HTTP/2's are framed by
        // their own protocol.
        let refused = if req.version() < http::Version::HTTP_2 {
            ambiguous.lock().verdict(index)
        } else {
            None
        };
        let open = activity.open();
        let activity = activity.clone();
        let connect = req.method() == http::Method::CONNECT;
        // Boxed: hyper moves the service's future into each HTTP/2 stream's task
        // (and HTTP/1's dispatcher holds it inline), and `handle`'s future is
        // 3 KiB: one allocation costs less than copying it on every move.
        Box::pin(async move {
            let response = handle(&state, req, peer, session.as_deref(), refused).await;
            let status = response.status();
            if status == StatusCode::SWITCHING_PROTOCOLS || (connect && status.is_success()) {
                activity.tunnel();
            }
            Ok::<_, Infallible>(response.map(|body| idle::Answered::new(body, open)))
        })
    });
    let mut builder = hyper_util::server::conn::auto::Builder::new(LocalExec);
    builder
        .http1()
        .max_buf_size(max_head)
        .max_headers(max_headers)
        // Timed by the reader (`idle`).
        .header_read_timeout(None);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(max_head as u32);
    // What ALPN agreed is what is spoken (a client that said http/1.1 does not get
    // HTTP/2 by sending its preface, nor the reverse).
    // A parked connection was HTTP/1, and stays so.
    let builder = match alpn {
        tls::Alpn::H2 => builder.http2_only(),
        tls::Alpn::Http1 => builder.http1_only(),
        tls::Alpn::None if resumed => builder.http1_only(),
        tls::Alpn::None => builder,
    };
    let _ = builder
        .serve_connection_with_upgrades(TokioIo::new(stream), service)
        .await;
}

/// A request body of a stated length below this is read whole before it is sent;
/// a longer one, or one of no stated length that is not all there at once, streams.
const WHOLE_BELOW: u64 = 1 << 20;

/// Turns of the runtime a body of no stated length is given to come whole with its
/// head before it streams.
const EAGER_TURNS: u32 = 2;

/// How long a body of which nothing came in those turns is waited for, once. A unary
/// gRPC call sends its message right after its head, but on a loaded machine the
/// frame can trail it past a couple of turns; streamed, the call could not be retried
/// (its body is no longer at hand). A call that sends nothing before the server's
/// first message pays this once, at its start.
const EAGER_WAIT: Duration = Duration::from_millis(5);

/// The future's output if it is ready now (it is polled once, with a waker that
/// does nothing: a future that was not ready is dropped, and whatever it registered
/// is polled again by its next poll).
pub(crate) fn futures_now<T>(fut: impl std::future::Future<Output = T>) -> Option<T> {
    let mut fut = std::pin::pin!(fut);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match fut.as_mut().poll(&mut cx) {
        std::task::Poll::Ready(v) => Some(v),
        std::task::Poll::Pending => None,
    }
}

/// The client's answer for a request the mesh could not serve: as gRPC (a
/// trailers-only answer, [`dpumesh_head::grpc::local_reply`]) to a gRPC caller.
fn error_response(e: &ProxyError, grpc: bool) -> Response<ClientBody> {
    metrics::counter!(
        "dpumesh_ingress_errors_total",
        "source" => e.source().name(),
        "status" => e.status().to_string(),
    )
    .increment(1);
    let (head, body) = if grpc {
        let head = dpumesh_head::grpc::local_reply(&e.response_head(), &e.body());
        (head, Bytes::new())
    } else {
        (e.response_head(), Bytes::from(e.body()))
    };
    let mut response = Response::new(WholeBody::bytes(body).into());
    *response.status_mut() =
        StatusCode::from_u16(head.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    *response.headers_mut() = head.headers;
    response
}

/// How long the ingress waits for the answer: the configured request timeout, or a
/// gRPC call's `grpc-timeout` when shorter (a malformed one is a malformed request).
fn answer_timeout(headers: &http::HeaderMap, limit: Duration) -> Result<Duration, ProxyError> {
    let Some(v) = headers.get("grpc-timeout") else {
        return Ok(limit);
    };
    let text = v.to_str().unwrap_or("\u{fffd}");
    let t = dpumesh_head::grpc::parse_timeout(text)
        .map_err(|e| ProxyError::new(ErrorKind::MalformedRequest, e.to_string()))?;
    Ok(t.min(limit))
}

/// Request targets the ingress refuses (RFC 9112 §3.2, RFC 9113 §8.3.1):
/// - a `CONNECT` without an authority (`host:port`) to tunnel to: 400 (with one, it
///   is a tunnel to the service its route names: [`tunnel`]);
/// - a path that does not start with `/` (HTTP/2's `:path: admin`, HTTP/1's
///   `GET host:80`): 400. Origin-form is what routes, filters and services read, and a
///   path without its slash would miss a `path_prefix: /` rule that a service,
///   adding the slash back, would then serve;
/// - asterisk-form (`*`) passes with `OPTIONS` only (and no route serves it).
///
/// Absolute-form (`GET http://host/path`) is taken as origin-form with its authority
/// for the host ([`RequestHead::from_request`] replaces `Host` with it, §3.2.2).
fn target_error(req: &Request<Incoming>) -> Option<ProxyError> {
    if req.method() == http::Method::CONNECT {
        return match req.uri().authority() {
            Some(a) if a.port_u16().is_some() => None,
            _ => Some(ProxyError::new(
                ErrorKind::MalformedRequest,
                "a CONNECT names the host:port to tunnel to",
            )),
        };
    }
    let path = req.uri().path();
    if path.starts_with('/') || (path == "*" && req.method() == http::Method::OPTIONS) {
        return None;
    }
    Some(ProxyError::new(
        ErrorKind::MalformedRequest,
        format!("request target {path:?} is not a path: it must start with '/'"),
    ))
}

/// The head of `req` as the mesh carries it: every field as received but the
/// hop-by-hop and framing headers (the body's exact length travels with it) and the
/// mesh's own (`x-dpumesh-*`, which no client may say for it), with this hop recorded
/// in `x-forwarded-for` and `x-forwarded-proto`.
fn head_of(
    req: &Request<Incoming>,
    peer: SocketAddr,
    session: Option<&tls::Session>,
) -> Result<RequestHead, ProxyError> {
    let mut head = RequestHead::from_request(req, peer)
        .map_err(|e| ProxyError::new(ErrorKind::MalformedRequest, e.to_string()))?;
    if let Some(session) = session {
        // What this hop served, not what the client says (`:scheme` is not believed).
        head.scheme = "https".to_owned();
        // A principal the client's verified certificate names: the node believes it
        // from the ingress only (`trust_claims`).
        head.source.identity = session.principal.as_deref().map(str::to_owned);
    }
    head.remove_hop_by_hop();
    if head.remove_reserved() > 0 {
        metrics::counter!("dpumesh_ingress_reserved_headers_removed_total").increment(1);
    }
    head.forwarded_from(peer);
    Ok(head)
}

/// Normalizes the head's path ([`RequestHead::normalize_path`]); a path refused is
/// a malformed request (400).
fn normalize_path(
    head: &mut RequestHead,
    config: &dpumesh_config::PathConfig,
) -> Result<(), ProxyError> {
    head.normalize_path(config)
        .map_err(|e| ProxyError::new(ErrorKind::MalformedRequest, format!("{e}: {:?}", head.path)))
}

impl Routing {
    /// The service for a request and the node to send it to. Only the routes choose
    /// the service (as an Istio gateway routes only what a VirtualService exposes): a
    /// `Host` naming an internal service finds no route unless one exposes it. The
    /// node is chosen round robin over the nodes running it, passing over those
    /// `reachable` says not to try now and, for services that opted in, those
    /// Pingmesh judges unreachable (when none is left, the turn's node: its failure is
    /// answered at once).
    fn route(
        &self,
        head: &RequestHead,
        reachable: impl Fn(SocketAddr) -> bool,
    ) -> Option<(String, SocketAddr, dpumesh_config::RoutePolicy)> {
        let table = self.routes.table();
        let found = table.find(&head.authority, &head.path)?;
        let (service, policy) = (found.service.to_owned(), found.policy);
        let nodes = self.settings.services.get(&service)?;
        if nodes.is_empty() {
            return None;
        }
        let n = self.next_node.fetch_add(1, Ordering::Relaxed);
        let avoid = |a: SocketAddr| self.ejected.as_ref().is_some_and(|e| e.avoids(&service, a));
        let node = (0..nodes.len())
            .map(|i| nodes[(n + i) % nodes.len()])
            .find(|&a| reachable(a) && !avoid(a))
            .unwrap_or(nodes[n % nodes.len()]);
        Some((service, node, policy))
    }
}

/// Why a request's framing is refused, beyond what hyper refuses itself: several
/// `Transfer-Encoding` fields, or a coding other than `chunked` alone (hyper only
/// checks that the last one is `chunked`). Both `Content-Length` and
/// `Transfer-Encoding` is found by the framing tracker (hyper hides it); several
/// `Content-Length`s are refused by hyper when they differ and merged when they agree.
fn framing_error(req: &Request<Incoming>) -> Option<ProxyError> {
    let h = req.headers();
    let ambiguous = |m: &str| Some(ProxyError::new(ErrorKind::AmbiguousFraming, m));
    if h.get_all(http::header::TRANSFER_ENCODING).iter().count() > 1 {
        return ambiguous("several Transfer-Encoding fields: ambiguous framing refused");
    }
    if let Some(v) = h.get(http::header::TRANSFER_ENCODING)
        && !v.as_bytes().eq_ignore_ascii_case(b"chunked")
    {
        return ambiguous(&format!(
            "transfer coding {:?} is not supported (only chunked)",
            String::from_utf8_lossy(v.as_bytes())
        ));
    }
    None
}

async fn handle<F: Fabric>(
    state: &State<F>,
    mut req: Request<Incoming>,
    peer: SocketAddr,
    session: Option<&tls::Session>,
    refused: Option<framing::Refusal>,
) -> Response<ClientBody> {
    let traced = state
        .routing
        .traces
        .as_deref()
        .map(|traces| traced::Traced::begin(traces, &mut req, peer));
    let grpc = dpumesh_head::grpc::is_grpc(req.headers());
    // A client may send its tunnel's bytes right after its CONNECT: when no tunnel
    // opens, the rest of an HTTP/1 connection cannot be read as requests.
    let connect_h1 = req.method() == http::Method::CONNECT && req.version() < http::Version::HTTP_2;
    let answer = match refused {
        Some(why) => Err(ProxyError::new(ErrorKind::AmbiguousFraming, why.message())),
        None => forward(state, req, peer, session, grpc).await,
    };
    let mut response = match answer {
        Ok(response) => response,
        Err(e) => error_response(&e, grpc),
    };
    if connect_h1 && !response.status().is_success() {
        response.headers_mut().insert(
            http::header::CONNECTION,
            http::HeaderValue::from_static("close"),
        );
    }
    if let (Some(traced), Some(traces)) = (traced, state.routing.traces.as_deref()) {
        traced.end(traces, response.status().as_u16());
    }
    response
}

/// Routes `req`, reads its body into a slot, sends it to the node and waits for the
/// answer.
async fn forward<F: Fabric>(
    state: &State<F>,
    mut req: Request<Incoming>,
    peer: SocketAddr,
    session: Option<&tls::Session>,
    grpc: bool,
) -> Result<Response<ClientBody>, ProxyError> {
    let settings = &state.routing.settings;
    if state
        .routing
        .draining
        .load(std::sync::atomic::Ordering::Relaxed)
    {
        return Err(ProxyError::new(
            ErrorKind::ShuttingDown,
            "the ingress is shutting down",
        ));
    }
    if let Some(e) = framing_error(&req) {
        return Err(e);
    }
    if let Some(e) = target_error(&req) {
        return Err(e);
    }
    if grpc && !dpumesh_head::grpc::takes_trailers(req.headers()) {
        return Err(ProxyError::new(
            ErrorKind::MalformedRequest,
            "a gRPC call must say `te: trailers`: its status comes in trailers",
        ));
    }
    let timeout = answer_timeout(req.headers(), settings.request_timeout)?;
    let mut head = head_of(&req, peer, session)?;
    normalize_path(&mut head, &settings.path)?;
    // A WebSocket's upgrade is asked for end to end (the service answers it): the
    // one hop-by-hop field kept.
    let tunnel = tunnel::Kind::of(&req);
    if tunnel == Some(tunnel::Kind::WebSocket) {
        let _ = head.append_received("upgrade", "websocket");
    }
    let Some((service, node, policy)) = state
        .routing
        .route(&head, |node| state.fabric.reachable(node))
    else {
        return Err(ProxyError::new(
            ErrorKind::NoRoute,
            format!(
                "no route for host {:?} path {:?}",
                head.authority, head.path
            ),
        ));
    };
    let length = req
        .headers()
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    // A body streams unless its route buffers, or it says it is small (then it is
    // read whole: one descriptor, and a retry has it at hand).
    let may_stream = !policy.buffer_body && length.is_none_or(|n| n > WHOLE_BELOW);
    // Refuse what cannot fit before reading a byte of it.
    if let Some(len) = length
        && !may_stream
        && len > settings.max_body as u64
    {
        return Err(ProxyError::new(
            ErrorKind::BodyTooLarge,
            format!(
                "request body of {len} bytes exceeds the {}-byte limit",
                settings.max_body
            ),
        ));
    }
    if may_stream && let Some(len) = length {
        // The length the client stated (hyper holds the body to it): a service that
        // takes whole bodies refuses one past its limit before a byte of it moves.
        let _ = head.append_received("content-length", &len.to_string());
    }
    let head_bytes = match wire::encode_request(&head) {
        Ok(b) if b.len() <= settings.max_head => b,
        Ok(b) => {
            return Err(ProxyError::new(
                ErrorKind::HeadTooLarge,
                format!(
                    "request head of {} bytes exceeds the {}-byte limit",
                    b.len(),
                    settings.max_head
                ),
            ));
        }
        Err(e) => return Err(ProxyError::new(ErrorKind::HeadTooLarge, e.to_string())),
    };
    let fabric = &state.fabric;
    // Held until the answer is written, as the slot is (and, for a body that
    // streams, until the body is done with).
    let share = state.routing.share.take(peer.ip()).map_err(|held| {
        ProxyError::new(
            ErrorKind::ClientLimit,
            format!(
                "this client has {held} requests in flight, its share of the ingress's slots (ingress.slots_per_client)"
            ),
        )
    })?;
    let slot = tokio::time::timeout(settings.request_timeout, fabric.acquire())
        .await
        .map_err(|_| ProxyError::new(ErrorKind::Overloaded, "ingress is at capacity"))?;
    if let Some(kind) = tunnel {
        // The handshake has no body; after a 101 (a CONNECT's 2xx) the connection's
        // bytes stream both ways (`tunnel`).
        let on_upgrade = hyper::upgrade::on(&mut req);
        drop(req);
        let (answer, upload) = fabric.call_streamed(node, slot, head_bytes, 0, timeout);
        let answer = wait_answer(answer, timeout, &service).await?;
        let idle = policy.stream_idle.unwrap_or(Duration::from_secs(300));
        return tunnel::answer(kind, answer, upload, on_upgrade, idle, share);
    }
    // The body goes straight into the slot's registered buffer.
    let mut body = req.into_body();
    let mut len: u64 = 0;
    let mut trailers = http::HeaderMap::new();
    if may_stream {
        // What came with the head is read now; a body that is all there (a unary
        // gRPC call's message) goes whole; one that is not streams from here.
        let window = u64::from(fabric.stream_window());
        let mut carry = None;
        // hyper reads what the client sent after the head only when the body is
        // polled (and an h2 DATA frame may trail its HEADERS by a moment): a turn of
        // the runtime lets it, so a body sent whole with its head is taken whole.
        let mut turns = 0;
        let mut waited = false;
        let ended = loop {
            let polled = match futures_now(body.frame()) {
                None if turns < EAGER_TURNS => {
                    turns += 1;
                    tokio::task::yield_now().await;
                    continue;
                }
                None if !waited && len == 0 => {
                    waited = true;
                    tokio::time::timeout(EAGER_WAIT, body.frame()).await.ok()
                }
                polled => polled,
            };
            let frame = match polled {
                None => break false,
                Some(None) => break true,
                Some(Some(frame)) => frame.map_err(|e| {
                    ProxyError::new(
                        ErrorKind::MalformedRequest,
                        format!("bad request body: {e}"),
                    )
                })?,
            };
            match frame.into_data() {
                Ok(data) if len + data.len() as u64 > window => {
                    carry = Some(data);
                    break false;
                }
                Ok(data) => {
                    fabric.write(&slot, len, &data)?;
                    len += data.len() as u64;
                }
                Err(frame) => {
                    if let Ok(mut fields) = frame.into_trailers() {
                        dpumesh_head::trailers::keep_allowed(&mut fields);
                        trailers.extend(fields);
                    }
                }
            }
        };
        if !ended {
            metrics::counter!("dpumesh_ingress_streamed_requests_total").increment(1);
            let (answer, upload) =
                fabric.call_streamed(node, slot, head_bytes, len as u32, timeout);
            match upload {
                Some(upload) => {
                    let idle = settings.body_timeout;
                    tokio::task::spawn_local(upload::send_body(upload, body, carry, idle, share));
                    return await_answer(answer, timeout, &service).await;
                }
                // Not sent (the node is unreachable): the answer says why, and the
                // client, perhaps still sending, must be able to read it.
                None => {
                    tokio::task::spawn_local(upload::drain(body));
                    return await_answer(answer, timeout, &service)
                        .await
                        .map(|r| holding(r, share));
                }
            }
        }
        return send_whole(
            fabric, node, slot, &mut head, head_bytes, len, trailers, timeout, settings, &service,
        )
        .await
        .map(|r| holding(r, share));
    }
    let read = async {
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| {
                ProxyError::new(
                    ErrorKind::MalformedRequest,
                    format!("bad request body: {e}"),
                )
            })?;
            let data = match frame.into_data() {
                Ok(data) => data,
                Err(frame) => {
                    if let Ok(mut fields) = frame.into_trailers() {
                        // Sent after the body, so never seen by the chain: only
                        // fields that decide nothing pass (`trailers::allowed`).
                        dpumesh_head::trailers::keep_allowed(&mut fields);
                        trailers.extend(fields);
                    }
                    continue;
                }
            };
            if len + data.len() as u64 > settings.max_body as u64 {
                return Err(ProxyError::new(
                    ErrorKind::BodyTooLarge,
                    format!("request body exceeds the {}-byte limit", settings.max_body),
                ));
            }
            fabric.write(&slot, len, &data)?;
            len += data.len() as u64;
        }
        Ok(())
    };
    // A call's deadline (`grpc-timeout`) bounds the reading of its body too: a client
    // that keeps its request stream open past it is told DEADLINE_EXCEEDED.
    let call_deadline = timeout < settings.request_timeout && timeout < settings.body_timeout;
    let body_limit = if call_deadline {
        timeout
    } else {
        settings.body_timeout
    };
    tokio::time::timeout(body_limit, read).await.map_err(|_| {
        if call_deadline {
            ProxyError::new(
                ErrorKind::Timeout,
                format!(
                    "the call's deadline ({} ms) passed before its body ended",
                    timeout.as_millis()
                ),
            )
        } else {
            ProxyError::new(
                ErrorKind::BodyTimeout,
                format!(
                    "request body not received within {} ms",
                    settings.body_timeout.as_millis()
                ),
            )
        }
    })??;
    send_whole(
        fabric, node, slot, &mut head, head_bytes, len, trailers, timeout, settings, &service,
    )
    .await
    .map(|r| holding(r, share))
}

/// `response` with the client's `share` held by its streamed body until the body is
/// done with (a whole body is written at once: the share goes with this request).
fn holding(mut response: Response<ClientBody>, share: fair::Held) -> Response<ClientBody> {
    if let ClientBody::Stream(_, held) = response.body_mut() {
        *held = Some(share);
    }
    response
}

/// A request whose body (`len` bytes) is in `slot`: sent to `node`, and its answer
/// awaited.
#[allow(clippy::too_many_arguments)]
async fn send_whole<F: Fabric>(
    fabric: &Client<F>,
    node: SocketAddr,
    slot: dpumesh_fabric_client::Slot,
    head: &mut RequestHead,
    head_bytes: Vec<u8>,
    len: u64,
    trailers: http::HeaderMap,
    timeout: Duration,
    settings: &Settings,
    service: &str,
) -> Result<Response<ClientBody>, ProxyError> {
    // Trailers come after the body, so the head was encoded without them: encoded
    // again, for the rare request that has them.
    let head_bytes = if trailers.is_empty() {
        head_bytes
    } else {
        head.trailers = trailers;
        wire::encode_request(head)
            .ok()
            .filter(|b| b.len() <= settings.max_head)
            .ok_or_else(|| {
                ProxyError::new(
                    ErrorKind::HeadTooLarge,
                    format!(
                        "request head with its trailers exceeds the {}-byte limit",
                        settings.max_head
                    ),
                )
            })?
    };
    let answer = fabric.call(node, slot, head_bytes, len as u32, timeout);
    await_answer(answer, timeout, service).await
}

/// Waits for a node's answer and makes it the client's.
async fn await_answer(
    answer: tokio::sync::oneshot::Receiver<Result<Answer, ProxyError>>,
    timeout: Duration,
    service: &str,
) -> Result<Response<ClientBody>, ProxyError> {
    respond(wait_answer(answer, timeout, service).await?)
}

/// Waits for a node's answer: the node answers 504 itself at the deadline; this is
/// the guard if it cannot.
async fn wait_answer(
    answer: tokio::sync::oneshot::Receiver<Result<Answer, ProxyError>>,
    timeout: Duration,
    service: &str,
) -> Result<Answer, ProxyError> {
    let answer = tokio::time::timeout(timeout + Duration::from_secs(2), answer)
        .await
        .map_err(|_| {
            ProxyError::new(
                ErrorKind::Timeout,
                format!("service {service:?} did not answer in time"),
            )
        })?
        .map_err(|_| {
            ProxyError::new(
                ErrorKind::ThreadLost,
                "the ingress shard stopped with the request in flight",
            )
        })??;
    Ok(answer)
}

/// The client's response from a node's answer. The service's head is checked again
/// here: a pod is not trusted to write well-formed bytes.
pub(crate) fn respond(answer: Answer) -> Result<Response<ClientBody>, ProxyError> {
    let head = wire::decode_response(&answer.head).map_err(|e| {
        ProxyError::new(
            ErrorKind::BadResponse,
            format!("malformed response head: {e}"),
        )
    })?;
    let status = StatusCode::from_u16(head.status).map_err(|_| {
        ProxyError::new(
            ErrorKind::BadResponse,
            format!("bad status {}", head.status),
        )
    })?;
    let mut trailers = head.trailers;
    // A pod's trailers meet the same rule as a client's (`trailers::allowed`).
    dpumesh_head::trailers::keep_allowed(&mut trailers);
    let body = match answer.stream {
        // The head came first; the body follows as the service makes it.
        Some(stream) => ClientBody::Stream(stream, None),
        None => WholeBody::new(answer.body, trailers).into(),
    };
    let mut response = Response::new(body);
    *response.status_mut() = status;
    for (name, value) in &head.headers {
        if dpumesh_head::is_hop_by_hop(name.as_str()) {
            continue;
        }
        response.headers_mut().append(name.clone(), value.clone());
    }
    Ok(response)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grpc_timeout_shortens_the_wait_and_a_bad_one_is_refused() {
        let limit = Duration::from_secs(30);
        let with = |v: &str| {
            let mut h = http::HeaderMap::new();
            h.insert("grpc-timeout", http::HeaderValue::from_str(v).unwrap());
            answer_timeout(&h, limit)
        };
        assert_eq!(
            answer_timeout(&http::HeaderMap::new(), limit).unwrap(),
            limit
        );
        assert_eq!(with("250m").unwrap(), Duration::from_millis(250));
        assert_eq!(
            with("5H").unwrap(),
            limit,
            "never longer than the mesh allows"
        );
        let e = with("soon").unwrap_err();
        assert_eq!(e.status(), 400);
        assert!(e.to_string().contains("grpc-timeout"), "{e}");
    }
}

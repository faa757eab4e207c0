//! The control channel over a Unix socket or TCP: a server that runs a [`Handler`] for
//! each request and tells it when a peer goes away (a pod that dies closes its socket:
//! that is how the DPU learns to reclaim its buffers), and a blocking client.

use std::collections::HashMap;
use std::io::Write;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::Mutex;

use super::{
    ControlError, ErrorCode, Frame, PodExports, Request, Response, Role, encode_version_mismatch,
    read_frame, write_frame,
};

mod client;
mod mux;
pub use client::ControlClient;
pub use mux::MuxClient;

/// Where a control channel listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// A Unix socket path (same machine: host and emulated DPU).
    Unix(PathBuf),
    /// A TCP address (host and DPU on different machines, or tests).
    Tcp(SocketAddr),
}

impl FromStr for Endpoint {
    type Err = String;

    /// `unix:PATH`, `tcp:HOST:PORT`, a path (contains `/`) or an address.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(path) = s.strip_prefix("unix:") {
            return Ok(Self::Unix(path.into()));
        }
        if let Some(addr) = s.strip_prefix("tcp:") {
            return addr
                .parse()
                .map(Self::Tcp)
                .map_err(|e| format!("{addr:?} is not a TCP address: {e}"));
        }
        if s.contains('/') {
            return Ok(Self::Unix(s.into()));
        }
        s.parse().map(Self::Tcp).map_err(|_| {
            format!(
                "{s:?} is neither a socket path nor an address (use unix:PATH or tcp:HOST:PORT)"
            )
        })
    }
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Unix(p) => write!(f, "unix:{}", p.display()),
            Self::Tcp(a) => write!(f, "tcp:{a}"),
        }
    }
}

/// One stream, either kind.
#[derive(Debug)]
enum Stream {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Stream {
    fn try_clone(&self) -> std::io::Result<Self> {
        Ok(match self {
            Self::Unix(s) => Self::Unix(s.try_clone()?),
            Self::Tcp(s) => Self::Tcp(s.try_clone()?),
        })
    }

    fn shutdown(&self) {
        let _ = match self {
            Self::Unix(s) => s.shutdown(std::net::Shutdown::Both),
            Self::Tcp(s) => s.shutdown(std::net::Shutdown::Both),
        };
    }
}

impl std::io::Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Self::Unix(s) => s.read(buf),
            Self::Tcp(s) => s.read(buf),
        }
    }
}

impl std::io::Write for Stream {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Self::Unix(s) => s.write(buf),
            Self::Tcp(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Self::Unix(s) => s.flush(),
            Self::Tcp(s) => s.flush(),
        }
    }
}

/// A connection's writing half, locked on its own: a peer that stops reading stalls
/// only its own replies.
type Writer = Arc<Mutex<Stream>>;

/// A peer of the server.
#[derive(Debug, Clone)]
pub struct Peer {
    /// Unique per server.
    pub id: u64,
    /// The role it said in Hello.
    pub role: Role,
    /// The name it said in Hello.
    pub name: String,
    /// The service this connection proved it serves (by registering a pod of it, or
    /// by [`Request::Authenticate`]); what its store keys are namespaced by.
    pub service: Option<String>,
    /// The identity its TLS certificate proved (a TCP peer; `None` on the Unix
    /// socket, where the peer's user is checked instead).
    pub identity: Option<dpumesh_identity::SpiffeId>,
    /// Sends it unsolicited frames (a host agent's [`Response::Wake`]s).
    pub push: Pusher,
}

/// Sends one peer unsolicited frames (id 0), from any thread.
#[derive(Clone)]
pub struct Pusher(Arc<dyn Fn(Response) -> bool + Send + Sync>);

impl std::fmt::Debug for Pusher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Pusher")
    }
}

impl Pusher {
    /// A pusher that hands each frame to `send` (false: the peer is gone).
    pub fn new(send: impl Fn(Response) -> bool + Send + Sync + 'static) -> Self {
        Self(Arc::new(send))
    }

    /// One that drops everything (a peer that takes no pushes).
    pub fn none() -> Self {
        Self::new(|_| false)
    }

    /// Sends `response` as an unsolicited frame; false if the peer is gone.
    pub fn push(&self, response: Response) -> bool {
        (self.0)(response)
    }
}

/// Writes an unsolicited frame on connection `id`. It is called from a shard's
/// thread (a `Wake` after a batch), so it tries a non-blocking send first: a frame
/// is 21 bytes and the socket buffer has room unless the peer stopped reading, and
/// only then does it wait (up to the write timeout) for the rest.
fn push_frame(conns: &Mutex<HashMap<u64, Writer>>, id: u64, response: Response) -> bool {
    let Some(writer) = conns.lock().get(&id).cloned() else {
        return false;
    };
    let bytes = super::encode(&Frame::Response(0, response));
    let mut stream = writer.lock();
    let fd = match &*stream {
        Stream::Unix(s) => s.as_fd(),
        Stream::Tcp(s) => s.as_fd(),
    };
    let sent = rustix::net::send(
        fd,
        &bytes,
        rustix::net::SendFlags::DONTWAIT | rustix::net::SendFlags::NOSIGNAL,
    )
    .unwrap_or(0);
    sent == bytes.len() || stream.write_all(&bytes[sent..]).is_ok()
}

/// What the DPU side does with requests. `Hello` is handled by the server.
pub trait Handler: Send + Sync + 'static {
    /// The node's name, sent in the Hello answer.
    fn node_name(&self) -> String;

    /// Answers one request from `peer`.
    fn handle(&self, peer: &Peer, request: Request) -> Response;

    /// Answers one request and names file descriptors to pass with the answer (a
    /// bell's eventfd at registration). They reach peers on Unix sockets only; a TCP
    /// peer gets the answer without them.
    fn handle_with_fds(&self, peer: &Peer, request: Request) -> (Response, Vec<OwnedFd>) {
        (self.handle(peer, request), Vec::new())
    }

    /// [`Self::handle_with_fds`] for a request that came with descriptors (a host
    /// agent's pod regions, on a Unix socket); by default they are closed unread.
    fn handle_with_incoming(
        &self,
        peer: &Peer,
        request: Request,
        _incoming: Vec<OwnedFd>,
    ) -> (Response, Vec<OwnedFd>) {
        self.handle_with_fds(peer, request)
    }

    /// A BlueCache store message: answered through `reply`, at once or when its
    /// transfers are done. The connection goes on being read meanwhile, so a peer
    /// that goes away mid-transfer is told to [`Handler::disconnected`] at once.
    fn handle_store(&self, _peer: &Peer, _message: Vec<u8>, _fds: Vec<OwnedFd>, reply: StoreReply) {
        reply.refuse(ErrorCode::BadRequest, "this node runs no BlueCache store");
    }

    /// Whether `peer` may act for `service` with `token` ([`Request::Authenticate`]);
    /// the refusal's answer otherwise.
    fn authenticate(
        &self,
        _peer: &Peer,
        _service: &str,
        _token: Option<&str>,
    ) -> Result<(), Response> {
        Err(error(
            ErrorCode::BadRequest,
            "this node authenticates no one",
        ))
    }

    /// `peer` went away (closed, crashed, or the server is stopping).
    fn disconnected(&self, _peer: &Peer) {}

    /// A host agent's [`Request::Doorbell`] (not answered).
    fn doorbell(&self, _peer: &Peer, _lane: u32) {}
}

/// What serves store messages on a node (the BlueCache agent, `dpumesh-store`).
pub trait StoreService: Send + Sync + std::fmt::Debug + 'static {
    /// One message from connection `peer`, acting for `service` (its keys are that
    /// service's), with the descriptors that came with it (a buffer to register); the
    /// answer goes to `reply`.
    fn handle(
        &self,
        peer: u64,
        service: &str,
        message: Vec<u8>,
        fds: Vec<OwnedFd>,
        reply: StoreReply,
    );

    /// Connection `peer` closed: its transfers stop, its buffers are forgotten.
    fn disconnected(&self, peer: u64);
}

/// Where the answer to a store message goes: the connection that sent it.
pub struct StoreReply(Box<dyn FnOnce(Response) + Send>);

impl std::fmt::Debug for StoreReply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StoreReply")
    }
}

impl StoreReply {
    /// A reply that hands the response to `send` (a transport's writer).
    pub fn new(send: impl FnOnce(Response) + Send + 'static) -> Self {
        Self(Box::new(send))
    }

    /// Sends the agent's answer (dropped if the peer went away meanwhile).
    pub fn send(self, message: Vec<u8>) {
        (self.0)(Response::Store(message));
    }

    /// Refuses the message at the control channel's level.
    pub fn refuse(self, code: ErrorCode, message: &str) {
        (self.0)(error(code, message));
    }
}

/// A running control-channel server. Dropping it tells every peer `Teardown`, closes
/// the connections and stops the threads.
pub struct ControlServer {
    endpoint: Endpoint,
    stop: Arc<AtomicBool>,
    /// Rung to wake the accept loop when it must stop (it sleeps until a connection
    /// or this, so an idle node pays no wake-ups here).
    wake: Arc<OwnedFd>,
    conns: Arc<Mutex<HashMap<u64, Writer>>>,
    accept: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for ControlServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlServer")
            .field("endpoint", &self.endpoint)
            .finish_non_exhaustive()
    }
}

enum Listener {
    Unix(UnixListener),
    Tcp(TcpListener),
}

impl ControlServer {
    /// Listens on the Unix socket `endpoint` (a socket file left by an earlier run is
    /// replaced). A TCP endpoint needs certificates: [`Self::start_with_tls`].
    pub fn start(endpoint: &Endpoint, handler: Arc<dyn Handler>) -> Result<Self, ControlError> {
        Self::start_with_tls(endpoint, handler, None)
    }

    /// [`Self::start`], or a TCP endpoint (port 0 picks a free port, see
    /// [`ControlServer::endpoint`]) over mutual TLS with `tls`: a peer must prove an
    /// identity of the trust domain (pods hold workload certificates) before a byte of
    /// the protocol is read, and that identity is its [`Peer::identity`]. Over TCP
    /// there is no plaintext: registration tokens never cross in clear. (Unix
    /// connections are checked by their peer's user instead.)
    pub fn start_with_tls(
        endpoint: &Endpoint,
        handler: Arc<dyn Handler>,
        tls: Option<Arc<dpumesh_identity::MeshTls>>,
    ) -> Result<Self, ControlError> {
        if matches!(endpoint, Endpoint::Tcp(_)) && tls.is_none() {
            return Err(ControlError::Body(format!(
                "the control channel on {endpoint} is TCP, which runs mutual TLS only: give the node its certificates (identity.mtls), or listen on a Unix socket"
            )));
        }
        let (listener, endpoint) = match endpoint {
            Endpoint::Unix(path) => {
                if path.exists() {
                    std::fs::remove_file(path)?;
                }
                let l = UnixListener::bind(path)?;
                (Listener::Unix(l), endpoint.clone())
            }
            Endpoint::Tcp(addr) => {
                let l = TcpListener::bind(addr)?;
                let local = l.local_addr()?;
                (Listener::Tcp(l), Endpoint::Tcp(local))
            }
        };
        match &listener {
            Listener::Unix(l) => l.set_nonblocking(true)?,
            Listener::Tcp(l) => l.set_nonblocking(true)?,
        }
        let stop = Arc::new(AtomicBool::new(false));
        let wake = Arc::new(
            rustix::event::eventfd(
                0,
                rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
            )
            .map_err(std::io::Error::from)?,
        );
        let conns: Arc<Mutex<HashMap<u64, Writer>>> = Arc::default();
        let accept = {
            let stop = stop.clone();
            let conns = conns.clone();
            let wake = wake.clone();
            std::thread::Builder::new()
                .name("dpumesh-control".to_owned())
                .spawn(move || accept_loop(listener, handler, stop, &wake, conns, tls))?
        };
        Ok(Self {
            endpoint,
            stop,
            wake,
            conns,
            accept: Some(accept),
        })
    }

    /// Where it listens (with the actual port for TCP port 0).
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    pub fn peers(&self) -> usize {
        self.conns.lock().len()
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = rustix::io::write(&*self.wake, &1u64.to_ne_bytes());
        let writers: Vec<Writer> = self.conns.lock().drain().map(|(_, w)| w).collect();
        for writer in writers {
            let mut stream = writer.lock();
            let _ = write_frame(
                &mut *stream,
                &Frame::Response(
                    0,
                    Response::Teardown {
                        reason: "the DPU node is shutting down".to_owned(),
                    },
                ),
            );
            stream.shutdown();
        }
        if let Some(accept) = self.accept.take() {
            let _ = accept.join();
        }
        if let Endpoint::Unix(path) = &self.endpoint {
            let _ = std::fs::remove_file(path);
        }
    }
}

fn accept_loop(
    listener: Listener,
    handler: Arc<dyn Handler>,
    stop: Arc<AtomicBool>,
    wake: &OwnedFd,
    conns: Arc<Mutex<HashMap<u64, Writer>>>,
    tls: Option<Arc<dpumesh_identity::MeshTls>>,
) {
    let next = AtomicU64::new(1);
    while !stop.load(Ordering::Relaxed) {
        let accepted = match &listener {
            Listener::Unix(l) => l.accept().map(|(s, _)| Stream::Unix(s)),
            Listener::Tcp(l) => l.accept().map(|(s, _)| {
                let _ = s.set_nodelay(true);
                Stream::Tcp(s)
            }),
        };
        let stream = match accepted {
            Ok(s) => s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                // Sleep until a pod connects or the server stops.
                let fd = match &listener {
                    Listener::Unix(l) => l.as_fd(),
                    Listener::Tcp(l) => l.as_fd(),
                };
                let mut fds = [
                    rustix::event::PollFd::new(&fd, rustix::event::PollFlags::IN),
                    rustix::event::PollFd::new(wake, rustix::event::PollFlags::IN),
                ];
                let _ = rustix::event::poll(&mut fds, None);
                continue;
            }
            Err(e) => {
                tracing::warn!(error = %e, "control channel accept failed");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        // A pod's identity is its registration: only processes of the node's user
        // (or root) may register (the token then proves the service).
        if let Stream::Unix(s) = &stream
            && let Err(why) = dpumesh_rings::peercred::check_same_user(s)
        {
            tracing::warn!(why, "refused a control connection");
            continue;
        }
        // Over TCP, the peer proves who it is first (there is no TCP without TLS).
        let (stream, identity) = match (stream, &tls) {
            (Stream::Tcp(s), Some(tls)) => match over_tls(s, tls, true) {
                Ok((s, id)) => (s, Some(id)),
                Err(e) => {
                    tracing::warn!(error = %e, "refused a control connection");
                    continue;
                }
            },
            (Stream::Tcp(_), None) => continue,
            (stream, None) => (stream, None),
            (stream, Some(_)) => (stream, None),
        };
        let blocking = match &stream {
            Stream::Unix(s) => s.set_nonblocking(false),
            Stream::Tcp(s) => s.set_nonblocking(false),
        };
        let Ok(writer) = blocking.and_then(|()| stream.try_clone()) else {
            continue;
        };
        let id = next.fetch_add(1, Ordering::Relaxed);
        // A reply that cannot be written within this is a peer that stopped reading.
        let _ = match &writer {
            Stream::Unix(s) => s.set_write_timeout(Some(Duration::from_secs(5))),
            Stream::Tcp(s) => s.set_write_timeout(Some(Duration::from_secs(5))),
        };
        conns.lock().insert(id, Arc::new(Mutex::new(writer)));
        let handler = handler.clone();
        let conns = conns.clone();
        let _ = std::thread::Builder::new()
            .name(format!("dpumesh-control-{id}"))
            .spawn(move || serve(id, stream, identity, handler, conns));
    }
}

fn serve(
    id: u64,
    stream: Stream,
    identity: Option<dpumesh_identity::SpiffeId>,
    handler: Arc<dyn Handler>,
    conns: Arc<Mutex<HashMap<u64, Writer>>>,
) {
    let mut peer: Option<Peer> = None;
    // A panic while serving one connection (a bug in a handler) ends that connection
    // as if it closed: what its peer registered is reclaimed rather than left to
    // nobody, and the other connections serve on.
    let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        serve_frames(id, stream, identity, &handler, &conns, &mut peer);
    }));
    if let Err(panic) = served {
        let what = dpumesh_supervise::panic_message(panic.as_ref());
        tracing::error!(connection = id, panic = %what, "a control connection's thread panicked: the connection is closed");
    }
    conns.lock().remove(&id);
    if let Some(peer) = peer {
        handler.disconnected(&peer);
    }
}

/// Reads and answers one connection's frames until it closes or breaks.
fn serve_frames(
    id: u64,
    mut stream: Stream,
    identity: Option<dpumesh_identity::SpiffeId>,
    handler: &Arc<dyn Handler>,
    conns: &Arc<Mutex<HashMap<u64, Writer>>>,
    peer: &mut Option<Peer>,
) {
    // Descriptors that came with the request being read (a store buffer to register).
    let mut fds: Vec<OwnedFd> = Vec::new();
    loop {
        fds.clear();
        let read = match &mut stream {
            Stream::Unix(s) => read_frame(&mut FdReader {
                stream: s,
                fds: &mut fds,
            }),
            other => read_frame(other),
        };
        let frame = match read {
            Ok(frame) => frame,
            Err(ControlError::Version { theirs, .. }) => {
                tracing::warn!(theirs, "control peer speaks another protocol version");
                let _ = stream.write_all(&encode_version_mismatch(theirs));
                break;
            }
            Err(ControlError::Closed) => break,
            Err(e) => {
                tracing::warn!(error = %e, "dropping a control connection");
                break;
            }
        };
        let Frame::Request(rid, request) = frame else {
            let _ = reply(
                conns,
                id,
                0,
                error(ErrorCode::BadRequest, "peers send requests, not responses"),
            );
            break;
        };
        let response = match (&*peer, request) {
            (_, Request::Hello { role, name }) => {
                let pushes = conns.clone();
                *peer = Some(Peer {
                    id,
                    role,
                    name,
                    service: None,
                    identity: identity.clone(),
                    push: Pusher::new(move |r| push_frame(&pushes, id, r)),
                });
                Response::Hello {
                    node: handler.node_name(),
                }
            }
            (None, _) => error(ErrorCode::BadRequest, "say Hello first"),
            (Some(p), Request::Doorbell { lane }) => {
                handler.doorbell(p, lane);
                continue;
            }
            (Some(p), Request::Store(message)) => {
                let conns = conns.clone();
                let reply = StoreReply::new(move |response| {
                    let _ = reply(&conns, id, rid, response);
                });
                handler.handle_store(p, message, std::mem::take(&mut fds), reply);
                continue;
            }
            (Some(p), Request::Authenticate { service, token }) => {
                match handler.authenticate(p, &service, token.as_deref()) {
                    Ok(()) => {
                        if let Some(p) = peer.as_mut() {
                            p.service = Some(service);
                        }
                        Response::Ok
                    }
                    Err(refusal) => refusal,
                }
            }
            (Some(p), request) => {
                let registering = match &request {
                    Request::RegisterPod { service, .. } => Some(service.clone()),
                    _ => None,
                };
                let (response, out) =
                    handler.handle_with_incoming(p, request, std::mem::take(&mut fds));
                // A connection that registered a pod acts for its service.
                if let (Some(service), Response::PodRegistered(_)) = (registering, &response)
                    && let Some(p) = peer.as_mut()
                {
                    p.service = Some(service);
                }
                if reply_with_fds(conns, id, rid, response, &out).is_err() {
                    break;
                }
                continue;
            }
        };
        if reply(conns, id, rid, response).is_err() {
            break;
        }
    }
}

fn reply(
    conns: &Mutex<HashMap<u64, Writer>>,
    id: u64,
    rid: u32,
    response: Response,
) -> Result<(), ControlError> {
    let writer = conns.lock().get(&id).cloned().ok_or(ControlError::Closed)?;
    let mut stream = writer.lock();
    write_frame(&mut *stream, &Frame::Response(rid, response))
}

/// A reply carrying `fds` (on a Unix socket; dropped for TCP peers).
fn reply_with_fds(
    conns: &Mutex<HashMap<u64, Writer>>,
    id: u64,
    rid: u32,
    response: Response,
    fds: &[OwnedFd],
) -> Result<(), ControlError> {
    let writer = conns.lock().get(&id).cloned().ok_or(ControlError::Closed)?;
    let mut stream = writer.lock();
    match &mut *stream {
        Stream::Unix(s) if !fds.is_empty() => {
            let bytes = super::encode(&Frame::Response(rid, response));
            let borrowed: Vec<_> = fds.iter().map(AsFd::as_fd).collect();
            send_with_fds(s, &bytes, &borrowed)?;
            Ok(())
        }
        other => write_frame(other, &Frame::Response(rid, response)),
    }
}

/// Writes `bytes` with `fds` riding on the first of them.
fn send_with_fds(
    s: &mut UnixStream,
    bytes: &[u8],
    fds: &[std::os::fd::BorrowedFd<'_>],
) -> std::io::Result<()> {
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags, sendmsg};
    use std::mem::MaybeUninit;
    let mut space =
        [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(dpumesh_rings::fdpass::MAX_FDS))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if fds.len() > dpumesh_rings::fdpass::MAX_FDS
        || !control.push(SendAncillaryMessage::ScmRights(fds))
    {
        return Err(std::io::Error::other("too many descriptors for one answer"));
    }
    let sent = sendmsg(
        &*s,
        &[std::io::IoSlice::new(bytes)],
        &mut control,
        SendFlags::NOSIGNAL,
    )?;
    s.write_all(&bytes[sent..])
}

/// Reads a Unix stream, keeping the descriptors that arrive on it.
struct FdReader<'a> {
    stream: &'a mut UnixStream,
    fds: &'a mut Vec<OwnedFd>,
}

impl std::io::Read for FdReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, recvmsg};
        use std::mem::MaybeUninit;
        let mut space =
            [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(dpumesh_rings::fdpass::MAX_FDS))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let got = recvmsg(
            &*self.stream,
            &mut [std::io::IoSliceMut::new(buf)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        )?;
        for message in control.drain() {
            if let RecvAncillaryMessage::ScmRights(fds) = message {
                self.fds.extend(fds);
            }
        }
        Ok(got.bytes)
    }
}

fn error(code: ErrorCode, message: &str) -> Response {
    Response::Error {
        code,
        message: message.to_owned(),
    }
}

/// Runs mutual TLS on a fresh TCP connection (blocking, 5 s per step) and hands the
/// session back as a plain stream (see `dpumesh_identity::relay`).
fn over_tls(
    mut s: TcpStream,
    tls: &dpumesh_identity::MeshTls,
    accepting: bool,
) -> Result<(Stream, dpumesh_identity::SpiffeId), ControlError> {
    use dpumesh_identity::Peers;
    s.set_nonblocking(false)?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.set_write_timeout(Some(Duration::from_secs(5)))?;
    let (conn, peer) = if accepting {
        tls.accept_from(&mut s, Peers::TrustDomain)
    } else {
        tls.connect_to(&mut s, Peers::MeshComponents)
    }?;
    Ok((Stream::Unix(dpumesh_identity::relay::relay(conn, s)?), peer))
}

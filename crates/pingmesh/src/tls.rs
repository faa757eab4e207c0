//! Mutual TLS on the gRPC APIs with the mesh CA's certificates (`pingmesh.tls`).
//!
//! tonic's own TLS checks the server's DNS name; mesh certificates name SPIFFE IDs
//! only. So both ends run rustls themselves (the configurations of
//! [`dpumesh_identity::MeshTls`], `h2` by ALPN) and check the SPIFFE ID after the
//! handshake: the server accepts nodes only (an agent lives in a node), and hands
//! the caller's identity to the services as a request extension ([`Caller`]) so an
//! agent registers and uploads as itself alone; the agent accepts only the Pingmesh
//! identity, so a compromised node cannot pose as the controller.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use dpumesh_identity::{MeshTls, Peers, Role, SpiffeId};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tonic::transport::server::Connected;

/// A handshake that takes longer is dropped (a silent client holds a task, not the
/// accept loop, and not for long).
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Handshakes under way at once; more connections wait in the listen backlog (one
/// client opening sockets by the thousand takes these, not the descriptors).
const MAX_HANDSHAKES: usize = 64;

/// Who called, as the server's handshake proved it (a request extension).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub id: SpiffeId,
    pub addr: SocketAddr,
}

impl Caller {
    /// The node the caller's certificate names.
    pub fn node(&self) -> &str {
        match &self.id.role {
            Role::Node(name) => name,
            // `incoming` admits nodes only.
            _ => "",
        }
    }
}

/// Whether the caller of `request` may act as agent `agent_id`; the refusal names
/// both. `tls`: the server runs TLS, so a request without a proven caller is refused
/// too (it cannot come from the TLS listener; closed, should another way in appear).
pub fn authorize<T>(
    request: &tonic::Request<T>,
    agent_id: &str,
    tls: bool,
) -> Result<(), tonic::Status> {
    match request.extensions().get::<Caller>() {
        Some(caller) if caller.node() != agent_id => {
            Err(tonic::Status::permission_denied(format!(
                "{} may act as agent {:?} only, not {agent_id:?}",
                caller.id,
                caller.node()
            )))
        }
        None if tls => Err(tonic::Status::unauthenticated(
            "no proven identity: this server takes mutual TLS only",
        )),
        _ => Ok(()),
    }
}

/// A connection the server accepted: TLS done, the client a node of the mesh.
pub struct TlsConn {
    inner: tokio_rustls::server::TlsStream<TcpStream>,
    caller: Caller,
}

impl Connected for TlsConn {
    type ConnectInfo = Caller;
    fn connect_info(&self) -> Caller {
        self.caller.clone()
    }
}

impl AsyncRead for TlsConn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for TlsConn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// The server's half of one handshake: the client must prove a node identity.
async fn accept(tls: &MeshTls, tcp: TcpStream, addr: SocketAddr) -> Result<TlsConn, String> {
    tcp.set_nodelay(true).map_err(|e| e.to_string())?;
    let acceptor = tokio_rustls::TlsAcceptor::from(tls.server_config(&[b"h2"]));
    let stream = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp))
        .await
        .map_err(|_| format!("no handshake within {HANDSHAKE_TIMEOUT:?}"))?
        .map_err(|e| e.to_string())?;
    let id = tls
        .verify_peer(stream.get_ref().1.peer_certificates(), Peers::Nodes)
        .map_err(|e| e.to_string())?;
    Ok(TlsConn {
        inner: stream,
        caller: Caller { id, addr },
    })
}

/// The connections of `listener` that pass the handshake, as the stream tonic
/// serves. Each handshake runs on a task of its own; refusals are logged.
pub fn incoming(
    listener: TcpListener,
    tls: Arc<MeshTls>,
) -> impl tokio_stream::Stream<Item = Result<TlsConn, io::Error>> {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<TlsConn, io::Error>>(16);
    let permits = Arc::new(tokio::sync::Semaphore::new(MAX_HANDSHAKES));
    tokio::spawn(async move {
        loop {
            let Ok(permit) = permits.clone().acquire_owned().await else {
                return;
            };
            let (tcp, addr) = match listener.accept().await {
                Ok(a) => a,
                Err(e) => {
                    // Out of descriptors and the like: wait, as tonic's own loop does.
                    tracing::warn!(error = %e, "pingmesh gRPC: accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            if tx.is_closed() {
                return;
            }
            let (tls, tx) = (tls.clone(), tx.clone());
            tokio::spawn(async move {
                let accepted = accept(&tls, tcp, addr).await;
                drop(permit);
                match accepted {
                    Ok(conn) => {
                        let _ = tx.send(Ok(conn)).await;
                    }
                    Err(why) => {
                        tracing::warn!(peer = %addr, %why, "pingmesh gRPC: refused a TLS client");
                    }
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// The agents' connector: TCP, then TLS with the node's certificate, then the
/// server's SPIFFE ID must be the Pingmesh one.
#[derive(Clone)]
pub struct Connector {
    tls: Arc<MeshTls>,
}

impl std::fmt::Debug for Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connector")
            .field("id", &self.tls.identity().to_string())
            .finish()
    }
}

impl Connector {
    pub fn new(tls: Arc<MeshTls>) -> Self {
        Self { tls }
    }

    async fn connect(
        tls: Arc<MeshTls>,
        uri: hyper::Uri,
    ) -> io::Result<TokioIo<tokio_rustls::client::TlsStream<TcpStream>>> {
        let bad = |why: String| io::Error::new(io::ErrorKind::InvalidInput, why);
        let host = uri
            .host()
            .ok_or_else(|| bad(format!("{uri}: no host")))?
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let port = uri
            .port_u16()
            .ok_or_else(|| bad(format!("{uri}: no port")))?;
        let tcp = TcpStream::connect((host.as_str(), port)).await?;
        tcp.set_nodelay(true)?;
        let name = rustls::pki_types::ServerName::try_from(dpumesh_identity::tls::SERVER_NAME)
            .map_err(|e| bad(e.to_string()))?;
        let connector = tokio_rustls::TlsConnector::from(tls.client_config(&[b"h2"]));
        let stream = tokio::time::timeout(HANDSHAKE_TIMEOUT, connector.connect(name, tcp))
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "TLS handshake timed out"))??;
        tls.verify_peer(stream.get_ref().1.peer_certificates(), Peers::Pingmesh)
            .map_err(|e| io::Error::new(io::ErrorKind::PermissionDenied, format!("{uri}: {e}")))?;
        Ok(TokioIo::new(stream))
    }
}

impl tower_service::Service<hyper::Uri> for Connector {
    type Response = TokioIo<tokio_rustls::client::TlsStream<TcpStream>>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<Self::Response>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: hyper::Uri) -> Self::Future {
        Box::pin(Self::connect(self.tls.clone(), uri))
    }
}

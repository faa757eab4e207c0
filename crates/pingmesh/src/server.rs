//! The controller and the analyzer in one process (the embedded default `dpumesh up`
//! runs): both gRPC services on one port, the analyzer's JSON API and the dashboard
//! on another, the registry in SQLite.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use dpumesh_clock::SharedClock;

use crate::analyzer::service::AnalyzerService;
use crate::analyzer::{Analyzer, AnalyzerPolicy};
use crate::controller::{Controller, ControllerService};
use crate::pinglist::PinglistPolicy;
use crate::registry::RnicStore;
use crate::registry::memory::MemoryStore;
use crate::registry::sqlite::SqliteStore;

/// How the server runs.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// gRPC (controller and analyzer services).
    pub grpc: SocketAddr,
    /// HTTP: the analyzer's JSON API and the dashboard.
    pub http: SocketAddr,
    /// The registry's SQLite file, which keeps the analyzer's window too (None:
    /// both in memory).
    pub registry: Option<PathBuf>,
    pub pinglist: PinglistPolicy,
    /// Registrations not renewed for this long expire.
    pub ttl: Duration,
    pub analyzer: AnalyzerPolicy,
    /// The mesh's nodes and their admin APIs (`http://HOST:PORT`), for the
    /// dashboard's mesh overview.
    pub nodes: Vec<(String, String)>,
    /// The nodes' admin token, which the dashboard's tap page needs (None: taps
    /// work only on nodes without one).
    pub admin_token: Option<String>,
    /// Mutual TLS on the gRPC port with the Pingmesh identity (None: plain).
    pub tls: Option<Arc<dpumesh_identity::MeshTls>>,
    /// With TLS, the RNIC each node may register (the mesh file's); empty: any.
    pub known: std::collections::BTreeMap<String, crate::controller::KnownRnic>,
    pub clock: SharedClock,
}

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("pingmesh registry: {0}")]
    Registry(#[from] crate::registry::StoreError),
    #[error("pingmesh: {0}")]
    Results(#[from] crate::analyzer::log::LogError),
    #[error("pingmesh server: cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("pingmesh server: {0}")]
    Runtime(std::io::Error),
}

/// A running controller + analyzer; stops when dropped.
pub struct Server {
    pub grpc_addr: SocketAddr,
    pub http_addr: SocketAddr,
    analyzer: Arc<Analyzer>,
    controller: Arc<Controller>,
    tls: bool,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("grpc_addr", &self.grpc_addr)
            .field("http_addr", &self.http_addr)
            .finish_non_exhaustive()
    }
}

impl Server {
    /// Opens the registry, binds both ports and serves on a thread of its own.
    pub fn start(config: ServerConfig) -> Result<Self, ServerError> {
        crate::dashboard::prometheus();
        let registry: Arc<dyn RnicStore> = match &config.registry {
            Some(path) => Arc::new(SqliteStore::open(path)?),
            None => Arc::new(MemoryStore::new()),
        };
        let controller = Arc::new(Controller::new(
            registry.clone(),
            config.clock.clone(),
            config.pinglist.clone(),
            config.ttl,
        ));
        let mut analyzer = Analyzer::new(config.analyzer.clone(), config.clock.clone(), registry);
        if let Some(path) = &config.registry {
            let (with_log, resumed) =
                analyzer.with_log(crate::analyzer::log::ResultLog::open(path)?)?;
            if resumed > 0 {
                tracing::info!(resumed, "analyzer window taken up from disk");
            }
            analyzer = with_log;
        }
        let analyzer = Arc::new(analyzer);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("pingmesh-server")
            .enable_all()
            .build()
            .map_err(ServerError::Runtime)?;
        let listen = |addr: SocketAddr| {
            let std = std::net::TcpListener::bind(addr)
                .map_err(|source| ServerError::Listen { addr, source })?;
            std.set_nonblocking(true).map_err(ServerError::Runtime)?;
            Ok::<_, ServerError>(std)
        };
        let grpc = listen(config.grpc)?;
        let http = listen(config.http)?;
        let grpc_addr = grpc.local_addr().map_err(ServerError::Runtime)?;
        let http_addr = http.local_addr().map_err(ServerError::Runtime)?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let services = (
            ControllerService::new(controller.clone())
                .with_known(config.known.clone())
                .with_tls(config.tls.is_some())
                .server(),
            AnalyzerService::new(analyzer.clone())
                .with_tls(config.tls.is_some())
                .server(),
        );
        let tls = config.tls.clone();
        let for_http = analyzer.clone();
        let overview = Arc::new(crate::dashboard::overview::Overview::new(
            config.nodes.clone(),
        ));
        let relay = Arc::new(crate::dashboard::tap::TapRelay::new(
            config.nodes.clone(),
            config.admin_token.clone(),
        ));
        let thread = std::thread::Builder::new()
            .name("pingmesh-server".into())
            .spawn(move || {
                rt.block_on(async move {
                    let grpc = match tokio::net::TcpListener::from_std(grpc) {
                        Ok(l) => l,
                        Err(e) => return tracing::error!(error = %e, "pingmesh gRPC listener"),
                    };
                    let http = match tokio::net::TcpListener::from_std(http) {
                        Ok(l) => l,
                        Err(e) => return tracing::error!(error = %e, "pingmesh HTTP listener"),
                    };
                    let router = tonic::transport::Server::builder()
                        .add_service(services.0)
                        .add_service(services.1);
                    let stopped = async {
                        let _ = stopped.await;
                    };
                    let grpc: std::pin::Pin<Box<dyn Future<Output = _> + Send>> = match tls {
                        Some(tls) => Box::pin(router.serve_with_incoming_shutdown(
                            crate::tls::incoming(grpc, tls),
                            stopped,
                        )),
                        None => Box::pin(router.serve_with_incoming_shutdown(
                            tokio_stream::wrappers::TcpListenerStream::new(grpc),
                            stopped,
                        )),
                    };
                    tokio::select! {
                        r = grpc => if let Err(e) = r {
                            tracing::error!(error = %e, "pingmesh gRPC server failed");
                        },
                        () = crate::dashboard::serve(http, for_http, overview, relay) => {}
                    }
                });
            })
            .map_err(ServerError::Runtime)?;
        Ok(Self {
            grpc_addr,
            http_addr,
            analyzer,
            controller,
            tls: config.tls.is_some(),
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    pub fn analyzer(&self) -> &Arc<Analyzer> {
        &self.analyzer
    }

    pub fn controller(&self) -> &Arc<Controller> {
        &self.controller
    }

    /// URL of the gRPC port (what agents are given): `https://` with TLS.
    pub fn grpc_url(&self) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        format!("{scheme}://{}", self.grpc_addr)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

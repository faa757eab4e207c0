//! The DPUmesh DPU proxy as a process: a YAML config file, hot reload (file watch and
//! `POST /reload`) with atomic generations, an admin API with Prometheus metrics, and
//! a loopback HTTP listener that runs the chains and answers the verdict until the
//! ingress and data path exist.
//!
//! ```text
//! proxy.yaml ──▶ Control::start / reload ──▶ Generation n (chains) ──▶ WorkerPool
//!                  ▲ file watch, POST /reload        │ routes
//!   admin API ─────┘  /healthz /readyz /metrics /filters     loopback listener
//! ```

#![deny(unsafe_code)]

pub mod admin;
pub mod config;
pub mod control;
pub mod dataplane;
pub mod listener;
pub mod logging;
pub mod mesh;
pub mod node;
pub mod routes;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

pub use control::{Control, ReloadError, Reloaded, Snapshot};

/// How to run.
#[derive(Debug, Clone)]
pub struct Options {
    /// Poll interval of the config watcher; no watching when `None`.
    pub watch: Option<Duration>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            watch: Some(Duration::from_millis(250)),
        }
    }
}

/// A running proxy: control, workers, admin API and loopback listener.
#[derive(Debug)]
pub struct Proxy {
    control: Arc<Control>,
    admin: Option<SocketAddr>,
    listener: Option<SocketAddr>,
    io: tokio::runtime::Runtime,
}

impl Proxy {
    /// Loads `file` and starts everything it configures.
    pub fn start(file: &Path, options: Options) -> anyhow::Result<Self> {
        // Metric handles bind to the recorder present when they are created: install it
        // before any chain exists.
        admin::prometheus();
        let control = Control::start(file)?;
        if let Some(every) = options.watch {
            control.watch(every)?;
        }
        let io = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("dpumesh-io")
            .enable_all()
            .build()?;
        let config = control.snapshot().config.clone();
        let bind = |addr: SocketAddr| -> anyhow::Result<tokio::net::TcpListener> {
            let listener = io.block_on(tokio::net::TcpListener::bind(addr));
            listener.map_err(|e| anyhow::anyhow!("cannot listen on {addr}: {e}"))
        };
        let admin = match config.config.admin {
            Some(addr) => {
                let listener = bind(addr)?;
                let local = listener.local_addr()?;
                io.spawn(admin::serve(listener, control.clone()));
                Some(local)
            }
            None => None,
        };
        let listener = match config.config.listener {
            Some(addr) => {
                let socket = bind(addr)?;
                let local = socket.local_addr()?;
                io.spawn(listener::serve(socket, control.clone()));
                Some(local)
            }
            None => None,
        };
        Ok(Self {
            control,
            admin,
            listener,
            io,
        })
    }

    /// The control side (reload, snapshot, workers).
    pub fn control(&self) -> &Arc<Control> {
        &self.control
    }

    /// Where the admin API listens.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin
    }

    /// Where the loopback listener listens.
    pub fn listener_addr(&self) -> Option<SocketAddr> {
        self.listener
    }

    /// Runs until Ctrl-C.
    pub fn wait(self) -> anyhow::Result<()> {
        self.io.block_on(tokio::signal::ctrl_c())?;
        tracing::info!("shutting down");
        Ok(())
    }
}

//! The DPU proxy role: the mesh data plane (heads in from the fabric and from the
//! node's pods, the route's filter chain, delivery to a pod here or the proxy of the
//! node that runs the service, responses back with their response phase), the policy
//! it enforces (a YAML file, hot-reloaded as numbered generations), the admin API, and
//! a loopback HTTP listener that runs a chain on a request and answers the verdict, so
//! a policy can be tried without a mesh around it.
//!
//! ```text
//! policy.yaml ──▶ Policy::start / reload ──▶ Generation n (chains, routes)
//!                   ▲ file watch, POST /reload        │
//!   admin API ──────┘  /healthz /readyz /metrics      ├─▶ data plane shards: each runs
//!                      /filters                       │   chains inline (LocalChains)
//!                                                     └─▶ WorkerPool: offloaded chains,
//!                                                         the loopback listener
//! ```

#![deny(unsafe_code)]

pub mod admin;
mod admin_tap;
mod callout;
pub mod dataplane;
pub mod http_cache;
pub mod listener;
pub mod logging;
pub mod node;
mod nudge;
pub mod observe;
pub mod policy;
pub mod trust;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

pub use policy::{Policy, ReloadError, Reloaded, Snapshot};

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

/// A running proxy: policy, workers, admin API and loopback listener.
#[derive(Debug)]
pub struct Proxy {
    policy: Arc<Policy>,
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
        let policy = Policy::start(file)?;
        if let Some(every) = options.watch {
            policy.watch(every)?;
        }
        let io = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("dpumesh-io")
            .enable_all()
            .build()?;
        let config = policy.snapshot().config.clone();
        let bind = |addr: SocketAddr| -> anyhow::Result<tokio::net::TcpListener> {
            let listener = io.block_on(tokio::net::TcpListener::bind(addr));
            listener.map_err(|e| anyhow::anyhow!("cannot listen on {addr}: {e}"))
        };
        let admin = match config.config.admin {
            Some(addr) => {
                let listener = bind(addr)?;
                let local = listener.local_addr()?;
                let access = admin::access(&config, local.port(), None)?;
                io.spawn(admin::serve(
                    listener,
                    access,
                    policy.clone(),
                    Vec::new(),
                    Vec::new(),
                    None,
                    None,
                    None,
                ));
                Some(local)
            }
            None => None,
        };
        let listener = match config.config.listener {
            Some(addr) => {
                let socket = bind(addr)?;
                let local = socket.local_addr()?;
                io.spawn(listener::serve(socket, policy.clone()));
                Some(local)
            }
            None => None,
        };
        Ok(Self {
            policy,
            admin,
            listener,
            io,
        })
    }

    /// The policy side (reload, snapshot, workers).
    pub fn policy(&self) -> &Arc<Policy> {
        &self.policy
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

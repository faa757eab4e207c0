//! The bridge: how a server that was not written for the mesh joins it. A bridge is
//! the service's pod (it registers with its node like any pod) and forwards each
//! request the mesh delivers to the server on a local port, over HTTP/1.1, h2c or
//! gRPC ([`forward`]), answering with what the server answered, trailers included.
//! With an egress port ([`egress`]) it is also the server's way out: an HTTP proxy on
//! which `http://<service>/path` is a call through the mesh, made as this service.
//!
//! One mesh-file line makes one (`services.<name>.bridge: {to: 127.0.0.1:8080,
//! protocol: http1}`); `dpumesh up` runs `dpumesh bridge` as the service's pod.
//!
//! **One thread.** The host library's loop and a current-thread tokio runtime share
//! the main thread ([`dpumesh_host::reactor`]): the runtime's reactor watches the
//! pod's bell beside the sockets to the server and the egress port, and the loop polls
//! each forwarded request's future (an asynchronous step) where the connections' tasks
//! run. A request crosses no thread in the bridge.

pub mod egress;
pub mod forward;
pub mod h1;

use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use anyhow::Context;
use dpumesh_config::BridgeProtocol;
use dpumesh_host::datapath::PodEnv;
use dpumesh_host::{EventLoop, LoopConfig};

/// What a bridge forwards to, and where it takes the server's calls.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The server's `host:port`.
    pub to: String,
    /// What it speaks.
    pub protocol: BridgeProtocol,
    /// The egress port, if any.
    pub egress: Option<SocketAddr>,
    /// How long to wait for the server to accept connections before registering (a
    /// server started beside the bridge is still starting); none: register at once.
    pub wait: Option<Duration>,
}

/// Waits until `to` accepts a connection, at most `patience`; whether it did.
fn server_up(to: &str, patience: Duration) -> bool {
    let deadline = Instant::now() + patience;
    let mut delay = Duration::from_millis(20);
    loop {
        if std::net::TcpStream::connect(to).is_ok() {
            return true;
        }
        if Instant::now() + delay > deadline {
            return false;
        }
        std::thread::sleep(delay);
        delay = (delay * 2).min(Duration::from_millis(500));
    }
}

/// Runs the bridge as the pod `env` names until the process ends.
pub fn run(env: &PodEnv, settings: Settings) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    // The forwarded requests' futures make their sockets and timers in the runtime.
    let _entered = runtime.enter();
    // Registered only once the server answers: the node sends requests from then on.
    if let Some(patience) = settings.wait
        && !server_up(&settings.to, patience)
    {
        tracing::warn!(to = %settings.to, "the server does not accept connections yet: bridging anyway");
    }
    let transport = env
        .connect()
        .with_context(|| format!("cannot register {} with its node", env.pod))?;
    let forward = forward::Forward::new(&settings.to, settings.protocol);
    let mut service_loop = EventLoop::new(
        transport,
        dpumesh_host::tower::handler(forward),
        // The server reads bodies as they come: an upload streams through.
        LoopConfig::streaming(),
    )?;
    if let Some(addr) = settings.egress {
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind(addr))
            .with_context(|| format!("cannot listen for the server's calls on {addr}"))?;
        runtime.spawn(egress::serve(listener, service_loop.outbound()));
    }
    tracing::info!(
        service = %env.service,
        to = %settings.to,
        protocol = settings.protocol.name(),
        "bridging"
    );
    runtime
        .block_on(dpumesh_host::reactor::drive(
            &mut service_loop,
            &AtomicBool::new(false),
        ))
        .map_err(|e| anyhow::anyhow!("{}: {e}", env.service))
}

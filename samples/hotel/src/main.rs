//! `hotel CODE`: runs one hotel service (frontend, user or reservation) as a mesh pod. `dpumesh up` starts it with
//! `DPUMESH_CONTROL` (the node's control socket, or `tcp:HOST:PORT`), `DPUMESH_SERVICE`
//! and `DPUMESH_POD`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Context, Result, bail};
use dpumesh_host::datapath::PodEnv;
use dpumesh_host::{EventLoop, LoopConfig};

// A service allocates a request's head, graph and answer per request on its one loop
// thread: mimalloc's thread-local pages cost a fraction of glibc's bins there (the
// host library works with any allocator; this is the sample's choice, as it would be
// any Rust service's).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> Result<()> {
    // As the mesh's own processes log: JSON lines off a terminal (a container's log),
    // text with colours on one; DPUMESH_LOG_FORMAT (auto, text, json) overrides.
    let terminal = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let json = match std::env::var("DPUMESH_LOG_FORMAT").as_deref() {
        Ok("json") => true,
        Ok("text") => false,
        _ => !terminal,
    };
    let logs = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("DPUMESH_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr);
    if json {
        logs.with_ansi(false).json().init();
    } else {
        logs.with_ansi(terminal).init();
    }
    // The code to run (argument) and the service name to register under (the
    // environment, so one program can serve under several names).
    let code = match std::env::args().nth(1) {
        Some(s) => s,
        None => std::env::var("DPUMESH_SERVICE").context("usage: hotel SERVICE")?,
    };
    let Some(handler) = dpumesh_sample_hotel::handler(&code) else {
        bail!("unknown service {code:?} (frontend, user, reservation)");
    };
    let env = PodEnv::read(Some(&code)).map_err(anyhow::Error::msg)?;
    let transport = env
        .connect()
        .with_context(|| format!("cannot register {} with its node", env.pod))?;
    let service = env.service;
    let config = LoopConfig {
        stream_requests: dpumesh_sample_hotel::streams_request,
        ..LoopConfig::default()
    };
    let mut service_loop = EventLoop::new(transport, handler, config)?;
    let stop = Arc::new(AtomicBool::new(false));
    service_loop
        .run(&stop)
        .map_err(|e| anyhow::anyhow!("{service}: {e}"))?;
    stop.store(true, Ordering::Relaxed);
    Ok(())
}

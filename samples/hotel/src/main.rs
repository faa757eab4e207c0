//! `hotel SERVICE`: runs one hotel service as a mesh pod. `dpumesh up` starts it with
//! `DPUMESH_CONTROL` (the node's control socket), `DPUMESH_SERVICE` and `DPUMESH_POD`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Context, Result, bail};
use dpumesh_dpa::control::transport::Endpoint;
use dpumesh_host::datapath::DataPathTransport;
use dpumesh_host::{EventLoop, LoopConfig};

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("DPUMESH_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();
    let service = match std::env::args().nth(1) {
        Some(s) => s,
        None => std::env::var("DPUMESH_SERVICE").context("usage: hotel SERVICE")?,
    };
    let Some(handler) = dpumesh_sample_hotel::handler(&service) else {
        bail!("unknown service {service:?} (frontend, user, reservation)");
    };
    let control = std::env::var("DPUMESH_CONTROL")
        .context("DPUMESH_CONTROL (the node's control socket) is not set: start it with `dpumesh up`")?;
    let pod = std::env::var("DPUMESH_POD").unwrap_or_else(|_| format!("{service}-{}", std::process::id()));
    let transport = DataPathTransport::connect(&Endpoint::Unix(control.into()), &pod, &service)
        .with_context(|| format!("cannot register {pod} with its node"))?;
    let mut service_loop = EventLoop::new(transport, handler, LoopConfig::default())?;
    let stop = Arc::new(AtomicBool::new(false));
    service_loop
        .run(&stop)
        .map_err(|e| anyhow::anyhow!("{service}: {e}"))?;
    stop.store(true, Ordering::Relaxed);
    Ok(())
}

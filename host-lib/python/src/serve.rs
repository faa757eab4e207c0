//! `dpumesh._native.serve`: registers the service with its node and runs the event
//! loop on the calling (main) thread. The loop waits with the interpreter released;
//! between turns it lets Python handle signals (Ctrl-C stops the service).

use std::str::FromStr;
use std::time::Duration;

use dpumesh_dpa::control::transport::Endpoint;
use dpumesh_host::datapath::DataPathTransport;
use dpumesh_host::{EventLoop, LoopConfig};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use crate::handler::PyHandler;

/// How long one turn may wait for work: signals are looked at between turns (a busy
/// loop turns far more often).
const TURN: Duration = Duration::from_millis(50);

/// How long stopping waits for internal steps still running.
pub(crate) const SHUTDOWN_PATIENCE: Duration = Duration::from_secs(5);

pub(crate) fn init_logging() {
    // The transport reports registration and node restarts through `tracing`.
    let filter = tracing_subscriber::EnvFilter::try_from_env("DPUMESH_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .try_init();
}

/// How long registering waits for the node (`DPUMESH_REGISTER_PATIENCE`).
pub(crate) fn patience() -> PyResult<Option<Duration>> {
    match std::env::var("DPUMESH_REGISTER_PATIENCE") {
        Ok(text) => dpumesh_host::datapath::parse_patience(&text)
            .map_err(|e| PyValueError::new_err(format!("DPUMESH_REGISTER_PATIENCE: {e}"))),
        Err(_) => Ok(Some(dpumesh_host::datapath::REGISTER_PATIENCE)),
    }
}

/// Serves `dispatch` as pod `pod` of `service`, registered at `control`, until a
/// signal's handler raises (KeyboardInterrupt) or the transport fails.
#[pyfunction]
pub(crate) fn serve(
    py: Python<'_>,
    dispatch: Py<PyAny>,
    control: &str,
    pod: &str,
    service: &str,
    threads: usize,
) -> PyResult<()> {
    init_logging();
    let endpoint = Endpoint::from_str(control)
        .map_err(|e| PyValueError::new_err(format!("control endpoint {control:?}: {e}")))?;
    let patience = patience()?;
    let handler = PyHandler::new(py, dispatch)?;
    let transport = py
        .detach(|| DataPathTransport::connect_patiently(&endpoint, pod, service, patience))
        .map_err(|e| {
            PyRuntimeError::new_err(format!("cannot register {pod} with its node: {e}"))
        })?;
    let config = LoopConfig {
        threads: threads.max(1),
        ..LoopConfig::default()
    };
    let mut service_loop = EventLoop::with_worker_scope(
        transport,
        move |ctx| handler.handle(ctx),
        config,
        Some(crate::handler::worker_scope()),
    )
    .map_err(|e| PyRuntimeError::new_err(format!("cannot start the event loop: {e}")))?;
    let ended = loop {
        if let Err(e) = py.detach(|| service_loop.turn(Some(TURN))) {
            break PyRuntimeError::new_err(format!("{service}: {e}"));
        }
        if let Err(e) = py.check_signals() {
            break e;
        }
    };
    // The pool's threads hold interpreter thread states: they end (after the steps
    // they run, up to SHUTDOWN_PATIENCE) before Python may finalize.
    py.detach(|| service_loop.shutdown(SHUTDOWN_PATIENCE));
    Err(ended)
}

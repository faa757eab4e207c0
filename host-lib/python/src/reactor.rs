//! `dpumesh._native.Reactor`: the service's event loop driven from an asyncio loop,
//! for ASGI apps served concurrently (`dpumesh.asgi.serve`).
//!
//! One thread runs both: asyncio's. Its selector watches the pod's bell (the eventfd
//! the node rings when it pushes to the pod's rings, and that every waker of the loop
//! rings from another thread) beside the app's own sockets, and the asyncio task that
//! drives this reactor turns the Rust loop when the bell rings, when a timer of the
//! loop is due, or when the dispatcher says it answered a request. A request's answer
//! is a [`crate::reply::Reply`] the app fills in from its task; the Rust waker that
//! fires then is on this thread, and costs no system call
//! ([`DataPathTransport::wake_locally`]). The protocol is the one of the Rust bridge's
//! reactor (`dpumesh_host::reactor`): announce the sleep, sleep on the bell, end it.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use dpumesh_dpa::control::transport::Endpoint;
use dpumesh_host::datapath::DataPathTransport;
use dpumesh_host::{EventLoop, HttpRequest, HttpResponse, LoopConfig, Outbound};
use http::Method;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::handler::PyHandler;
use crate::result::{body_bytes, header_map, header_text};

/// The longest sleep between turns: how late a wake-up that rang nothing asyncio
/// watches (a registration retry while the node is away) is noticed.
const NAP: Duration = Duration::from_millis(50);

/// The largest streamed answer a mesh call collects for the app.
const MAX_ANSWER: usize = 8 << 20;

/// The service's loop, turned by an asyncio task (see the module's text). Used from
/// the thread that made it only.
#[pyclass(name = "Reactor", module = "dpumesh._native", unsendable)]
pub(crate) struct Reactor {
    service_loop: Option<EventLoop<DataPathTransport>>,
    outbound: Outbound,
}

impl Reactor {
    fn running(&mut self) -> PyResult<&mut EventLoop<DataPathTransport>> {
        self.service_loop
            .as_mut()
            .ok_or_else(|| PyRuntimeError::new_err("the service has stopped"))
    }
}

#[pymethods]
impl Reactor {
    /// Registers pod `pod` of `service` at `control` (waiting for the node as
    /// `DPUMESH_REGISTER_PATIENCE` says) and makes the loop: each request goes to
    /// `dispatch(method, target, headers, body, caller, reply)`.
    #[new]
    fn new(
        py: Python<'_>,
        dispatch: Py<PyAny>,
        control: &str,
        pod: &str,
        service: &str,
    ) -> PyResult<Self> {
        crate::serve::init_logging();
        let endpoint = Endpoint::from_str(control)
            .map_err(|e| PyValueError::new_err(format!("control endpoint {control:?}: {e}")))?;
        let patience = crate::serve::patience()?;
        let handler = PyHandler::deferred(py, dispatch)?;
        let transport = py
            .detach(|| DataPathTransport::connect_patiently(&endpoint, pod, service, patience))
            .map_err(|e| {
                PyRuntimeError::new_err(format!("cannot register {pod} with its node: {e}"))
            })?;
        // Wakers that fire on this thread (an app's task answered) tell the driving
        // task through the dispatcher, not through the bell: no system call.
        transport.wake_locally(Arc::new(tokio::sync::Notify::new()));
        // No internal steps run on a pool here (an ASGI app awaits instead), but the
        // loop keeps one thread for what a handler may still schedule.
        // Uploads the node sends in parts reach the app as they arrive (any size);
        // bodies that come whole are handed over whole.
        let config = LoopConfig {
            threads: 1,
            stream_requests: |_| true,
            ..LoopConfig::default()
        };
        let service_loop = EventLoop::with_worker_scope(
            transport,
            move |ctx| handler.handle(ctx),
            config,
            Some(crate::handler::worker_scope()),
        )
        .map_err(|e| PyRuntimeError::new_err(format!("cannot start the event loop: {e}")))?;
        Ok(Self {
            outbound: service_loop.outbound(),
            service_loop: Some(service_loop),
        })
    }

    /// One turn without waiting: what it handled (requests, completions, sends).
    fn turn(&mut self, py: Python<'_>) -> PyResult<usize> {
        let service_loop = self.running()?;
        py.detach(|| service_loop.turn(Some(Duration::ZERO)))
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))
    }

    /// How long the driver may sleep before the next turn, in seconds, if the bell
    /// does not ring first.
    fn wait(&mut self) -> PyResult<f64> {
        let service_loop = self.running()?;
        let wait = [
            service_loop.next_timer(),
            service_loop.transport().wait_limit(),
        ]
        .into_iter()
        .flatten()
        .fold(NAP, Duration::min);
        Ok(wait.as_secs_f64())
    }

    /// The registration's number: a new one brings a new bell.
    fn registration(&mut self) -> PyResult<u32> {
        Ok(self.running()?.transport().reregistered())
    }

    /// The bell's file descriptor (None while the node is away).
    fn bell_fd(&mut self) -> PyResult<Option<i32>> {
        use std::os::fd::AsRawFd;
        Ok(self
            .running()?
            .transport()
            .bell_fd()
            .map(|fd| fd.as_raw_fd()))
    }

    /// Announces a sleep on the bell; true when something is there already (then do
    /// not sleep). `sleep_ends` follows either way.
    fn sleep_begins(&mut self) -> PyResult<bool> {
        Ok(self.running()?.transport().sleep_begins())
    }

    /// Ends a sleep (reads the bell, so its next ring is a new edge).
    fn sleep_ends(&mut self) -> PyResult<()> {
        self.running()?.transport().sleep_ends();
        Ok(())
    }

    /// Calls the mesh as this service: `url` names the service
    /// (`http://user/me`). `done(status, headers, body, None)` or
    /// `done(None, None, None, why)` is called later, maybe from another thread (the
    /// caller hands it to its loop with `call_soon_threadsafe`).
    #[pyo3(signature = (method, url, headers, body, done))]
    fn call(
        &mut self,
        method: &str,
        url: String,
        headers: Vec<(String, String)>,
        body: Option<&Bound<'_, PyAny>>,
        done: Py<PyAny>,
    ) -> PyResult<()> {
        let method = Method::from_bytes(method.as_bytes())
            .map_err(|_| PyValueError::new_err(format!("invalid method {method:?}")))?;
        let mut request = HttpRequest::new(method, url);
        request.headers = header_map(&headers, "the call")?;
        request.body = body_bytes(body)?;
        self.outbound.call(request, move |answer| match answer {
            Ok(mut response) => match response.stream.as_ref().and_then(|s| s.take()) {
                None => hand(&done, Ok(response)),
                // A streamed answer is collected whole (up to MAX_ANSWER) on a thread
                // of its own: the loop's thread must not wait for it.
                Some(stream) => {
                    std::thread::spawn(move || {
                        let rest = crate::testing::read_stream(stream, MAX_ANSWER);
                        let answer = rest.map(|rest| {
                            let mut body = response.body.to_vec();
                            body.extend_from_slice(&rest);
                            response.body = body.into();
                            response
                        });
                        hand(&done, answer);
                    });
                }
            },
            Err(why) => hand(&done, Err(why)),
        });
        Ok(())
    }

    /// Ends the loop (after what its pool runs, up to five seconds).
    fn shutdown(&mut self, py: Python<'_>) {
        if let Some(mut service_loop) = self.service_loop.take() {
            py.detach(|| service_loop.shutdown(crate::serve::SHUTDOWN_PATIENCE));
        }
    }
}

/// Gives a call's answer to its Python callback.
fn hand(done: &Py<PyAny>, answer: Result<HttpResponse, String>) {
    Python::attach(|py| {
        let called = match answer {
            Ok(response) => {
                let headers: Vec<(String, String)> = response
                    .headers
                    .iter()
                    .map(|(n, v)| (n.as_str().to_owned(), header_text(v)))
                    .collect();
                done.bind(py).call1((
                    response.status,
                    headers,
                    PyBytes::new(py, &response.body),
                    py.None(),
                ))
            }
            Err(why) => done.bind(py).call1((py.None(), py.None(), py.None(), why)),
        };
        if let Err(e) = called {
            e.print(py);
        }
    });
}

//! `dpumesh._native.TestMesh`: the event loop over the in-memory transport (virtual
//! clock), with upstream services written in Python, for tests of Python handlers.

use std::sync::Mutex;
use std::time::Duration;

use dpumesh_host::memory::{InMemoryTransport, Reply};
use dpumesh_host::{EventLoop, HttpRequest, HttpResponse, LoopConfig};
use http::Method;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::graph::error_text;
use crate::handler::PyHandler;
use crate::result::{body_bytes, header_map, header_text};

/// An app on the event loop, its upstream services simulated.
#[pyclass(name = "TestMesh", module = "dpumesh._native")]
pub(crate) struct TestMesh {
    service_loop: Mutex<EventLoop<InMemoryTransport>>,
}

/// A response as Python gets it: status, headers, body, elapsed virtual milliseconds.
type Answer<'py> = (u16, Vec<(String, String)>, Bound<'py, PyBytes>, f64);

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Calls a Python service `f(method, url, headers, body)`: `None` (never answers) or
/// `(status, bytes, latency_ms)`; an exception is a transport failure.
fn reply(f: &Py<PyAny>, request: &HttpRequest) -> Reply {
    Python::attach(|py| {
        let headers: Vec<(String, String)> = request
            .headers
            .iter()
            .map(|(n, v)| (n.as_str().to_owned(), header_text(v)))
            .collect();
        let args = (
            request.method.as_str(),
            request.url.as_str(),
            headers,
            PyBytes::new(py, &request.body),
        );
        let answer = f.bind(py).call1(args).and_then(|v| {
            if v.is_none() {
                return Ok(None);
            }
            let (status, body, latency): (u16, Vec<u8>, f64) = v.extract()?;
            Ok(Some((status, body, latency)))
        });
        match answer {
            Ok(None) => Reply::Never,
            // Negative (or NaN) is no delay; an infinite latency is the test
            // service's mistake: said as a failed call, not a panic in the loop.
            Ok(Some((status, body, latency))) => {
                match Duration::try_from_secs_f64(latency.max(0.0) / 1e3) {
                    Ok(after) => Reply::After(after, HttpResponse::new(status, body)),
                    Err(_) => Reply::Fail(
                        Duration::ZERO,
                        format!("the test service answered with latency {latency} ms"),
                    ),
                }
            }
            Err(e) => Reply::Fail(Duration::ZERO, error_text(py, &e)),
        }
    })
}

#[pymethods]
impl TestMesh {
    #[new]
    #[pyo3(signature = (dispatch, services, threads, record = true))]
    fn new(
        py: Python<'_>,
        dispatch: Py<PyAny>,
        services: &Bound<'_, PyDict>,
        threads: usize,
        record: bool,
    ) -> PyResult<Self> {
        let handler = PyHandler::new(py, dispatch)?;
        let mut transport = InMemoryTransport::new();
        if !record {
            transport = transport.without_log();
        }
        for (host, f) in services.iter() {
            let host: String = host.extract()?;
            transport = if let Ok(body) = f.extract::<String>() {
                // A fixed answer at once, without Python: for measuring the binding.
                transport.service(&host, move |_| {
                    Reply::After(Duration::ZERO, HttpResponse::ok(body.clone()))
                })
            } else {
                let f = f.unbind();
                transport.service(&host, move |request| reply(&f, request))
            };
        }
        let config = LoopConfig {
            threads: threads.max(1),
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
            service_loop: Mutex::new(service_loop),
        })
    }

    /// Sends a request and runs the loop until nothing more can happen:
    /// `(status, [(name, value)], body, elapsed virtual ms)`.
    fn request<'py>(
        &self,
        py: Python<'py>,
        method: &str,
        target: &str,
        headers: Vec<(String, String)>,
        body: &Bound<'py, PyAny>,
    ) -> PyResult<Answer<'py>> {
        let method = Method::from_bytes(method.as_bytes())
            .map_err(|_| PyValueError::new_err(format!("invalid method {method:?}")))?;
        let request = HttpRequest {
            method,
            url: target.to_owned(),
            headers: header_map(&headers, "the request")?,
            body: body_bytes(Some(body))?,
            trailers: Default::default(),
            caller: None,
            stream: None,
        };
        let mut service_loop = self
            .service_loop
            .lock()
            .map_err(|_| PyRuntimeError::new_err("the test mesh failed earlier"))?;
        let (started, id) = {
            let transport = service_loop.transport();
            (
                dpumesh_host::Transport::now(transport),
                transport.inject(request),
            )
        };
        let running: &mut EventLoop<InMemoryTransport> = &mut service_loop;
        py.detach(|| running.run_until_idle())
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
        let transport = service_loop.transport();
        let Some((at, response)) = transport.response(id) else {
            return Err(PyRuntimeError::new_err(
                "the request was not answered (a step waits for a service that never answers \
                 and has no timeout)",
            ));
        };
        let headers = response
            .headers
            .iter()
            .map(|(n, v)| (n.as_str().to_owned(), header_text(v)))
            .collect();
        let mut body = response.body.to_vec();
        if let Some(stream) = response.stream.as_ref().and_then(|s| s.take()) {
            // A streamed answer, read to its end as a client would (its producer
            // may need the interpreter: released meanwhile).
            let rest = py
                .detach(|| read_stream(stream, usize::MAX))
                .map_err(|e| PyRuntimeError::new_err(format!("the streamed answer failed: {e}")))?;
            body.extend_from_slice(&rest);
        }
        Ok((
            response.status,
            headers,
            PyBytes::new(py, &body),
            ms(at.saturating_sub(started)),
        ))
    }

    /// Runs `n` GETs of `target` (in flight together, up to 1000 at a time) and
    /// returns the wall time per request in nanoseconds (`dpumesh.bench`).
    fn run_batch(&self, py: Python<'_>, target: &str, n: usize) -> PyResult<f64> {
        let mut service_loop = self
            .service_loop
            .lock()
            .map_err(|_| PyRuntimeError::new_err("the test mesh failed earlier"))?;
        let total = batches(py, &mut service_loop, n, || HttpRequest::get(target))?;
        Ok(total.as_nanos() as f64 / n.max(1) as f64)
    }

    /// Ends the pool's threads (after the steps they run); the mesh serves no more.
    /// `dpumesh.testing` closes every mesh at exit at the latest: the threads must be
    /// gone before the interpreter finalizes.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let mut service_loop = self
            .service_loop
            .lock()
            .map_err(|_| PyRuntimeError::new_err("the test mesh failed earlier"))?;
        let running: &mut EventLoop<InMemoryTransport> = &mut service_loop;
        py.detach(|| running.shutdown(crate::serve::SHUTDOWN_PATIENCE));
        Ok(())
    }

    /// Egress requests sent so far: `(at_ms, method, url)`.
    fn sent(&self) -> PyResult<Vec<(f64, String, String)>> {
        let mut service_loop = self
            .service_loop
            .lock()
            .map_err(|_| PyRuntimeError::new_err("the test mesh failed earlier"))?;
        Ok(service_loop
            .transport()
            .sent()
            .iter()
            .map(|s| {
                (
                    ms(s.at),
                    s.request.method.to_string(),
                    s.request.url.clone(),
                )
            })
            .collect())
    }
}

/// Runs `n` requests through `service_loop` in batches of up to 1000 in flight, with
/// the interpreter released: the time spent in the loop.
fn batches(
    py: Python<'_>,
    service_loop: &mut EventLoop<InMemoryTransport>,
    n: usize,
    request: impl Fn() -> HttpRequest + Send + Sync,
) -> PyResult<Duration> {
    const BATCH: usize = 1000;
    let mut total = Duration::ZERO;
    let mut left = n;
    while left > 0 {
        let now = BATCH.min(left);
        left -= now;
        for _ in 0..now {
            service_loop.transport().inject(request());
        }
        let started = std::time::Instant::now();
        py.detach(|| service_loop.run_until_idle())
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
        total += started.elapsed();
        service_loop.transport().take_responses();
    }
    Ok(total)
}

/// The same work with a Rust handler, for the binding's overhead: `kind` is `none`
/// (answer at once), `egress` (one call to a service answering at once) or `internal`
/// (one step on the pool). Wall nanoseconds per request over `n` requests.
#[pyfunction]
pub(crate) fn bench_rust(py: Python<'_>, kind: &str, n: usize) -> PyResult<f64> {
    let handler: fn(&mut dpumesh_host::ExecutionContext) = match kind {
        "none" => |ctx| {
            ctx.respond(|_| Ok::<_, String>("pong\n"));
        },
        "egress" => |ctx| {
            ctx.get("http://a/");
        },
        "internal" => |ctx| {
            ctx.run_internal(|_| Ok::<_, String>("done"));
        },
        other => return Err(PyValueError::new_err(format!("no baseline {other:?}"))),
    };
    let transport = InMemoryTransport::new()
        .without_log()
        .service("a", |_| Reply::After(Duration::ZERO, HttpResponse::ok("a")));
    let mut service_loop = EventLoop::new(transport, handler, LoopConfig::default())
        .map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
    let total = batches(py, &mut service_loop, n, || HttpRequest::get("/"))?;
    Ok(total.as_nanos() as f64 / n.max(1) as f64)
}

/// A streamed body's bytes to its end, waiting on this thread (woken by the body's
/// producer); past `limit` bytes, an error (the body is dropped: its producer stops).
pub(crate) fn read_stream(
    mut body: std::pin::Pin<
        Box<dyn http_body::Body<Data = bytes::Bytes, Error = dpumesh_host::body::BoxError> + Send>,
    >,
    limit: usize,
) -> Result<Vec<u8>, String> {
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: std::sync::Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = std::task::Waker::from(std::sync::Arc::new(Unpark(std::thread::current())));
    let mut cx = std::task::Context::from_waker(&waker);
    let mut out = Vec::new();
    loop {
        match body.as_mut().poll_frame(&mut cx) {
            std::task::Poll::Pending => std::thread::park(),
            std::task::Poll::Ready(None) => return Ok(out),
            std::task::Poll::Ready(Some(Err(e))) => return Err(e.to_string()),
            std::task::Poll::Ready(Some(Ok(frame))) => {
                if let Ok(data) = frame.into_data() {
                    if out.len() + data.len() > limit {
                        return Err(format!("the streamed answer is over {limit} bytes"));
                    }
                    out.extend_from_slice(&data);
                }
            }
        }
    }
}

//! `dpumesh._native.BodyReader`: a request body that streams (an upload the node
//! sends in parts), read by an asyncio task of the concurrent ASGI dispatcher. `poll`
//! never waits: it gives what is there, or registers a wake-up (a Python callable,
//! called from whichever thread delivers the next part) and says so. Reading frees
//! the pod's slots, so the client is slowed to the app's pace (the node's window);
//! dropping the reader stops the upload.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use dpumesh_host::body::BoxError;
use http_body::Body;
use parking_lot::Mutex;
use pyo3::exceptions::PyConnectionError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes};

type Boxed = Pin<Box<dyn Body<Data = bytes::Bytes, Error = BoxError> + Send>>;

/// A request body arriving in parts.
#[pyclass(name = "BodyReader", module = "dpumesh._native", frozen)]
pub(crate) struct BodyReader {
    /// None once it ended, failed or was dropped.
    body: Mutex<Option<Boxed>>,
}

impl BodyReader {
    pub(crate) fn new(body: Boxed) -> Self {
        Self {
            body: Mutex::new(Some(body)),
        }
    }
}

/// Calls its Python callable when the body has more.
struct PyWake(Py<PyAny>);

impl Wake for PyWake {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        Python::attach(|py| {
            if let Err(e) = self.0.bind(py).call0() {
                e.print(py);
            }
        });
    }
}

#[pymethods]
impl BodyReader {
    /// The next part (bytes), `None` at the end, or `False` when nothing is there yet:
    /// `wake()` is then called (maybe from another thread) when more is. Raises
    /// `ConnectionError` when the body was cut (its client left, or the mesh aborted
    /// it).
    fn poll<'py>(&self, py: Python<'py>, wake: Py<PyAny>) -> PyResult<Bound<'py, PyAny>> {
        let mut body = self.body.lock();
        let Some(stream) = body.as_mut() else {
            return Ok(py.None().into_bound(py));
        };
        let waker = Waker::from(Arc::new(PyWake(wake)));
        let mut cx = Context::from_waker(&waker);
        loop {
            match stream.as_mut().poll_frame(&mut cx) {
                Poll::Pending => return Ok(PyBool::new(py, false).to_owned().into_any()),
                Poll::Ready(None) => {
                    *body = None;
                    return Ok(py.None().into_bound(py));
                }
                Poll::Ready(Some(Err(e))) => {
                    *body = None;
                    return Err(PyConnectionError::new_err(format!(
                        "the request's body was cut: {e}"
                    )));
                }
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) if !data.is_empty() => {
                        return Ok(PyBytes::new(py, &data).into_any());
                    }
                    // Trailers (an ASGI app has no place for a request's) and empty
                    // parts: read on.
                    _ => {}
                },
            }
        }
    }

    /// Stops the upload (the node hears the body is not wanted).
    fn close(&self) {
        self.body.lock().take();
    }
}

//! The service's handler: the request goes to the Python dispatcher (`dpumesh.wsgi`),
//! which runs the WSGI app; its answer is either a response to send as is or the graph
//! the handler scheduled, turned into the Rust library's nodes here.

use std::sync::Arc;

use dpumesh_host::{ExecutionContext, HttpResponse};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

use crate::graph::{Helpers, error_text, is_graph, node};
use crate::reader::BodyReader;
use crate::reply::Reply;
use crate::result::{header_map, header_text};

/// Pool threads keep one interpreter thread state for their whole life: attached once,
/// then detached while they wait for work, so each internal step only takes the GIL.
/// (Attaching from a thread without a state makes one per step and frees it after,
/// which costs an mmap/munmap pair per step and a TLB shootdown across the cores.)
pub(crate) fn worker_scope() -> dpumesh_host::WorkerScope {
    Arc::new(|run: &mut (dyn FnMut() + Send)| Python::attach(|py| py.detach(run)))
}

/// Calls `dispatch(method, target, headers, body, caller)` for each request; `caller`
/// is `(scheme, address, port, identity)` as the mesh says it (or `None`).
pub(crate) struct PyHandler {
    dispatch: Py<PyAny>,
    helpers: Arc<Helpers>,
    /// The dispatcher takes a sixth argument, the request's [`Reply`], and may
    /// answer later through it (returning `None`): an ASGI app served concurrently.
    deferred: bool,
}

/// What the dispatcher made of a request.
enum Outcome {
    /// Answer with this.
    Answer(Box<HttpResponse>),
    /// The graph's nodes were added to the context.
    Graph,
    /// The answer comes through the request's reply.
    Later,
}

impl Outcome {
    fn answer(response: HttpResponse) -> Self {
        Self::Answer(Box::new(response))
    }
}

fn text(status: u16, body: String) -> HttpResponse {
    HttpResponse::new(status, body).header("content-type", "text/plain; charset=utf-8")
}

impl PyHandler {
    pub(crate) fn new(py: Python<'_>, dispatch: Py<PyAny>) -> PyResult<Self> {
        Ok(Self {
            dispatch,
            helpers: Helpers::load(py)?,
            deferred: false,
        })
    }

    /// A handler whose dispatcher may answer later, through a [`Reply`].
    pub(crate) fn deferred(py: Python<'_>, dispatch: Py<PyAny>) -> PyResult<Self> {
        Ok(Self {
            deferred: true,
            ..Self::new(py, dispatch)?
        })
    }

    /// Builds `ctx`'s graph (or its one answer) from what the app did.
    pub(crate) fn handle(&self, ctx: &mut ExecutionContext) {
        let (reply, later) = match self.deferred {
            true => {
                let (reply, answer) = crate::reply::deferred();
                (Some(reply), Some(answer))
            }
            false => (None, None),
        };
        match Python::attach(|py| self.dispatch(py, ctx, reply)) {
            Outcome::Answer(response) => {
                ctx.respond(move |_| Ok::<_, std::convert::Infallible>(*response));
            }
            Outcome::Graph => {}
            Outcome::Later => {
                // An asynchronous step on the loop's thread: it holds no thread while
                // the app works. Only a deferred handler answers later.
                if let Some(answer) = later {
                    ctx.respond_future(move |_| answer);
                }
            }
        }
    }

    /// Adds the graph's nodes to `ctx`, or says what to answer with.
    fn dispatch(
        &self,
        py: Python<'_>,
        ctx: &mut ExecutionContext,
        reply: Option<Reply>,
    ) -> Outcome {
        let request = ctx.request();
        let headers = PyList::empty(py);
        for (name, value) in &request.headers {
            let pair = PyTuple::new(py, [name.as_str().to_owned(), header_text(value)]);
            if let Err(e) = pair.and_then(|p| headers.append(p)) {
                return Outcome::answer(text(
                    500,
                    format!(
                        "cannot hand the request to Python: {}\n",
                        error_text(py, &e)
                    ),
                ));
            }
        }
        // A deferred dispatcher reads a streamed body as it comes; the others get
        // bodies whole (the loop collects them: it streams none to them).
        let streamed = match &reply {
            Some(_) => request.stream.as_ref().and_then(|s| s.take()),
            None => None,
        };
        let body = match streamed {
            Some(stream) => match Bound::new(py, BodyReader::new(stream)) {
                Ok(reader) => reader.into_any(),
                Err(e) => {
                    return Outcome::answer(text(
                        500,
                        format!("cannot hand the body to Python: {}\n", error_text(py, &e)),
                    ));
                }
            },
            None => PyBytes::new(py, &request.body).into_any(),
        };
        let caller = request.caller.as_ref().map(|c| {
            (
                c.scheme.as_str(),
                c.addr.ip().to_string(),
                c.addr.port(),
                c.identity.as_deref(),
            )
        });
        let (method, url) = (request.method.as_str(), request.url.as_str());
        let deferred = reply.is_some();
        let called = match reply {
            Some(reply) => self
                .dispatch
                .bind(py)
                .call1((method, url, headers, body, caller, reply)),
            None => self
                .dispatch
                .bind(py)
                .call1((method, url, headers, body, caller)),
        };
        let value = match called {
            Ok(v) => v,
            Err(e) => {
                // The dispatcher catches the app's exceptions; this is its own failure.
                e.print(py);
                return Outcome::answer(text(
                    500,
                    format!("dpumesh dispatcher failed: {}\n", error_text(py, &e)),
                ));
            }
        };
        if deferred && value.is_none() {
            return Outcome::Later;
        }
        if is_graph(&value) {
            let nodes = value.try_iter().and_then(|it| {
                it.map(|n| node(py, &n?, &self.helpers))
                    .collect::<PyResult<Vec<_>>>()
            });
            return match nodes {
                Ok(nodes) => {
                    for n in nodes {
                        ctx.add(n);
                    }
                    Outcome::Graph
                }
                Err(e) => Outcome::answer(text(
                    500,
                    format!("the handler's graph is not valid: {}\n", error_text(py, &e)),
                )),
            };
        }
        Outcome::answer(response(&value).unwrap_or_else(|e| {
            text(
                500,
                format!(
                    "the handler's response is not valid: {}\n",
                    error_text(py, &e)
                ),
            )
        }))
    }
}

/// `(status, [(name, value)], bytes)` as a response, or `(status, headers, first,
/// rest)`: a streamed answer whose parts after `first` come from the generator
/// `rest` ([`stream_from`]).
fn response(value: &Bound<'_, PyAny>) -> PyResult<HttpResponse> {
    type Whole<'py> = (u16, Vec<(String, String)>, Bound<'py, PyAny>);
    type Streamed<'py> = (
        u16,
        Vec<(String, String)>,
        Bound<'py, PyAny>,
        Bound<'py, PyAny>,
    );
    let ((status, headers, body), rest) = match value.extract::<Streamed<'_>>() {
        Ok((status, headers, body, rest)) => ((status, headers, body), Some(rest)),
        Err(_) => (value.extract::<Whole<'_>>()?, None),
    };
    let body = bytes::Bytes::copy_from_slice(body.cast::<PyBytes>()?.as_bytes());
    let headers = header_map(&headers, "the response")?;
    let mut response = match rest {
        Some(rest) => HttpResponse::streaming(status, stream_from(rest.unbind())),
        None => HttpResponse::new(status, bytes::Bytes::new()),
    };
    response.headers = headers;
    response.body = body;
    Ok(response)
}

/// A body fed by a Python generator of bytes, from a thread of its own (it takes the
/// GIL for each part and waits, released, while the client is slow). The generator
/// is closed when the client leaves (its `finally` runs); an exception aborts the
/// body.
fn stream_from(rest: Py<PyAny>) -> dpumesh_host::body::Receiver {
    let (mut tx, rx) = dpumesh_host::body::channel(2);
    std::thread::spawn(move || {
        loop {
            let next = Python::attach(|py| match rest.bind(py).call_method0("__next__") {
                Ok(part) => part
                    .cast::<PyBytes>()
                    .map(|b| Some(bytes::Bytes::copy_from_slice(b.as_bytes())))
                    .map_err(|_| "the generator yielded something that is not bytes".to_owned()),
                Err(e) if e.is_instance_of::<pyo3::exceptions::PyStopIteration>(py) => Ok(None),
                Err(e) => Err(format!("the generator raised: {}", error_text(py, &e))),
            });
            match next {
                Ok(Some(part)) => {
                    if tx.blocking_send(part).is_err() {
                        // The client left: the generator's `finally` runs now.
                        Python::attach(|py| {
                            let _ = rest.bind(py).call_method0("close");
                        });
                        return;
                    }
                }
                Ok(None) => return,
                Err(why) => {
                    let _ = tx.blocking_abort(why);
                    return;
                }
            }
        }
    });
    rx
}

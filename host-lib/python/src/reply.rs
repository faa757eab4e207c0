//! `dpumesh._native.Reply`: the answer to one request, given later. An ASGI app served
//! concurrently (`dpumesh.asgi`) runs as an asyncio task; the handler hands the
//! request's `Reply` to the dispatcher and answers with an asynchronous step that
//! waits for it ([`deferred`]). The app's `send` fills it in: a whole answer, or a
//! head whose body streams through a bounded channel (back-pressure: `send` says
//! when it is full, and the dispatcher waits off the loop's thread with
//! `send_blocking`).
//!
//! Everything but `send_blocking` runs on the loop's thread (the asyncio loop's), so
//! the lock is never contended there; `send_blocking` sends on a clone of the
//! channel's sender, the lock released.

use std::sync::Arc;

use bytes::Bytes;
use dpumesh_host::HttpResponse;
use dpumesh_host::body::{Sender, TrySendError};
use parking_lot::Mutex;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::result::header_map;

/// Where the answer is.
enum State {
    /// Not given yet: the step waits on the other half.
    Waiting(tokio::sync::oneshot::Sender<HttpResponse>),
    /// The head went; the body's later parts go here.
    Streaming(Sender),
    /// Given whole, ended, or the request is gone.
    Done,
}

/// What one request's reply and its waiting step share.
pub(crate) struct Shared {
    state: Mutex<State>,
    /// Called (on the loop's thread) when the request ends before it was answered:
    /// its client left, or its deadline passed. Set by the dispatcher.
    on_gone: Mutex<Option<Py<PyAny>>>,
}

/// The answer to one request, filled in by the ASGI dispatcher.
#[pyclass(name = "Reply", module = "dpumesh._native", frozen)]
pub(crate) struct Reply {
    shared: Arc<Shared>,
}

fn bytes_of(body: &Bound<'_, PyBytes>) -> Bytes {
    Bytes::copy_from_slice(body.as_bytes())
}

#[pymethods]
impl Reply {
    /// Starts the answer: `status`, `headers` (`(name, value)` text pairs) and the
    /// body's first part; with `more`, later parts follow through `send`. False when
    /// the request is gone (nothing to answer).
    fn start(
        &self,
        status: u16,
        headers: Vec<(String, String)>,
        body: &Bound<'_, PyBytes>,
        more: bool,
    ) -> PyResult<bool> {
        let headers = header_map(&headers, "the ASGI app's response")?;
        let mut state = self.shared.state.lock();
        let tx = match std::mem::replace(&mut *state, State::Done) {
            State::Waiting(tx) => tx,
            State::Done => return Ok(false),
            streaming @ State::Streaming(_) => {
                *state = streaming;
                return Err(PyRuntimeError::new_err("the response was started twice"));
            }
        };
        let mut response = if more {
            // Four parts wait at most: the app is slowed to its client's pace.
            let (body_tx, body_rx) = dpumesh_host::body::channel(4);
            *state = State::Streaming(body_tx);
            HttpResponse::streaming(status, body_rx)
        } else {
            HttpResponse::new(status, Bytes::new())
        };
        response.headers = headers;
        response.body = bytes_of(body);
        if tx.send(response).is_err() {
            *state = State::Done;
            return Ok(false);
        }
        Ok(true)
    }

    /// Sends a later part of a streamed body (`more`: parts follow). `"sent"`,
    /// `"full"` (nothing was sent: send it with `send_blocking` off the loop's
    /// thread) or `"closed"` (the client is gone).
    fn send(&self, body: &Bound<'_, PyBytes>, more: bool) -> PyResult<&'static str> {
        let mut state = self.shared.state.lock();
        let State::Streaming(tx) = &mut *state else {
            return match &*state {
                State::Done => Ok("closed"),
                _ => Err(PyRuntimeError::new_err(
                    "a body part was sent before the response started",
                )),
            };
        };
        let data = body.as_bytes();
        if !data.is_empty() {
            match tx.try_send(Bytes::copy_from_slice(data)) {
                Ok(()) => {}
                Err(TrySendError::Full) => return Ok("full"),
                Err(TrySendError::Closed) => {
                    *state = State::Done;
                    return Ok("closed");
                }
            }
        }
        if !more {
            // Dropping the sender ends the body.
            *state = State::Done;
        }
        Ok("sent")
    }

    /// `send` that waits for room, with the interpreter released: for a thread other
    /// than the loop's (the dispatcher runs it in an executor). False when the client
    /// is gone.
    fn send_blocking(&self, py: Python<'_>, body: &Bound<'_, PyBytes>, more: bool) -> bool {
        let Some(mut tx) = (match &*self.shared.state.lock() {
            State::Streaming(tx) => Some(tx.clone()),
            _ => None,
        }) else {
            return false;
        };
        let data = bytes_of(body);
        let sent = data.is_empty() || py.detach(move || tx.blocking_send(data).is_ok());
        if !sent || !more {
            *self.shared.state.lock() = State::Done;
        }
        sent
    }

    /// Aborts a streamed body (the client sees it incomplete, not ended), or answers
    /// 500 with `why` when nothing was sent yet.
    fn fail(&self, why: String) {
        let mut state = self.shared.state.lock();
        match std::mem::replace(&mut *state, State::Done) {
            State::Waiting(tx) => {
                let response = HttpResponse::new(500, format!("{why}\n"))
                    .header("content-type", "text/plain; charset=utf-8");
                let _ = tx.send(response);
            }
            State::Streaming(mut tx) => {
                // An abort must not wait on the loop's thread: a full channel takes it
                // from a thread of its own (a rare path).
                std::thread::spawn(move || {
                    let _ = tx.blocking_abort(why);
                });
            }
            State::Done => {}
        }
    }

    /// Calls `callback()` on the loop's thread if the request ends before it is
    /// answered (its client left, its deadline passed).
    fn on_gone(&self, callback: Py<PyAny>) {
        *self.shared.on_gone.lock() = Some(callback);
    }

    /// Whether the answer was given whole or ended, or the request is gone.
    #[getter]
    fn done(&self) -> bool {
        matches!(*self.shared.state.lock(), State::Done)
    }
}

/// Ends a request's wait: if it is dropped before the answer came (the loop dropped
/// the step), the dispatcher hears the request is gone.
struct Watch(Arc<Shared>);

impl Drop for Watch {
    fn drop(&mut self) {
        let gone = {
            let mut state = self.0.state.lock();
            let waiting = matches!(*state, State::Waiting(_));
            if waiting {
                *state = State::Done;
            }
            waiting
        };
        // Taken in every case: the callback refers to the dispatcher's objects, which
        // refer to this reply (a cycle Python's collector cannot see through Rust).
        let callback = self.0.on_gone.lock().take();
        if let Some(callback) = callback.filter(|_| gone) {
            Python::attach(|py| {
                if let Err(e) = callback.bind(py).call0() {
                    e.print(py);
                }
            });
        }
    }
}

/// A new reply, and the future that answers its request with it (an asynchronous
/// step's: see [`dpumesh_host::ExecutionContext::respond_future`]).
pub(crate) fn deferred() -> (
    Reply,
    impl std::future::Future<Output = Result<HttpResponse, String>> + Send + 'static,
) {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let shared = Arc::new(Shared {
        state: Mutex::new(State::Waiting(tx)),
        on_gone: Mutex::new(None),
    });
    let watch = Watch(shared.clone());
    let answer = async move {
        let _watch = watch;
        rx.await
            .map_err(|_| "the ASGI app's reply was dropped unanswered".to_owned())
    };
    (Reply { shared }, answer)
}

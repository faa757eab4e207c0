//! The seam between the event loop and the data path. A transport delivers incoming
//! requests and egress completions, sends egress requests and final responses, tells
//! the time, and can be woken from other threads (internal steps finish on the pool).
//!
//! The in-memory implementation ([`crate::memory`]) runs on a virtual clock for tests
//! and benchmarks; the data-path implementation (RX/TX descriptors through `dpa`)
//! comes with the mesh.

use std::sync::Arc;
use std::time::Duration;

use crate::http::{HttpRequest, HttpResponse};

/// The `(req_id, step_id)` pair an egress request travels with (in descriptors on the
/// data path) and its completion comes back with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tag {
    /// The execution context (with its generation).
    pub req_id: u32,
    /// The request within the context.
    pub step_id: u32,
}

/// Names an incoming request until it is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IncomingId(pub u64);

/// What a transport delivers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A new request for this service.
    Request {
        /// Its id, for the answer.
        id: IncomingId,
        /// The request.
        request: HttpRequest,
    },
    /// An egress request finished (or could not be carried).
    Completion {
        /// The tag it was sent with.
        tag: Tag,
        /// The response, or why there is none.
        outcome: Result<HttpResponse, String>,
    },
}

/// Why a transport operation failed.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// The transport is closed.
    #[error("transport closed")]
    Closed,
    /// Anything the implementation reports.
    #[error("{0}")]
    Other(String),
}

/// How an egress call takes an answer whose body streams (a download, server-sent
/// events, a gRPC server stream).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AnswerBody {
    /// Collected whole before the call completes, up to the transport's limit (past
    /// it the call fails): what a graph's steps get, since a step's result is whole.
    #[default]
    Whole,
    /// As it comes ([`HttpResponse::stream`]): the call completes with the head and
    /// the body follows, read at the caller's pace (an [`crate::Outbound`] caller
    /// forwarding it, as a bridge's egress port does).
    Streamed,
}

/// Wakes a transport's `poll` from another thread.
pub type Waker = Arc<dyn Fn() + Send + Sync>;

/// What the event loop runs on.
pub trait Transport: Send {
    /// Time since the transport started (monotonic; virtual in tests).
    fn now(&self) -> Duration;

    /// Sends an egress request. A request that cannot be carried may instead come
    /// back as a failed completion.
    fn send_request(&mut self, tag: Tag, request: HttpRequest) -> Result<(), TransportError>;

    /// Sends an egress request whose answer, if its body streams, is taken as
    /// `answer` says. A transport whose answers always arrive whole sends it as
    /// [`Transport::send_request`] does.
    fn send_call(
        &mut self,
        tag: Tag,
        request: HttpRequest,
        answer: AnswerBody,
    ) -> Result<(), TransportError> {
        let _ = answer;
        self.send_request(tag, request)
    }

    /// Answers an incoming request.
    fn send_response(
        &mut self,
        id: IncomingId,
        response: HttpResponse,
    ) -> Result<(), TransportError>;

    /// Appends what has arrived to `out`, waiting up to `timeout` if nothing has (or
    /// until woken). `idle` says the loop has nothing else in flight (no internal step
    /// running), so a virtual clock may move on.
    fn poll(
        &mut self,
        timeout: Option<Duration>,
        idle: bool,
        out: &mut Vec<Event>,
    ) -> Result<(), TransportError>;

    /// A function that makes a waiting `poll` return.
    fn waker(&self) -> Waker;

    /// Which received requests' bodies stream to the handler as they arrive
    /// ([`crate::HttpRequest::stream`]) rather than being collected whole first (up
    /// to `whole_limit` bytes); a transport whose bodies always arrive whole ignores
    /// it.
    fn stream_requests(&mut self, _wants: fn(&HttpRequest) -> bool, _whole_limit: usize) {}

    /// The most a streamed answer collected whole ([`AnswerBody::Whole`]) may hold;
    /// a transport whose answers always arrive whole ignores it.
    fn answer_limit(&mut self, _whole_limit: usize) {}
}

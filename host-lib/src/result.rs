//! What a step produces ([`StepResult`]), why it failed ([`StepError`]), and the
//! results a step receives from the steps it depends on ([`Inputs`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::HeaderMap;

use crate::body::BodyStream;
use crate::http::HttpResponse;

/// A step's name: given by the handler, or `step-N` in scheduling order.
pub type StepId = String;

/// Why a step failed. Each maps to one response status when it fails the request (see
/// [`StepError::status`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StepError {
    /// An egress call got an error status (≥ 400).
    #[error("upstream answered {0}")]
    Status(u16),
    /// An egress call could not be carried (no route, connection refused, …).
    #[error("transport: {0}")]
    Transport(String),
    /// The step did not finish within its timeout.
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    /// An internal step panicked.
    #[error("panicked: {0}")]
    Panicked(String),
    /// An internal step returned an error.
    #[error("failed: {0}")]
    Failed(String),
    /// Steps of a parallel block failed (the block let the others finish).
    #[error("parallel steps failed: {}", .0.join(", "))]
    Parallel(Vec<StepId>),
    /// The graph is not valid (duplicate id, unknown input, input from a step that
    /// runs at the same time).
    #[error("invalid graph: {0}")]
    Graph(String),
}

impl StepError {
    /// The status a request that fails with this error is answered with.
    pub fn status(&self) -> u16 {
        match self {
            Self::Status(_) | Self::Transport(_) => 502,
            Self::Timeout(_) => 504,
            Self::Panicked(_) | Self::Failed(_) | Self::Graph(_) => 500,
            Self::Parallel(_) => 502,
        }
    }
}

/// What a step produced.
///
/// Egress steps: the response's status, headers and body. Internal steps: what the
/// function returned (status 200 unless it said otherwise). A step whose request
/// builder returned no request is `skipped` (and `ok`). A fan-out step (several
/// requests) has one entry per request in `parts`, in request order; its own status is
/// that of the first failing part, or 200.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepResult {
    /// The step.
    pub id: StepId,
    /// Status code.
    pub status: u16,
    /// Headers.
    pub headers: HeaderMap,
    /// Body.
    pub body: Bytes,
    /// Trailer fields (a gRPC call's status); empty: none.
    pub trailers: HeaderMap,
    /// Why it failed, if it did.
    pub error: Option<StepError>,
    /// `error.is_none()`.
    pub ok: bool,
    /// The step had nothing to do (its request builder returned no request).
    pub skipped: bool,
    /// Per-request results of a fan-out step.
    pub parts: Vec<StepResult>,
    /// The rest of the body, streamed after `body` (a step that answers with
    /// [`HttpResponse::streaming`]); shared by clones, sent once.
    pub stream: Option<BodyStream>,
}

impl StepResult {
    /// A successful result.
    pub fn success(id: impl Into<StepId>, status: u16, headers: HeaderMap, body: Bytes) -> Self {
        Self {
            id: id.into(),
            status,
            headers,
            body,
            trailers: HeaderMap::new(),
            error: None,
            ok: true,
            skipped: false,
            parts: Vec::new(),
            stream: None,
        }
    }

    /// A failed result.
    pub fn failure(id: impl Into<StepId>, error: StepError) -> Self {
        let status = match &error {
            StepError::Status(s) => *s,
            e => e.status(),
        };
        Self {
            id: id.into(),
            status,
            headers: HeaderMap::new(),
            body: Bytes::new(),
            trailers: HeaderMap::new(),
            error: Some(error),
            ok: false,
            skipped: false,
            parts: Vec::new(),
            stream: None,
        }
    }

    /// A skipped step.
    pub fn skipped(id: impl Into<StepId>) -> Self {
        Self {
            skipped: true,
            ..Self::success(id, 204, HeaderMap::new(), Bytes::new())
        }
    }

    /// From an egress response: an error status fails the step.
    pub fn from_response(id: impl Into<StepId>, response: HttpResponse) -> Self {
        let id = id.into();
        if response.status >= 400 {
            Self {
                headers: response.headers,
                body: response.body,
                trailers: response.trailers,
                ..Self::failure(id, StepError::Status(response.status))
            }
        } else {
            Self {
                trailers: response.trailers,
                ..Self::success(id, response.status, response.headers, response.body)
            }
        }
    }

    /// The body as text (lossy).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// As the response a handler answers with.
    pub fn to_response(&self) -> HttpResponse {
        HttpResponse {
            status: self.status,
            headers: self.headers.clone(),
            body: self.body.clone(),
            trailers: self.trailers.clone(),
            stream: self.stream.clone(),
        }
    }
}

/// What an internal step returns on success: a body, and optionally a status and
/// headers (when it answers the request).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StepOutput {
    /// Status (200 by default).
    pub status: Option<u16>,
    /// Headers.
    pub headers: HeaderMap,
    /// Body.
    pub body: Bytes,
    /// Trailer fields.
    pub trailers: HeaderMap,
    /// The rest of the body, streamed ([`HttpResponse::streaming`]).
    pub stream: Option<BodyStream>,
}

impl From<String> for StepOutput {
    fn from(s: String) -> Self {
        Self {
            body: Bytes::from(s),
            ..Self::default()
        }
    }
}

impl From<&str> for StepOutput {
    fn from(s: &str) -> Self {
        Self::from(s.to_owned())
    }
}

impl From<Vec<u8>> for StepOutput {
    fn from(v: Vec<u8>) -> Self {
        Self {
            body: Bytes::from(v),
            ..Self::default()
        }
    }
}

impl From<Bytes> for StepOutput {
    fn from(body: Bytes) -> Self {
        Self {
            body,
            ..Self::default()
        }
    }
}

impl From<()> for StepOutput {
    fn from((): ()) -> Self {
        Self::default()
    }
}

impl From<HttpResponse> for StepOutput {
    fn from(r: HttpResponse) -> Self {
        Self {
            status: Some(r.status),
            headers: r.headers,
            body: r.body,
            trailers: r.trailers,
            stream: r.stream,
        }
    }
}

/// The results of the steps a step depends on, by id.
#[derive(Debug, Clone, Default)]
pub struct Inputs {
    results: HashMap<StepId, Arc<StepResult>>,
}

impl Inputs {
    pub(crate) fn new(results: HashMap<StepId, Arc<StepResult>>) -> Self {
        Self { results }
    }

    /// The result of step `id`, if it is an input.
    pub fn get(&self, id: &str) -> Option<&StepResult> {
        self.results.get(id).map(Arc::as_ref)
    }

    /// How many inputs there are.
    pub fn len(&self) -> usize {
        self.results.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.results.is_empty()
    }

    /// Every input, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = &StepResult> {
        self.results.values().map(Arc::as_ref)
    }
}

impl std::ops::Index<&str> for Inputs {
    type Output = StepResult;

    /// The result of input `id`; a step asking for one it did not declare panics (and
    /// the step fails naming it).
    fn index(&self, id: &str) -> &StepResult {
        self.get(id)
            .unwrap_or_else(|| panic!("step input {id:?} was not declared in `inputs`"))
    }
}

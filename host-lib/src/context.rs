//! The high-level API: a handler gets an [`ExecutionContext`] and
//! schedules steps; it returns at once, and the event loop runs the graph.
//!
//! Steps scheduled one after another run in that order (a sequence stops at the first
//! failure); steps inside [`ExecutionContext::parallel`] run at the same time.
//!
//! **The response** is the result of the graph's last step: the step scheduled with
//! [`ExecutionContext::respond`] if there is one, else the last step of the top-level
//! sequence (for a parallel block, its last member). A handler that schedules nothing
//! answers 200 with an empty body. A failed request answers with the status of its
//! error ([`StepError::status`](crate::StepError::status): 502 for upstream errors and
//! failed parallel blocks, 504 for timeouts, 500 for internal failures) and a body
//! naming the step and the cause.

use std::time::Duration;

use bytes::Bytes;
use http::Method;

use crate::graph::{EgressStep, InternalStep, Requests, Step};
use crate::http::HttpRequest;
use crate::result::{Inputs, StepId, StepOutput};

/// A scheduled step, for naming it in another step's `inputs`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct StepRef(pub StepId);

impl AsRef<str> for StepRef {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

enum FrameKind {
    Sequence,
    Parallel,
}

struct Frame {
    kind: FrameKind,
    steps: Vec<Step>,
}

/// One request's graph under construction.
pub struct ExecutionContext {
    request: HttpRequest,
    stack: Vec<Frame>,
    next: usize,
    response: Option<StepId>,
}

impl std::fmt::Debug for ExecutionContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExecutionContext")
            .field("request", &self.request.url)
            .finish_non_exhaustive()
    }
}

impl ExecutionContext {
    /// A context for `request`.
    pub fn new(request: HttpRequest) -> Self {
        Self {
            request,
            stack: vec![Frame {
                kind: FrameKind::Sequence,
                steps: Vec::new(),
            }],
            next: 0,
            response: None,
        }
    }

    /// The request being handled.
    pub fn request(&self) -> &HttpRequest {
        &self.request
    }

    /// Takes the request out (leaving an empty `GET /`), for a handler that hands it
    /// whole to another framework ([`crate::tower::handler`]) rather than copy it.
    pub fn take_request(&mut self) -> HttpRequest {
        std::mem::replace(&mut self.request, HttpRequest::get("/"))
    }

    fn generated_id(&mut self) -> StepId {
        let id = format!("step-{}", self.next);
        self.next += 1;
        id
    }

    fn frame(&mut self) -> &mut Frame {
        self.stack
            .last_mut()
            .expect("the root frame is never popped")
    }

    fn in_parallel(&self) -> bool {
        matches!(
            self.stack.last().map(|f| &f.kind),
            Some(FrameKind::Parallel)
        )
    }

    /// Schedules an egress call. The URL names the service (`http://user-service/me`);
    /// the data path resolves it to a pod or another node.
    pub fn call(&mut self, method: Method, url: &str) -> CallBuilder<'_> {
        let id = self.generated_id();
        let concurrent = self.in_parallel();
        let mut step = EgressStep::new(id, vec![HttpRequest::new(method, url)]);
        step.concurrent = concurrent;
        self.frame().steps.push(Step::Egress(step));
        CallBuilder { ctx: self }
    }

    /// A GET.
    pub fn get(&mut self, url: &str) -> CallBuilder<'_> {
        self.call(Method::GET, url)
    }

    /// Schedules CPU work on the thread pool, with the results of its `inputs`.
    pub fn run_internal<F, O, E>(&mut self, func: F) -> InternalBuilder<'_>
    where
        F: FnOnce(&Inputs) -> Result<O, E> + Send + 'static,
        O: Into<StepOutput>,
        E: std::fmt::Display,
    {
        let id = self.generated_id();
        self.schedule(InternalStep::new(id, Vec::new(), func), false)
    }

    /// Schedules the step whose output answers the request (it runs after everything
    /// scheduled before it, like any step of the sequence). It runs on the event
    /// loop's thread, not the pool: assembling an answer is quick, and a hand-off to
    /// another thread and back would cost more than it. Put heavy work in
    /// [`ExecutionContext::run_internal`] and let `respond` take its result.
    pub fn respond<F, O, E>(&mut self, func: F) -> InternalBuilder<'_>
    where
        F: FnOnce(&Inputs) -> Result<O, E> + Send + 'static,
        O: Into<StepOutput>,
        E: std::fmt::Display,
    {
        let id = self.generated_id();
        self.schedule(InternalStep::new(id, Vec::new(), func).on_loop(), true)
    }

    /// Schedules a future (made from the results of the step's `inputs`) on the event
    /// loop's thread: polled when its turn comes and whenever its waker is called, it
    /// holds no thread while it waits (for a socket, a timer). For async code: a
    /// `tower::Service` ([`crate::tower`]), an async client. It must not block.
    pub fn run_future<F, Fut, O, E>(&mut self, make: F) -> InternalBuilder<'_>
    where
        F: FnOnce(&Inputs) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = Result<O, E>> + Send + 'static,
        O: Into<StepOutput>,
        E: std::fmt::Display,
    {
        let id = self.generated_id();
        self.schedule(InternalStep::future(id, Vec::new(), make), false)
    }

    /// [`ExecutionContext::run_future`] whose output answers the request (as
    /// [`ExecutionContext::respond`]'s does).
    pub fn respond_future<F, Fut, O, E>(&mut self, make: F) -> InternalBuilder<'_>
    where
        F: FnOnce(&Inputs) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = Result<O, E>> + Send + 'static,
        O: Into<StepOutput>,
        E: std::fmt::Display,
    {
        let id = self.generated_id();
        self.schedule(InternalStep::future(id, Vec::new(), make), true)
    }

    /// Adds `step` to the current block; with `responds`, its output answers.
    fn schedule(&mut self, step: InternalStep, responds: bool) -> InternalBuilder<'_> {
        if responds {
            self.response = Some(step.id.clone());
        }
        self.frame().steps.push(Step::Internal(step));
        InternalBuilder { ctx: self }
    }

    /// Steps scheduled inside `block` run at the same time.
    pub fn parallel(&mut self, block: impl FnOnce(&mut Self)) {
        self.stack.push(Frame {
            kind: FrameKind::Parallel,
            steps: Vec::new(),
        });
        block(self);
        let frame = self.stack.pop().expect("pushed above");
        self.frame().steps.push(Step::Pipe(frame.steps));
    }

    /// Steps scheduled inside `block` run one after another (useful inside a parallel
    /// block).
    pub fn sequence(&mut self, block: impl FnOnce(&mut Self)) {
        self.stack.push(Frame {
            kind: FrameKind::Sequence,
            steps: Vec::new(),
        });
        block(self);
        let frame = self.stack.pop().expect("pushed above");
        self.frame().steps.push(Step::Order(frame.steps));
    }

    /// Adds a low-level step (built with [`order`](crate::order), [`pipe`](crate::pipe),
    /// [`EgressStep`], [`InternalStep`]) to the current block.
    pub fn add(&mut self, step: impl Into<Step>) {
        self.frame().steps.push(step.into());
    }

    /// The graph, and the id of the step that answers (if one was named).
    pub(crate) fn into_graph(mut self) -> (Step, Option<StepId>) {
        while self.stack.len() > 1 {
            let frame = self.stack.pop().expect("len > 1");
            self.frame().steps.push(match frame.kind {
                FrameKind::Parallel => Step::Pipe(frame.steps),
                FrameKind::Sequence => Step::Order(frame.steps),
            });
        }
        let root = self.stack.pop().expect("the root frame");
        (Step::Order(root.steps), self.response)
    }

    fn last(&mut self) -> &mut Step {
        self.frame()
            .steps
            .last_mut()
            .expect("a builder follows its step")
    }
}

fn ids(inputs: impl IntoIterator<Item = impl AsRef<str>>) -> Vec<StepId> {
    inputs.into_iter().map(|s| s.as_ref().to_owned()).collect()
}

/// Options of the egress step just scheduled.
pub struct CallBuilder<'a> {
    ctx: &'a mut ExecutionContext,
}

impl CallBuilder<'_> {
    fn step(&mut self) -> &mut EgressStep {
        match self.ctx.last() {
            Step::Egress(e) => e,
            _ => unreachable!("a CallBuilder follows an egress step"),
        }
    }

    fn request(&mut self) -> Option<&mut HttpRequest> {
        match &mut self.step().requests {
            Requests::Fixed(r) => r.first_mut(),
            Requests::Builder(_) => None,
        }
    }

    /// Names the step (ids must be unique in the request).
    pub fn id(mut self, id: &str) -> Self {
        let old = std::mem::replace(&mut self.step().id, id.to_owned());
        if self.ctx.response.as_ref() == Some(&old) {
            self.ctx.response = Some(id.to_owned());
        }
        self
    }

    /// Adds a header.
    pub fn header(mut self, name: &str, value: &str) -> Self {
        if let Some(r) = self.request() {
            let _ = r.try_header(name, value);
        }
        self
    }

    /// Sets the body.
    pub fn body(mut self, body: impl Into<Bytes>) -> Self {
        let body = body.into();
        if let Some(r) = self.request() {
            r.body = body;
        }
        self
    }

    /// Steps whose results the request builder gets.
    pub fn inputs(mut self, inputs: impl IntoIterator<Item = impl AsRef<str>>) -> Self {
        self.step().inputs = ids(inputs);
        self
    }

    /// Builds the requests from the inputs when the step starts (the URL given to
    /// `call` is then ignored): none skips the step, several fan out.
    pub fn request_builder(
        mut self,
        builder: impl FnOnce(&Inputs) -> Vec<HttpRequest> + Send + 'static,
    ) -> Self {
        self.step().requests = Requests::Builder(Box::new(move |inputs| Ok(builder(inputs))));
        self
    }

    /// The step must finish within `timeout`.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.step().timeout = Some(timeout);
        self
    }

    /// The step's reference.
    pub fn step_ref(mut self) -> StepRef {
        StepRef(self.step().id.clone())
    }
}

impl From<CallBuilder<'_>> for StepRef {
    fn from(b: CallBuilder<'_>) -> Self {
        b.step_ref()
    }
}

/// Options of the internal (or respond) step just scheduled.
pub struct InternalBuilder<'a> {
    ctx: &'a mut ExecutionContext,
}

impl InternalBuilder<'_> {
    fn step(&mut self) -> &mut InternalStep {
        match self.ctx.last() {
            Step::Internal(i) => i,
            _ => unreachable!("an InternalBuilder follows an internal step"),
        }
    }

    /// Names the step.
    pub fn id(mut self, id: &str) -> Self {
        let old = std::mem::replace(&mut self.step().id, id.to_owned());
        if self.ctx.response.as_ref() == Some(&old) {
            self.ctx.response = Some(id.to_owned());
        }
        self
    }

    /// Steps whose results it gets.
    pub fn inputs(mut self, inputs: impl IntoIterator<Item = impl AsRef<str>>) -> Self {
        self.step().inputs = ids(inputs);
        self
    }

    /// It must finish within `timeout`.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.step().timeout = Some(timeout);
        self
    }

    /// The step's reference.
    pub fn step_ref(mut self) -> StepRef {
        StepRef(self.step().id.clone())
    }
}

impl From<InternalBuilder<'_>> for StepRef {
    fn from(b: InternalBuilder<'_>) -> Self {
        b.step_ref()
    }
}

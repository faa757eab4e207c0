//! One request's graph in execution: node states, results, and the actions the event
//! loop carries out (send a request, run an internal step, arm a timer, forget a
//! step's outstanding requests). Pure state: no I/O, no threads, no clock.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use foldhash::{HashMap, HashMapExt};
use http::HeaderMap;

use crate::graph::{InternalFn, Requests, Step, StepFuture, Work, validate};
use crate::http::{HttpRequest, HttpResponse};
use crate::result::{Inputs, StepError, StepId, StepOutput, StepResult};

/// What the event loop does for a run.
// A `Send` carries its request by value: actions live in vectors the loop reuses
// every turn, so the size costs no allocation, and a box would cost one per call.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Action {
    /// Send request `part` of egress node `node`.
    Send {
        node: usize,
        part: usize,
        request: HttpRequest,
    },
    /// Run an asynchronous step's future on the loop.
    Spawn { node: usize, future: StepFuture },
    /// Run an internal step on the pool.
    Internal {
        node: usize,
        func: InternalFn,
        inputs: Inputs,
        /// Run it on the loop's thread, now.
        on_loop: bool,
    },
    /// Call [`Run::on_timeout`] for `node` after `after`.
    Timer { node: usize, after: Duration },
    /// Drop the outstanding requests of `node` (it finished without them).
    Forget { node: usize },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Pending,
    Running,
    Done,
}

enum Kind {
    Order { next: usize },
    Pipe { open: usize, failed: Vec<StepId> },
    Egress(Egress),
    Internal(Internal),
}

struct Egress {
    id: StepId,
    requests: Option<Requests>,
    inputs: Vec<StepId>,
    timeout: Option<Duration>,
    concurrent: bool,
    /// The requests, each taken when it is sent.
    resolved: Vec<Option<HttpRequest>>,
    parts: Vec<Option<StepResult>>,
    next: usize,
}

struct Internal {
    id: StepId,
    work: Option<Work>,
    inputs: Vec<StepId>,
    timeout: Option<Duration>,
    on_loop: bool,
}

struct RunStep {
    parent: Option<usize>,
    children: Vec<usize>,
    state: State,
    kind: Kind,
    result: Option<Arc<StepResult>>,
}

/// A request's graph in execution.
pub(crate) struct Run {
    nodes: Vec<RunStep>,
    results: HashMap<StepId, Arc<StepResult>>,
    respond: Option<StepId>,
    response: Option<HttpResponse>,
}

fn flatten(node: Step, parent: Option<usize>, out: &mut Vec<RunStep>) -> usize {
    let index = out.len();
    let (kind, children) = match node {
        Step::Order(c) => (Kind::Order { next: 0 }, c),
        Step::Pipe(c) => (
            Kind::Pipe {
                open: 0,
                failed: Vec::new(),
            },
            c,
        ),
        Step::Egress(e) => (
            Kind::Egress(Egress {
                id: e.id,
                requests: Some(e.requests),
                inputs: e.inputs,
                timeout: e.timeout,
                concurrent: e.concurrent,
                resolved: Vec::new(),
                parts: Vec::new(),
                next: 0,
            }),
            Vec::new(),
        ),
        Step::Internal(i) => (
            Kind::Internal(Internal {
                id: i.id,
                work: Some(i.work),
                inputs: i.inputs,
                timeout: i.timeout,
                on_loop: i.on_loop,
            }),
            Vec::new(),
        ),
    };
    out.push(RunStep {
        parent,
        children: Vec::new(),
        state: State::Pending,
        kind,
        result: None,
    });
    let ids: Vec<usize> = children
        .into_iter()
        .map(|c| flatten(c, Some(index), out))
        .collect();
    out[index].children = ids;
    index
}

impl Run {
    /// A run of `root`; `respond` names the step whose output answers.
    pub(crate) fn new(root: Step, respond: Option<StepId>) -> Result<Self, StepError> {
        validate(&root)?;
        let mut nodes = Vec::new();
        flatten(root, None, &mut nodes);
        Ok(Self {
            nodes,
            results: HashMap::new(),
            respond,
            response: None,
        })
    }

    /// A run that has failed before it started (an invalid graph).
    pub(crate) fn failed(error: StepError) -> Self {
        let mut run = Self {
            nodes: Vec::new(),
            results: HashMap::new(),
            respond: None,
            response: None,
        };
        run.response = Some(error_response("graph", &error));
        run
    }

    /// Takes the response, once the graph has finished.
    pub(crate) fn take_response(&mut self) -> Option<HttpResponse> {
        self.response.take()
    }

    /// Starts the graph.
    pub(crate) fn start(&mut self, actions: &mut Vec<Action>) {
        if self.response.is_none() && !self.nodes.is_empty() {
            self.start_node(0, actions);
        }
    }

    fn inputs(&self, ids: &[StepId]) -> Inputs {
        Inputs::new(
            ids.iter()
                .filter_map(|id| self.results.get(id).map(|r| (id.clone(), r.clone())))
                .collect(),
        )
    }

    fn start_node(&mut self, n: usize, actions: &mut Vec<Action>) {
        self.nodes[n].state = State::Running;
        let count = self.nodes[n].children.len();
        match &mut self.nodes[n].kind {
            Kind::Order { next } => {
                *next = 0;
                match self.nodes[n].children.first() {
                    Some(&c) => self.start_node(c, actions),
                    None => self.finish_step(n, None, actions),
                }
            }
            Kind::Pipe { open, .. } => {
                *open = count;
                if count == 0 {
                    self.finish_step(n, None, actions);
                }
                for i in 0..count {
                    let c = self.nodes[n].children[i];
                    self.start_node(c, actions);
                }
            }
            Kind::Egress(_) => self.start_egress(n, actions),
            Kind::Internal(i) => {
                let work = i.work.take().expect("an internal step starts once");
                let (timeout, on_loop) = (i.timeout, i.on_loop);
                let inputs = i.inputs.clone();
                let inputs = self.inputs(&inputs);
                match work {
                    Work::Blocking(func) => {
                        actions.push(Action::Internal {
                            node: n,
                            func,
                            inputs,
                            on_loop,
                        });
                        // A step on the loop finishes before any timer could fire.
                        if let Some(after) = timeout.filter(|_| !on_loop) {
                            actions.push(Action::Timer { node: n, after });
                        }
                    }
                    Work::Future(make) => {
                        // Made here (a panic fails the step, not the loop); the timer
                        // first, as the future may finish in its first poll.
                        if let Some(after) = timeout {
                            actions.push(Action::Timer { node: n, after });
                        }
                        let made = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            make(&inputs)
                        }));
                        match made {
                            Ok(future) => actions.push(Action::Spawn { node: n, future }),
                            Err(panic) => {
                                let e = StepError::Panicked(panic_text(&*panic));
                                self.on_internal(n, Err(e), actions);
                            }
                        }
                    }
                }
            }
        }
    }

    fn start_egress(&mut self, n: usize, actions: &mut Vec<Action>) {
        let Kind::Egress(e) = &mut self.nodes[n].kind else {
            unreachable!()
        };
        let requests = e.requests.take().expect("an egress step starts once");
        let input_ids = e.inputs.clone();
        let resolved = match requests {
            Requests::Fixed(r) => r,
            Requests::Builder(build) => {
                let inputs = self.inputs(&input_ids);
                // A builder that fails or panics fails its step, not the event loop.
                let built =
                    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| build(&inputs)))
                    {
                        Ok(Ok(r)) => Ok(r),
                        Ok(Err(why)) => Err(StepError::Failed(format!("request builder: {why}"))),
                        Err(panic) => Err(StepError::Panicked(format!(
                            "request builder: {}",
                            panic_text(&*panic)
                        ))),
                    };
                match built {
                    Ok(r) => r,
                    Err(error) => {
                        let Kind::Egress(e) = &self.nodes[n].kind else {
                            unreachable!()
                        };
                        let result = StepResult::failure(e.id.clone(), error);
                        self.finish_step(n, Some(result), actions);
                        return;
                    }
                }
            }
        };
        let Kind::Egress(e) = &mut self.nodes[n].kind else {
            unreachable!()
        };
        if resolved.is_empty() {
            let id = e.id.clone();
            self.finish_step(n, Some(StepResult::skipped(id)), actions);
            return;
        }
        e.parts = vec![None; resolved.len()];
        e.resolved = resolved.into_iter().map(Some).collect();
        let burst = if e.concurrent { e.resolved.len() } else { 1 };
        for part in 0..burst {
            let request = e.resolved[part].take().expect("each request is sent once");
            actions.push(Action::Send {
                node: n,
                part,
                request,
            });
        }
        e.next = burst;
        if let Some(after) = e.timeout {
            actions.push(Action::Timer { node: n, after });
        }
    }

    /// The id of the step at `node` (egress and internal steps), for its span.
    pub(crate) fn step_id(&self, node: usize) -> Option<&str> {
        match &self.nodes.get(node)?.kind {
            Kind::Egress(e) => Some(&e.id),
            Kind::Internal(i) => Some(&i.id),
            _ => None,
        }
    }

    /// A response (or a transport failure) for request `part` of egress node `node`.
    pub(crate) fn on_egress(
        &mut self,
        node: usize,
        part: usize,
        outcome: Result<HttpResponse, String>,
        actions: &mut Vec<Action>,
    ) {
        let Some(RunStep {
            state: State::Running,
            kind: Kind::Egress(e),
            ..
        }) = self.nodes.get_mut(node)
        else {
            return;
        };
        if e.parts.get(part).is_none_or(Option::is_some) {
            return;
        }
        let result = match outcome {
            Ok(response) => StepResult::from_response(e.id.clone(), response),
            Err(why) => StepResult::failure(e.id.clone(), StepError::Transport(why)),
        };
        let failed = !result.ok;
        e.parts[part] = Some(result);
        if failed && !e.concurrent {
            // One after another: a failed request stops the rest.
            let result = self.egress_result(node);
            actions.push(Action::Forget { node });
            self.finish_step(node, Some(result), actions);
            return;
        }
        let Kind::Egress(e) = &mut self.nodes[node].kind else {
            unreachable!()
        };
        if !e.concurrent && e.next < e.resolved.len() {
            let part = e.next;
            e.next += 1;
            let request = e.resolved[part].take().expect("each request is sent once");
            actions.push(Action::Send {
                node,
                part,
                request,
            });
            return;
        }
        if e.parts.iter().all(Option::is_some) {
            let result = self.egress_result(node);
            self.finish_step(node, Some(result), actions);
        }
    }

    /// The step's result from its parts: one part is the result itself; several are a
    /// fan-out.
    fn egress_result(&mut self, node: usize) -> StepResult {
        let Kind::Egress(e) = &mut self.nodes[node].kind else {
            unreachable!()
        };
        let parts: Vec<StepResult> = e.parts.iter_mut().filter_map(Option::take).collect();
        if e.resolved.len() == 1 && parts.len() == 1 {
            return parts.into_iter().next().expect("one part");
        }
        let failing = parts.iter().find(|p| !p.ok).cloned();
        let mut result = match failing {
            Some(f) => StepResult {
                id: e.id.clone(),
                parts: Vec::new(),
                ..f
            },
            None => StepResult::success(e.id.clone(), 200, HeaderMap::new(), Bytes::new()),
        };
        result.parts = parts;
        result
    }

    /// An internal step's outcome.
    pub(crate) fn on_internal(
        &mut self,
        node: usize,
        outcome: Result<StepOutput, StepError>,
        actions: &mut Vec<Action>,
    ) {
        let Some(RunStep {
            state: State::Running,
            kind: Kind::Internal(i),
            ..
        }) = self.nodes.get(node)
        else {
            return;
        };
        let id = i.id.clone();
        let result = match outcome {
            Ok(out) => StepResult {
                trailers: out.trailers,
                stream: out.stream,
                ..StepResult::success(id, out.status.unwrap_or(200), out.headers, out.body)
            },
            Err(e) => StepResult::failure(id, e),
        };
        self.finish_step(node, Some(result), actions);
    }

    /// A step's timer fired: if it is still running, it fails.
    pub(crate) fn on_timeout(&mut self, node: usize, actions: &mut Vec<Action>) {
        let Some(n) = self.nodes.get(node) else {
            return;
        };
        if n.state != State::Running {
            return;
        }
        let (id, timeout) = match &n.kind {
            Kind::Egress(e) => (e.id.clone(), e.timeout),
            Kind::Internal(i) => (i.id.clone(), i.timeout),
            _ => return,
        };
        let timeout = timeout.unwrap_or_default();
        if matches!(n.kind, Kind::Egress(_)) {
            actions.push(Action::Forget { node });
        }
        self.finish_step(
            node,
            Some(StepResult::failure(id, StepError::Timeout(timeout))),
            actions,
        );
    }

    /// Marks `n` done with `result` (steps) and moves its parent on.
    fn finish_step(&mut self, n: usize, result: Option<StepResult>, actions: &mut Vec<Action>) {
        let node = &mut self.nodes[n];
        node.state = State::Done;
        let result = match result {
            Some(r) => {
                let r = Arc::new(r);
                self.results.insert(r.id.clone(), r.clone());
                r
            }
            None => self.composite(n),
        };
        self.nodes[n].result = Some(result.clone());
        let Some(parent) = self.nodes[n].parent else {
            self.finish(result);
            return;
        };
        match &mut self.nodes[parent].kind {
            Kind::Order { next } => {
                if !result.ok {
                    // A sequence stops at its first failure; the rest never start, and
                    // the sequence's result is that failure (see `composite`).
                    self.finish_step(parent, None, actions);
                    return;
                }
                *next += 1;
                let next = *next;
                match self.nodes[parent].children.get(next) {
                    Some(&c) => self.start_node(c, actions),
                    None => self.finish_step(parent, None, actions),
                }
            }
            Kind::Pipe { open, failed } => {
                if !result.ok {
                    // A nested block that failed names its own failed members.
                    match &result.error {
                        Some(StepError::Parallel(ids)) if result.id.is_empty() => {
                            failed.extend(ids.iter().cloned())
                        }
                        _ => failed.push(result.id.clone()),
                    }
                }
                *open -= 1;
                if *open == 0 {
                    self.finish_step(parent, None, actions);
                }
            }
            _ => unreachable!("steps have no children"),
        }
    }

    /// The result of a finished sequence or parallel block: a sequence's is its last
    /// finished member's; a parallel block's is its last member's, or a failure naming
    /// the members that failed.
    fn composite(&self, n: usize) -> Arc<StepResult> {
        let node = &self.nodes[n];
        let last = node
            .children
            .iter()
            .rev()
            .find_map(|&c| self.nodes[c].result.clone());
        match &node.kind {
            Kind::Pipe { failed, .. } if !failed.is_empty() => {
                // The first failure's status and body explain the block's failure.
                let first = node
                    .children
                    .iter()
                    .filter_map(|&c| self.nodes[c].result.clone())
                    .find(|r| !r.ok);
                let mut r = StepResult::failure(String::new(), StepError::Parallel(failed.clone()));
                if let Some(first) = first {
                    r.body = first.body.clone();
                }
                Arc::new(r)
            }
            _ => last.unwrap_or_else(|| {
                Arc::new(StepResult::success(
                    String::new(),
                    200,
                    HeaderMap::new(),
                    Bytes::new(),
                ))
            }),
        }
    }

    fn finish(&mut self, root: Arc<StepResult>) {
        let answer = match &self.respond {
            Some(id) if root.ok => self.results.get(id).cloned().unwrap_or(root),
            _ => root,
        };
        self.response = Some(if answer.ok {
            answer.to_response()
        } else {
            let error = answer
                .error
                .clone()
                .unwrap_or(StepError::Failed("unknown".into()));
            let response = error_response(&answer.id, &error);
            if self.dependency_failed(&error) {
                // Not this service's fault: say so, so the proxy's breaker in front of
                // it does not eject it for a service it called.
                response.header(dpumesh_head::DEPENDENCY_FAILED_HEADER, "1")
            } else {
                response
            }
        });
    }

    /// Whether `error` came from calls to other services only (an egress call answered
    /// 5xx or could not be carried), not from this service's own code or timeouts.
    fn dependency_failed(&self, error: &StepError) -> bool {
        match error {
            StepError::Status(status) => *status >= 500,
            StepError::Transport(_) => true,
            StepError::Parallel(ids) => ids.iter().all(|id| {
                self.results
                    .get(id)
                    .and_then(|r| r.error.as_ref())
                    .is_some_and(|e| self.dependency_failed(e))
            }),
            StepError::Timeout(_)
            | StepError::Panicked(_)
            | StepError::Failed(_)
            | StepError::Graph(_) => false,
        }
    }
}

fn error_response(step: &str, error: &StepError) -> HttpResponse {
    let what = if step.is_empty() {
        String::new()
    } else {
        format!("step {step:?}: ")
    };
    HttpResponse::new(error.status(), format!("{what}{error}\n"))
        .header("content-type", "text/plain")
}

/// A panic payload as text.
pub(crate) fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a non-text panic".to_owned())
}

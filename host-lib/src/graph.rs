//! The low-level graph: [`order`] (children one after another; stops at the first
//! failure), [`pipe`] (children at once; the others finish, then the pipe reports
//! failure), [`EgressStep`] (HTTP calls through the data path) and [`InternalStep`]
//! (CPU work on the thread pool). Nodes nest freely; the high-level
//! [`ExecutionContext`](crate::ExecutionContext) builds these.

use std::time::Duration;

use foldhash::{HashSet, HashSetExt};

use crate::http::HttpRequest;
use crate::result::{Inputs, StepError, StepId, StepOutput};

/// A request builder: a function of the step's inputs returning the requests to send
/// (none: the step is skipped; several: fan-out).
/// A builder that cannot make its requests says why (the step fails with it).
pub type RequestBuilder = Box<dyn FnOnce(&Inputs) -> Result<Vec<HttpRequest>, String> + Send>;

/// An internal step's work that runs to its end.
pub type InternalFn = Box<dyn FnOnce(&Inputs) -> Result<StepOutput, String> + Send>;

/// The future an asynchronous step runs.
pub type StepFuture =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<StepOutput, String>> + Send>>;

/// An asynchronous step's work: makes its future from the step's inputs.
pub type FutureFn = Box<dyn FnOnce(&Inputs) -> StepFuture + Send>;

/// What an internal step does.
pub enum Work {
    /// A function that runs to its end: on the pool, or on the loop's thread with
    /// [`InternalStep::on_loop`].
    Blocking(InternalFn),
    /// A future, polled on the loop's thread whenever it is woken: it waits (for a
    /// socket, a timer) without holding a thread. [`crate::tower`] serves with it.
    Future(FutureFn),
}

/// A step of the graph: a sequence or a parallel group of steps, or one egress or
/// internal step. ("Node" in this project names a machine.)
pub enum Step {
    /// Children one after another.
    Order(Vec<Step>),
    /// Children at the same time.
    Pipe(Vec<Step>),
    /// HTTP calls.
    Egress(EgressStep),
    /// CPU work.
    Internal(InternalStep),
}

/// The old name of [`Step`].
#[deprecated(note = "renamed `Step` (a node is a machine of the mesh)")]
pub type Node = Step;

impl std::fmt::Debug for Step {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Order(c) => f.debug_tuple("Order").field(c).finish(),
            Self::Pipe(c) => f.debug_tuple("Pipe").field(c).finish(),
            Self::Egress(e) => write!(f, "Egress({:?})", e.id),
            Self::Internal(i) => write!(f, "Internal({:?})", i.id),
        }
    }
}

/// Children one after another: a failure stops the sequence (later children never
/// start) and fails it.
pub fn order(children: impl IntoIterator<Item = Step>) -> Step {
    Step::Order(children.into_iter().collect())
}

/// Children at the same time: every child runs to its end; if any failed, the pipe
/// fails naming them.
pub fn pipe(children: impl IntoIterator<Item = Step>) -> Step {
    Step::Pipe(children.into_iter().collect())
}

/// The requests of an egress step.
pub enum Requests {
    /// Known when the graph is built.
    Fixed(Vec<HttpRequest>),
    /// Built from the step's inputs when it starts (the URL given at `call` is ignored).
    Builder(RequestBuilder),
}

/// HTTP calls through the data path.
pub struct EgressStep {
    /// The step's id.
    pub id: StepId,
    /// What to send.
    pub requests: Requests,
    /// Steps whose results the builder receives.
    pub inputs: Vec<StepId>,
    /// The whole step (every request) must finish within this.
    pub timeout: Option<Duration>,
    /// Several requests go out at once (inside a parallel block) rather than one
    /// after another.
    pub concurrent: bool,
}

impl EgressStep {
    /// A step sending `requests` (one after another).
    pub fn new(id: impl Into<StepId>, requests: Vec<HttpRequest>) -> Self {
        Self {
            id: id.into(),
            requests: Requests::Fixed(requests),
            inputs: Vec::new(),
            timeout: None,
            concurrent: false,
        }
    }

    /// A step whose requests `builder` makes from its inputs.
    pub fn built(
        id: impl Into<StepId>,
        inputs: Vec<StepId>,
        builder: impl FnOnce(&Inputs) -> Vec<HttpRequest> + Send + 'static,
    ) -> Self {
        Self::try_built(id, inputs, move |inputs| Ok(builder(inputs)))
    }

    /// A step whose requests `builder` makes from its inputs, or fails to (the step
    /// then fails with the reason, as an internal step returning an error does).
    pub fn try_built(
        id: impl Into<StepId>,
        inputs: Vec<StepId>,
        builder: impl FnOnce(&Inputs) -> Result<Vec<HttpRequest>, String> + Send + 'static,
    ) -> Self {
        Self {
            id: id.into(),
            requests: Requests::Builder(Box::new(builder)),
            inputs,
            timeout: None,
            concurrent: false,
        }
    }

    /// With a timeout.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Send its requests at once.
    pub fn concurrent(mut self) -> Self {
        self.concurrent = true;
        self
    }
}

impl From<EgressStep> for Step {
    fn from(s: EgressStep) -> Self {
        Step::Egress(s)
    }
}

/// CPU work on the thread pool.
pub struct InternalStep {
    /// The step's id.
    pub id: StepId,
    /// The work.
    pub work: Work,
    /// Steps whose results it receives.
    pub inputs: Vec<StepId>,
    /// It must finish within this (the thread is not stopped; its late result is
    /// dropped).
    pub timeout: Option<Duration>,
    /// It runs on the event loop's own thread, as soon as its inputs are there, instead
    /// of being handed to the pool: for quick work such as assembling the answer
    /// (`respond` steps), where a hand-off to another thread would cost more than the
    /// work. It must not block.
    pub on_loop: bool,
}

impl InternalStep {
    /// A step running `func` with the results of `inputs`.
    pub fn new<F, O, E>(id: impl Into<StepId>, inputs: Vec<StepId>, func: F) -> Self
    where
        F: FnOnce(&Inputs) -> Result<O, E> + Send + 'static,
        O: Into<StepOutput>,
        E: std::fmt::Display,
    {
        Self {
            id: id.into(),
            work: Work::Blocking(Box::new(move |inputs| {
                func(inputs).map(Into::into).map_err(|e| e.to_string())
            })),
            inputs,
            timeout: None,
            on_loop: false,
        }
    }

    /// A step running the future `make` returns from the results of `inputs`, on the
    /// event loop's thread: polled when started and whenever its waker is called, it
    /// holds no thread while it waits. Its timeout (if any) drops it.
    pub fn future<F, Fut, O, E>(id: impl Into<StepId>, inputs: Vec<StepId>, make: F) -> Self
    where
        F: FnOnce(&Inputs) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = Result<O, E>> + Send + 'static,
        O: Into<StepOutput>,
        E: std::fmt::Display,
    {
        Self {
            id: id.into(),
            work: Work::Future(Box::new(move |inputs| {
                let future = make(inputs);
                Box::pin(async move { future.await.map(Into::into).map_err(|e| e.to_string()) })
            })),
            inputs,
            timeout: None,
            on_loop: true,
        }
    }

    /// With a timeout.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Runs on the event loop's thread (see [`InternalStep::on_loop`]).
    pub fn on_loop(mut self) -> Self {
        self.on_loop = true;
        self
    }
}

impl From<InternalStep> for Step {
    fn from(s: InternalStep) -> Self {
        Step::Internal(s)
    }
}

/// Checks ids and inputs: ids are unique; an input names a step that has finished
/// before the step starts (an earlier member of an enclosing sequence), never one that
/// runs at the same time or later.
pub fn validate(root: &Step) -> Result<(), StepError> {
    let mut all = Vec::new();
    ids(root, &mut all);
    let mut seen = HashSet::with_capacity(all.len());
    for id in &all {
        if !seen.insert(*id) {
            return Err(StepError::Graph(format!("step id {id:?} is used twice")));
        }
    }
    let mut done = HashSet::with_capacity(all.len());
    check(root, &seen, &mut done)
}

fn ids<'a>(node: &'a Step, out: &mut Vec<&'a str>) {
    match node {
        Step::Order(c) | Step::Pipe(c) => c.iter().for_each(|n| ids(n, out)),
        Step::Egress(e) => out.push(&e.id),
        Step::Internal(i) => out.push(&i.id),
    }
}

/// `done` holds the steps finished before `node` starts; on return it also holds
/// `node`'s own steps. `all` is every step id of the graph.
fn check<'a>(
    node: &'a Step,
    all: &HashSet<&'a str>,
    done: &mut HashSet<&'a str>,
) -> Result<(), StepError> {
    let step = |id: &str, inputs: &[StepId], done: &HashSet<&'a str>| {
        for input in inputs {
            if !done.contains(input.as_str()) {
                let why = if all.contains(input.as_str()) {
                    "runs at the same time (same parallel block) or later"
                } else {
                    "is not a step of this request"
                };
                return Err(StepError::Graph(format!(
                    "step {id:?} takes input {input:?}, which {why}"
                )));
            }
        }
        Ok(())
    };
    match node {
        Step::Order(children) => {
            for c in children {
                check(c, all, done)?;
            }
        }
        Step::Pipe(children) => {
            // Members see only what finished before the block; the block's steps are
            // done after it.
            let mut after = Vec::new();
            for c in children {
                let mut local = done.clone();
                check(c, all, &mut local)?;
                ids(c, &mut after);
            }
            done.extend(after);
        }
        Step::Egress(e) => {
            step(&e.id, &e.inputs, done)?;
            done.insert(&e.id);
        }
        Step::Internal(i) => {
            step(&i.id, &i.inputs, done)?;
            done.insert(&i.id);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(id: &str) -> Step {
        EgressStep::new(id, vec![HttpRequest::get("http://x/")]).into()
    }

    fn internal(id: &str, inputs: &[&str]) -> Step {
        InternalStep::new(id, inputs.iter().map(|s| s.to_string()).collect(), |_| {
            Ok::<_, String>(())
        })
        .into()
    }

    #[test]
    fn inputs_must_come_from_steps_that_finished_before() {
        assert!(validate(&order([call("a"), internal("b", &["a"])])).is_ok());
        assert!(
            validate(&order([
                pipe([call("a"), call("b")]),
                internal("m", &["a", "b"])
            ]))
            .is_ok()
        );
        // Nested: a pipe member may use what finished before the pipe.
        assert!(
            validate(&order([
                call("a"),
                pipe([
                    internal("b", &["a"]),
                    order([call("c"), internal("d", &["c", "a"])])
                ])
            ]))
            .is_ok()
        );

        let err = validate(&pipe([call("a"), internal("b", &["a"])]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("\"a\", which runs at the same time"), "{err}");
        let err = validate(&order([internal("b", &["a"]), call("a")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("or later"), "{err}");
        let err = validate(&order([internal("b", &["zz"])]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("\"zz\", which is not a step of this request"),
            "{err}"
        );
        let err = validate(&order([call("a"), call("a")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("\"a\" is used twice"), "{err}");
    }
}

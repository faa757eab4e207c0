//! The thread pool internal steps run on: a panic becomes the step's error, and every
//! finished job wakes the event loop.

use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};

use crate::graph::InternalFn;
use crate::result::{Inputs, StepError, StepOutput};
use crate::run::panic_text;
use crate::transport::Waker;

/// A job's identity: the context slot, its generation, and the node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct JobKey {
    pub slot: u32,
    pub generation: u32,
    pub node: usize,
}

struct Job {
    key: JobKey,
    func: InternalFn,
    inputs: Inputs,
}

/// A finished job.
pub(crate) struct Done {
    pub key: JobKey,
    pub outcome: Result<StepOutput, StepError>,
}

/// Runs an internal step: its error or its panic becomes the step's error.
pub(crate) fn run_step(func: InternalFn, inputs: &Inputs) -> Result<StepOutput, StepError> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| func(inputs))) {
        Ok(Ok(out)) => Ok(out),
        Ok(Err(message)) => Err(StepError::Failed(message)),
        Err(panic) => Err(StepError::Panicked(panic_text(&*panic))),
    }
}

/// Runs a pool thread's whole body (`run`): a binding wraps it in what each thread
/// needs for its whole life (the Python package keeps one interpreter thread state per
/// worker this way instead of making and freeing one per step).
pub type WorkerScope = std::sync::Arc<dyn Fn(&mut (dyn FnMut() + Send)) + Send + Sync>;

/// Worker threads for internal steps.
pub(crate) struct Pool {
    jobs: Option<Sender<Job>>,
    threads: Vec<JoinHandle<()>>,
    /// Each worker says here that it ended (after its scope returned).
    exited: Receiver<()>,
}

impl Pool {
    /// `threads` workers; results go to `done`, then `wake` is called.
    pub(crate) fn new(
        threads: usize,
        done: Sender<Done>,
        wake: Waker,
        scope: Option<WorkerScope>,
    ) -> std::io::Result<Self> {
        let (jobs, rx): (Sender<Job>, Receiver<Job>) = crossbeam_channel::unbounded();
        let (exit_tx, exited) = crossbeam_channel::unbounded();
        let threads = (0..threads.max(1))
            .map(|i| {
                let rx = rx.clone();
                let exit_tx = exit_tx.clone();
                let done = done.clone();
                let wake = wake.clone();
                let scope = scope.clone();
                std::thread::Builder::new()
                    .name(format!("dpumesh-host-worker-{i}"))
                    .spawn(move || {
                        let mut work = || {
                            for job in rx.iter() {
                                let Job { key, func, inputs } = job;
                                let outcome = run_step(func, &inputs);
                                if done.send(Done { key, outcome }).is_err() {
                                    return;
                                }
                                wake();
                            }
                        };
                        match &scope {
                            Some(scope) => scope(&mut work),
                            None => work(),
                        }
                        let _ = exit_tx.send(());
                    })
            })
            .collect::<std::io::Result<Vec<_>>>()?;
        Ok(Self {
            jobs: Some(jobs),
            threads,
            exited,
        })
    }

    /// Closes the queue and waits (at most `patience`) until every worker ended, after
    /// the steps they run. Whether they all did.
    pub(crate) fn shutdown(&mut self, patience: std::time::Duration) -> bool {
        self.jobs.take();
        let deadline = std::time::Instant::now() + patience;
        let mut left = self.threads.len();
        while left > 0 {
            match self.exited.recv_deadline(deadline) {
                Ok(()) => left -= 1,
                Err(_) => return false,
            }
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        true
    }

    pub(crate) fn submit(&self, key: JobKey, func: InternalFn, inputs: Inputs) {
        if let Some(jobs) = &self.jobs {
            let _ = jobs.send(Job { key, func, inputs });
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // Closing the queue ends each worker once it finishes what it runs. They are
        // not joined: a step stuck forever must not hang the loop's shutdown.
        self.jobs.take();
        self.threads.clear();
    }
}

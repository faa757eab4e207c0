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

/// Worker threads for internal steps.
pub(crate) struct Pool {
    jobs: Option<Sender<Job>>,
    threads: Vec<JoinHandle<()>>,
}

impl Pool {
    /// `threads` workers; results go to `done`, then `wake` is called.
    pub(crate) fn new(threads: usize, done: Sender<Done>, wake: Waker) -> std::io::Result<Self> {
        let (jobs, rx): (Sender<Job>, Receiver<Job>) = crossbeam_channel::unbounded();
        let threads = (0..threads.max(1))
            .map(|i| {
                let rx = rx.clone();
                let done = done.clone();
                let wake = wake.clone();
                std::thread::Builder::new()
                    .name(format!("dpumesh-host-worker-{i}"))
                    .spawn(move || {
                        for job in rx {
                            let Job { key, func, inputs } = job;
                            let outcome = run_step(func, &inputs);
                            if done.send(Done { key, outcome }).is_err() {
                                return;
                            }
                            wake();
                        }
                    })
            })
            .collect::<std::io::Result<Vec<_>>>()?;
        Ok(Self {
            jobs: Some(jobs),
            threads,
        })
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

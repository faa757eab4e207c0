//! One worker thread: its chain runners per generation, and the job loop the
//! supervisor runs (and runs again after a panic, on fresh instances).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crossbeam_channel::{Receiver, Sender};

use super::{Generation, Job};
use crate::local::LocalChains;

pub(super) struct Worker {
    id: usize,
    chains: LocalChains,
    on: Arc<[AtomicU64]>,
    jobs: Receiver<Job>,
    /// Told once, when the worker first takes jobs.
    ready: Option<Sender<()>>,
}

impl Worker {
    pub(super) fn new(
        id: usize,
        generation: Arc<Generation>,
        on: Arc<[AtomicU64]>,
        jobs: Receiver<Job>,
        ready: Sender<()>,
    ) -> Self {
        Self {
            id,
            chains: LocalChains::new(id, generation),
            on,
            jobs,
            ready: Some(ready),
        }
    }

    /// How plugins' shared-queue notifications reach this worker.
    pub(super) fn set_waker(&self, waker: crate::queues::Waker) {
        self.chains.set_waker(waker);
    }

    /// Takes jobs until the pool closes the channel.
    pub(super) fn run(&mut self) {
        if let Some(ready) = self.ready.take() {
            let _ = ready.send(());
        }
        // proxy-wasm ticks: due ones run between jobs, and an idle worker waits no
        // longer than the next one (no timer thread, no wake-up when nothing ticks).
        let mut next_tick = self.chains.tick(std::time::Instant::now());
        loop {
            let job = match next_tick {
                None => self.jobs.recv().map_err(|_| ()),
                Some(due) => match self.jobs.recv_deadline(due) {
                    Ok(job) => Ok(job),
                    Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                        next_tick = self.chains.tick(std::time::Instant::now());
                        continue;
                    }
                    Err(crossbeam_channel::RecvTimeoutError::Disconnected) => Err(()),
                },
            };
            let Ok(job) = job else { break };
            if matches!(job, Job::Wake) {
                next_tick = self.chains.tick(std::time::Instant::now());
                continue;
            }
            self.job(job);
            let now = std::time::Instant::now();
            if next_tick.is_none_or(|due| now >= due) {
                next_tick = self.chains.tick(now);
            }
        }
    }

    /// After a panic: the instances may be mid-call and the bookkeeping half done, so
    /// all of it goes; the current generation's instances are built again. (The
    /// panicking job's reply was answered as it unwound.)
    pub(super) fn recover(&mut self) {
        self.chains.rebuild();
    }

    fn job(&mut self, job: Job) {
        match job {
            Job::Request {
                generation,
                chain,
                head,
                reply,
            } => {
                let done = self.chains.on_request(&generation, chain, head);
                self.published();
                reply.send(Ok(done));
            }
            Job::Response {
                ticket,
                head,
                info,
                reply,
            } => {
                let result = self.chains.on_response(&ticket, head, &info);
                reply.send(Ok(result));
            }
            Job::Resume {
                ticket,
                park,
                token,
                answer,
                reply,
            } => {
                let done = self.chains.resume(&ticket, park, token, &answer);
                reply.send(Ok(done));
            }
            Job::Abandon {
                ticket,
                park,
                info,
                reply,
            } => {
                let done = self.chains.abandon(&ticket, park, &info);
                reply.send(Ok(done));
            }
            Job::Wake => {
                self.chains.tick(std::time::Instant::now());
            }
            Job::Switch(generation) => {
                self.chains.switch(&generation);
                self.published();
            }
            #[cfg(feature = "fault-injection")]
            Job::Panic(reply) => {
                let _held = reply;
                panic!("injected worker panic");
            }
        }
    }

    /// Tells the pool which generation this worker runs new requests on.
    fn published(&self) {
        self.on[self.id].store(self.chains.generation(), Ordering::Release);
    }
}

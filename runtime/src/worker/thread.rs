//! One worker thread: its chain runners per generation, and the job loop the
//! supervisor runs (and runs again after a panic, on fresh instances).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};

use super::{Generation, Job, RequestDone, Ticket};
use crate::chain::ChainRunner;

/// Retired generations a worker keeps for responses still to come.
const MAX_RETIRED: usize = 3;
/// A retired generation with requests still open is dropped after this long anyway
/// (their callers never came back for the response phase).
const RETIRED_TTL: Duration = Duration::from_secs(30);

/// One generation's runners on one worker.
struct Runners {
    generation: Arc<Generation>,
    runners: Vec<ChainRunner>,
    /// Requests whose response phase has not run yet.
    open: usize,
    /// When a retired set was last used (retirement counts as a use).
    last_used: Instant,
}

impl Runners {
    fn new(generation: Arc<Generation>) -> Self {
        let runners = generation
            .chains
            .iter()
            .cloned()
            .map(ChainRunner::new)
            .collect();
        Self {
            generation,
            runners,
            open: 0,
            last_used: Instant::now(),
        }
    }
}

pub(super) struct Worker {
    id: usize,
    current: Runners,
    /// Older generations with responses still to come, newest first.
    retired: Vec<Runners>,
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
            current: Runners::new(generation),
            retired: Vec::new(),
            on,
            jobs,
            ready: Some(ready),
        }
    }

    /// Takes jobs until the pool closes the channel.
    pub(super) fn run(&mut self) {
        if let Some(ready) = self.ready.take() {
            let _ = ready.send(());
        }
        while let Ok(job) = self.jobs.recv() {
            self.job(job);
        }
    }

    /// After a panic: the instances may be mid-call and the bookkeeping half done, so
    /// all of it goes; the current generation's instances are built again. (The
    /// panicking job's reply was answered as it unwound.)
    pub(super) fn recover(&mut self) {
        let generation = self.current.generation.clone();
        self.retired.clear();
        self.current = Runners::new(generation);
    }

    fn job(&mut self, job: Job) {
        match job {
            Job::Request {
                generation,
                chain,
                head,
                reply,
            } => {
                let worker = self.id;
                let runners = self.runners(&generation);
                runners.open += 1;
                let runner = &mut runners.runners[chain];
                let outcome = runner.on_request(head);
                let ticket = Ticket {
                    worker,
                    generation,
                    chain,
                    ran: outcome.ran,
                };
                reply.send(Ok(RequestDone { ticket, outcome }));
                runner.repair();
            }
            Job::Response {
                ticket,
                head,
                info,
                reply,
            } => {
                let runners = self.runners(&ticket.generation);
                runners.open = runners.open.saturating_sub(1);
                let runner = &mut runners.runners[ticket.chain];
                let result = runner.on_response(head, &info, ticket.ran);
                reply.send(Ok(result));
                runner.repair();
                self.sweep();
            }
            Job::Switch(generation) => {
                self.runners(&generation);
            }
            #[cfg(feature = "fault-injection")]
            Job::Panic(reply) => {
                let _held = reply;
                panic!("injected worker panic");
            }
        }
    }
    /// The runners of `generation`: the current ones, a retired set, or new ones (after
    /// switching to it when it is newer than the current generation).
    fn runners(&mut self, generation: &Arc<Generation>) -> &mut Runners {
        let number = generation.number;
        if number > self.current.generation.number {
            let mut old = std::mem::replace(&mut self.current, Runners::new(generation.clone()));
            // The retirement TTL counts from here; the current set is not timed per job.
            old.last_used = Instant::now();
            self.on[self.id].store(number, Ordering::Release);
            self.retired.insert(0, old);
            self.sweep();
        }
        if number == self.current.generation.number {
            return &mut self.current;
        }
        let index = match self
            .retired
            .iter()
            .position(|r| r.generation.number == number)
        {
            Some(index) => index,
            None => {
                // A request submitted before a publish reached a worker that had
                // already dropped (or never had) its generation: build it again.
                self.retired.push(Runners::new(generation.clone()));
                self.retired.len() - 1
            }
        };
        let runners = &mut self.retired[index];
        runners.last_used = Instant::now();
        runners
    }

    /// Drops retired generations with no open requests, and the oldest beyond the
    /// limit or idle too long.
    fn sweep(&mut self) {
        self.retired
            .retain(|r| r.open > 0 && r.last_used.elapsed() < RETIRED_TTL);
        self.retired.truncate(MAX_RETIRED);
    }
}

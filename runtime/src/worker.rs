//! Worker threads: each owns a [`ChainRunner`] per chain (so its own stores and
//! instances) and processes requests start to finish. Requests reach a worker over its
//! own channel; nothing on the request path takes a lock shared with other workers.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};
use dpumesh_head::RequestHead;

use crate::bindings::ResponseInfo;
use crate::chain::{ChainOutcome, ChainRunner, FilterChain};
use crate::error::FilterFault;

/// Why the pool could not take a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    /// No chain with that index.
    #[error("no filter chain with index {0}")]
    UnknownChain(usize),
    /// The pool has shut down.
    #[error("the worker pool has stopped")]
    Stopped,
}

/// The request phase's result, with the worker that ran it (the response phase must
/// run on the same worker).
#[derive(Debug)]
pub struct RequestDone {
    /// The worker that ran the chain.
    pub worker: usize,
    /// What the chain decided.
    pub outcome: ChainOutcome,
}

enum Job {
    Request {
        chain: usize,
        head: RequestHead,
        reply: Sender<RequestDone>,
    },
    Response {
        chain: usize,
        head: RequestHead,
        info: ResponseInfo,
        ran: usize,
        reply: Sender<(RequestHead, Vec<FilterFault>)>,
    },
}

/// A fixed set of worker threads running filter chains.
pub struct WorkerPool {
    senders: Vec<Sender<Job>>,
    chains: usize,
    next: AtomicUsize,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for WorkerPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerPool")
            .field("workers", &self.senders.len())
            .field("chains", &self.chains)
            .finish()
    }
}

impl WorkerPool {
    /// Starts `workers` threads, each creating its instances of every chain before
    /// taking requests.
    pub fn start(chains: Vec<Arc<FilterChain>>, workers: usize) -> std::io::Result<Self> {
        let workers = workers.max(1);
        let mut senders = Vec::with_capacity(workers);
        let mut threads = Vec::with_capacity(workers);
        let (ready_tx, ready_rx) = crossbeam_channel::bounded::<()>(workers);
        for id in 0..workers {
            let (tx, rx) = crossbeam_channel::unbounded();
            let chains = chains.clone();
            let ready = ready_tx.clone();
            let thread = std::thread::Builder::new()
                .name(format!("dpumesh-worker-{id}"))
                .spawn(move || run_worker(id, chains, rx, ready))?;
            senders.push(tx);
            threads.push(thread);
        }
        // Pre-create every instance before the first request, so none waits for one.
        for _ in 0..workers {
            let _ = ready_rx.recv();
        }
        Ok(Self {
            senders,
            chains: chains.len(),
            next: AtomicUsize::new(0),
            threads,
        })
    }

    /// Number of workers.
    pub fn workers(&self) -> usize {
        self.senders.len()
    }

    /// Runs chain `chain`'s request phase on the next worker (round robin) and waits.
    pub fn on_request(&self, chain: usize, head: RequestHead) -> Result<RequestDone, PoolError> {
        if chain >= self.chains {
            return Err(PoolError::UnknownChain(chain));
        }
        let worker = self.next.fetch_add(1, Ordering::Relaxed) % self.senders.len();
        let (reply, done) = crossbeam_channel::bounded(1);
        self.senders[worker]
            .send(Job::Request { chain, head, reply })
            .map_err(|_| PoolError::Stopped)?;
        done.recv().map_err(|_| PoolError::Stopped)
    }

    /// Runs the response phase on the worker that ran the request phase, and waits.
    pub fn on_response(
        &self,
        worker: usize,
        chain: usize,
        head: RequestHead,
        info: ResponseInfo,
        ran: usize,
    ) -> Result<(RequestHead, Vec<FilterFault>), PoolError> {
        if chain >= self.chains {
            return Err(PoolError::UnknownChain(chain));
        }
        let sender = self.senders.get(worker).ok_or(PoolError::Stopped)?;
        let (reply, done) = crossbeam_channel::bounded(1);
        sender
            .send(Job::Response {
                chain,
                head,
                info,
                ran,
                reply,
            })
            .map_err(|_| PoolError::Stopped)?;
        done.recv().map_err(|_| PoolError::Stopped)
    }
}

impl Drop for WorkerPool {
    fn drop(&mut self) {
        // Closing the channels ends each worker's loop after its current job.
        self.senders.clear();
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

fn run_worker(id: usize, chains: Vec<Arc<FilterChain>>, jobs: Receiver<Job>, ready: Sender<()>) {
    let mut runners: Vec<ChainRunner> = chains.into_iter().map(ChainRunner::new).collect();
    let _ = ready.send(());
    drop(ready);
    while let Ok(job) = jobs.recv() {
        match job {
            Job::Request { chain, head, reply } => {
                let outcome = runners[chain].on_request(head);
                let _ = reply.send(RequestDone {
                    worker: id,
                    outcome,
                });
                runners[chain].repair();
            }
            Job::Response {
                chain,
                head,
                info,
                ran,
                reply,
            } => {
                let result = runners[chain].on_response(head, &info, ran);
                let _ = reply.send(result);
                runners[chain].repair();
            }
        }
    }
}

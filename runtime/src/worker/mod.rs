//! Worker threads: each owns a [`ChainRunner`] per chain (so its own stores and
//! instances) and processes requests start to finish. Requests reach a worker over its
//! own channel; nothing on the request path takes a lock shared with other workers.
//!
//! Chains are published as numbered [`Generation`]s. Every job carries the generation
//! it started in, so a request's response phase runs on the same filter versions (and
//! instances) as its request phase even if a reload happened in between; a newer
//! generation makes the worker switch between two jobs. Publishing also tells idle
//! workers to switch at once, so they build their new instances before the next
//! request rather than during it.
//!
//! Workers are supervised ([`dpumesh_supervise`]): a panic on a worker (a host bug; a
//! filter's own faults are traps, handled by its failure policy) drops the worker's
//! instances and builds them again, and the job it was running is answered with
//! [`PoolError::WorkerLost`] — a request is never left waiting for an answer that
//! cannot come.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::thread::JoinHandle;

use arc_swap::ArcSwap;
use crossbeam_channel::Sender;
use dpumesh_head::RequestHead;
use dpumesh_supervise::{RestartPolicy, Supervisor, ThreadHealth};
use tokio::sync::oneshot;

use crate::bindings::ResponseInfo;
use crate::error::FilterFault;
pub use crate::generation::{Generation, RequestDone, ResponseDone, Ticket};

mod reply;
mod thread;

use reply::Reply;
use thread::Worker;

/// Why the pool could not take a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    /// No chain with that index.
    #[error("no filter chain with index {0}")]
    UnknownChain(usize),
    /// The pool has shut down.
    #[error("the worker pool has stopped")]
    Stopped,
    /// The worker running the job died (it was replaced); the job was not finished.
    #[error("the filter worker running the request died (it was replaced)")]
    WorkerLost,
    /// Generations must be published in increasing order.
    #[error("generation {published} is not newer than the current {current}")]
    StaleGeneration {
        /// What was published.
        published: u64,
        /// What was current.
        current: u64,
    },
}

enum Job {
    Request {
        generation: Arc<Generation>,
        chain: usize,
        head: RequestHead,
        reply: Reply<RequestDone>,
    },
    Response {
        ticket: Ticket,
        head: RequestHead,
        info: ResponseInfo,
        reply: Reply<ResponseDone>,
    },
    Resume {
        ticket: Ticket,
        park: u32,
        token: u32,
        answer: crate::callout::CalloutReply,
        reply: Reply<Option<RequestDone>>,
    },
    Abandon {
        ticket: Ticket,
        park: u32,
        info: ResponseInfo,
        reply: Reply<Option<ResponseDone>>,
    },
    Switch(Arc<Generation>),
    /// A plugin's shared queue has news for it.
    Wake,
    /// Panic while holding a request's reply (tests of supervision).
    #[cfg(feature = "fault-injection")]
    Panic(Reply<RequestDone>),
}

/// A fixed set of worker threads running filter chains.
pub struct WorkerPool {
    senders: Vec<Arc<Sender<Job>>>,
    current: ArcSwap<Generation>,
    /// The generation each worker runs new requests on.
    on: Arc<[AtomicU64]>,
    next: AtomicUsize,
    threads: Vec<JoinHandle<()>>,
    supervisor: Arc<Supervisor>,
    /// Each worker's supervision state, in worker order: a worker left down is passed
    /// over (one atomic load per request).
    health: Vec<Arc<ThreadHealth>>,
}

impl std::fmt::Debug for WorkerPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerPool")
            .field("workers", &self.senders.len())
            .field("generation", &self.current.load().number())
            .finish()
    }
}

impl WorkerPool {
    /// Starts `workers` threads on `generation`, each creating its instances of every
    /// chain before taking requests.
    pub fn start(generation: Arc<Generation>, workers: usize) -> std::io::Result<Self> {
        let workers = workers.max(1);
        let on: Arc<[AtomicU64]> = (0..workers)
            .map(|_| AtomicU64::new(generation.number()))
            .collect();
        let mut senders = Vec::with_capacity(workers);
        let mut threads = Vec::with_capacity(workers);
        let supervisor = Supervisor::new();
        let (ready_tx, ready_rx) = crossbeam_channel::bounded::<()>(workers);
        for id in 0..workers {
            let (tx, rx) = crossbeam_channel::unbounded();
            let tx = Arc::new(tx);
            // A plugin's shared queue got an item: the worker tells it between jobs.
            // (Weak: the pool's drop still closes the channel.)
            let weak = Arc::downgrade(&tx);
            let waker: crate::queues::Waker = Arc::new(move || {
                if let Some(tx) = weak.upgrade() {
                    let _ = tx.send(Job::Wake);
                }
            });
            let worker = Worker::new(id, generation.clone(), on.clone(), rx, ready_tx.clone());
            worker.set_waker(waker);
            let thread = supervisor.spawn(
                format!("dpumesh-worker-{id}"),
                RestartPolicy::default(),
                worker,
                Worker::run,
                Worker::recover,
            )?;
            senders.push(tx);
            threads.push(thread);
        }
        drop(ready_tx);
        // Pre-create every instance before the first request, so none waits for one.
        for _ in 0..workers {
            let _ = ready_rx.recv();
        }
        let health = supervisor.threads();
        Ok(Self {
            senders,
            current: ArcSwap::new(generation),
            on,
            next: AtomicUsize::new(0),
            threads,
            supervisor,
            health,
        })
    }

    /// The workers' threads, for readiness: a worker that kept panicking is down.
    pub fn supervisor(&self) -> &Arc<Supervisor> {
        &self.supervisor
    }

    /// Number of workers.
    pub fn workers(&self) -> usize {
        self.senders.len()
    }

    /// The generation new requests run on.
    pub fn current(&self) -> Arc<Generation> {
        self.current.load_full()
    }

    /// The generation each worker has switched to.
    pub fn worker_generations(&self) -> Vec<u64> {
        self.on.iter().map(|g| g.load(Ordering::Acquire)).collect()
    }

    /// Makes `generation` current: requests submitted from now on run on it, and every
    /// worker switches as soon as it finishes its current job. Requests already
    /// submitted finish on the generation they were submitted with.
    pub fn publish(&self, generation: Arc<Generation>) -> Result<(), PoolError> {
        let current = self.current.load().number();
        if generation.number() <= current {
            return Err(PoolError::StaleGeneration {
                published: generation.number(),
                current,
            });
        }
        self.current.store(generation.clone());
        for sender in &self.senders {
            let _ = sender.send(Job::Switch(generation.clone()));
        }
        Ok(())
    }

    fn submit(
        &self,
        generation: Arc<Generation>,
        chain: usize,
        head: RequestHead,
    ) -> Result<oneshot::Receiver<Result<RequestDone, PoolError>>, PoolError> {
        let (reply, done) = oneshot::channel();
        self.submit_to(generation, chain, head, Reply::oneshot(reply))?;
        Ok(done)
    }

    /// Runs chain `chain` of `generation` on the next worker and calls `done` there
    /// with the result (it must be quick: the worker waits for it). `done` is called
    /// exactly once, with [`PoolError::WorkerLost`] if the worker died with the job.
    pub fn request_with(
        &self,
        generation: Arc<Generation>,
        chain: usize,
        head: RequestHead,
        done: impl FnOnce(Result<RequestDone, PoolError>) + Send + 'static,
    ) -> Result<(), PoolError> {
        self.submit_to(generation, chain, head, Reply::callback(done))
    }

    fn submit_to(
        &self,
        generation: Arc<Generation>,
        chain: usize,
        head: RequestHead,
        reply: Reply<RequestDone>,
    ) -> Result<(), PoolError> {
        if chain >= generation.chains().len() {
            return Err(PoolError::UnknownChain(chain));
        }
        let mut job = Job::Request {
            generation,
            chain,
            head,
            reply,
        };
        // A worker that supervision left down (it kept panicking) is passed over, so
        // it takes no share of the requests; one that died a moment ago has dropped
        // its channel, and the send gives the job back for the next worker.
        let workers = self.senders.len();
        let first = self.next.fetch_add(1, Ordering::Relaxed);
        for k in 0..workers {
            let worker = (first + k) % workers;
            if self.health.get(worker).is_some_and(|h| h.dead()) {
                continue;
            }
            match self.senders[worker].send(job) {
                Ok(()) => return Ok(()),
                Err(refused) => job = refused.into_inner(),
            }
        }
        // Every worker is down: dropping the job answers it, once, with the loss.
        drop(job);
        Ok(())
    }

    /// Runs chain `chain` of the current generation on the next worker (round robin)
    /// and waits. Not for async contexts: use [`WorkerPool::request`] there.
    pub fn on_request(&self, chain: usize, head: RequestHead) -> Result<RequestDone, PoolError> {
        self.submit(self.current(), chain, head)?
            .blocking_recv()
            .map_err(|_| PoolError::Stopped)?
    }

    /// Runs chain `chain` of `generation` (resolved by the caller, e.g. from a route
    /// table published with it) on the next worker.
    pub async fn request(
        &self,
        generation: Arc<Generation>,
        chain: usize,
        head: RequestHead,
    ) -> Result<RequestDone, PoolError> {
        self.submit(generation, chain, head)?
            .await
            .map_err(|_| PoolError::Stopped)?
    }

    fn submit_response(
        &self,
        ticket: Ticket,
        head: RequestHead,
        info: ResponseInfo,
    ) -> Result<oneshot::Receiver<Result<ResponseDone, PoolError>>, PoolError> {
        let (reply, done) = oneshot::channel();
        self.submit_response_to(ticket, head, info, Reply::oneshot(reply))?;
        Ok(done)
    }

    /// Makes worker `worker` panic while it holds a request (tests of supervision):
    /// the request is answered with [`PoolError::WorkerLost`] and the worker rebuilt.
    #[cfg(feature = "fault-injection")]
    pub fn inject_panic(&self, worker: usize) -> Result<RequestDone, PoolError> {
        let (reply, done) = oneshot::channel();
        self.senders
            .get(worker)
            .ok_or(PoolError::Stopped)?
            .send(Job::Panic(Reply::oneshot(reply)))
            .map_err(|_| PoolError::Stopped)?;
        done.blocking_recv().map_err(|_| PoolError::Stopped)?
    }

    /// Runs the response phase where `ticket` says and calls `done` there (exactly
    /// once, as for [`WorkerPool::request_with`]).
    pub fn response_with(
        &self,
        ticket: Ticket,
        head: RequestHead,
        info: ResponseInfo,
        done: impl FnOnce(Result<ResponseDone, PoolError>) + Send + 'static,
    ) -> Result<(), PoolError> {
        self.submit_response_to(ticket, head, info, Reply::callback(done))
    }

    fn submit_response_to(
        &self,
        ticket: Ticket,
        head: RequestHead,
        info: ResponseInfo,
        reply: Reply<ResponseDone>,
    ) -> Result<(), PoolError> {
        if ticket.chain >= ticket.generation.chains().len() {
            return Err(PoolError::UnknownChain(ticket.chain));
        }
        let worker = ticket.worker;
        let job = Job::Response {
            ticket,
            head,
            info,
            reply,
        };
        self.to_worker_at(worker, job)
    }

    /// Hands a request the worker of `ticket` parked (under `park`) the answer to its
    /// HTTP call `token` there, and calls `done` there with what the chain then decided
    /// (`None`: not parked there any more). Exactly once, as for
    /// [`WorkerPool::request_with`].
    pub fn resume_with(
        &self,
        ticket: Ticket,
        park: u32,
        token: u32,
        answer: crate::callout::CalloutReply,
        done: impl FnOnce(Result<Option<RequestDone>, PoolError>) + Send + 'static,
    ) -> Result<(), PoolError> {
        let job = Job::Resume {
            reply: Reply::callback(done),
            ticket: ticket.clone(),
            park,
            token,
            answer,
        };
        self.to_worker(&ticket, job)
    }

    /// Gives up on a request the worker of `ticket` parked and runs its response phase
    /// with `info` there; `done` as for [`WorkerPool::resume_with`].
    pub fn abandon_with(
        &self,
        ticket: Ticket,
        park: u32,
        info: ResponseInfo,
        done: impl FnOnce(Result<Option<ResponseDone>, PoolError>) + Send + 'static,
    ) -> Result<(), PoolError> {
        let job = Job::Abandon {
            reply: Reply::callback(done),
            ticket: ticket.clone(),
            park,
            info,
        };
        self.to_worker(&ticket, job)
    }

    fn to_worker(&self, ticket: &Ticket, job: Job) -> Result<(), PoolError> {
        if ticket.chain >= ticket.generation.chains().len() {
            return Err(PoolError::UnknownChain(ticket.chain));
        }
        self.to_worker_at(ticket.worker, job)
    }

    /// Sends `job` to worker `worker`, whose instances it needs (a response phase, a
    /// parked request). A worker left down cannot take it: the job is dropped, which
    /// answers it once with [`PoolError::WorkerLost`] (the thread is lost, not the pool
    /// stopped).
    fn to_worker_at(&self, worker: usize, job: Job) -> Result<(), PoolError> {
        let alive = self.health.get(worker).is_none_or(|h| !h.dead());
        let Some(sender) = self.senders.get(worker).filter(|_| alive) else {
            drop(job);
            return Ok(());
        };
        if let Err(refused) = sender.send(job) {
            drop(refused.into_inner());
        }
        Ok(())
    }

    /// Runs the response phase where `ticket` says, and waits. Not for async contexts:
    /// use [`WorkerPool::response`] there.
    pub fn on_response(
        &self,
        ticket: Ticket,
        head: RequestHead,
        info: ResponseInfo,
    ) -> Result<(RequestHead, Vec<FilterFault>), PoolError> {
        self.submit_response(ticket, head, info)?
            .blocking_recv()
            .map_err(|_| PoolError::Stopped)?
    }

    /// Runs the response phase where `ticket` says.
    pub async fn response(
        &self,
        ticket: Ticket,
        head: RequestHead,
        info: ResponseInfo,
    ) -> Result<(RequestHead, Vec<FilterFault>), PoolError> {
        self.submit_response(ticket, head, info)?
            .await
            .map_err(|_| PoolError::Stopped)?
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

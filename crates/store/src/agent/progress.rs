//! The agent's one DMA context and its progress loop: a thread that owns the engine,
//! takes the copies transfers post, runs everything queued as one batch, and tells
//! each poster when its copy landed. Transfers post the next chunk's copy and go on
//! with storage I/O meanwhile, which is where the pipelining comes from.

use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};
use dpumesh_dpa::SharedRegion;
use dpumesh_dpa::dma::{CopyJob, DmaEngine};

/// One copy to make, and where to say it is done.
pub(crate) struct DmaJob {
    pub src: Arc<SharedRegion>,
    pub src_offset: u64,
    pub dst: Arc<SharedRegion>,
    pub dst_offset: u64,
    pub len: u64,
    pub done: Sender<Result<(), String>>,
}

/// The progress loop's handle; dropping it stops the loop once queued copies ran.
pub(crate) struct Progress {
    tx: Option<Sender<DmaJob>>,
    thread: Option<JoinHandle<()>>,
    engine: &'static str,
}

impl Progress {
    pub fn start(mut engine: Box<dyn DmaEngine>) -> std::io::Result<Self> {
        let name = engine.name();
        let (tx, rx) = crossbeam_channel::unbounded::<DmaJob>();
        let thread = std::thread::Builder::new()
            .name("bluecache-dma".into())
            .spawn(move || run(&mut *engine, &rx))?;
        Ok(Self {
            tx: Some(tx),
            thread: Some(thread),
            engine: name,
        })
    }

    pub fn engine(&self) -> &'static str {
        self.engine
    }

    /// Queues a copy; its completion arrives on the job's `done`.
    pub fn post(&self, job: DmaJob) {
        if let Some(tx) = &self.tx
            && let Err(e) = tx.send(job)
        {
            let _ = e.0.done.send(Err("the DMA progress loop stopped".into()));
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run(engine: &mut dyn DmaEngine, rx: &Receiver<DmaJob>) {
    let mut batch = Vec::new();
    while let Ok(first) = rx.recv() {
        // Everything queued meanwhile goes in one batch: one engine submission.
        batch.push(first);
        while batch.len() < 64 {
            match rx.try_recv() {
                Ok(job) => batch.push(job),
                Err(_) => break,
            }
        }
        let jobs: Vec<CopyJob<'_>> = batch.iter().map(copy_job).collect();
        let result = engine.copy(&jobs);
        drop(jobs);
        match result {
            Ok(()) => {
                for job in batch.drain(..) {
                    let _ = job.done.send(Ok(()));
                }
            }
            Err(_) => {
                // Find which failed: each again on its own.
                for job in batch.drain(..) {
                    let one = engine.copy(&[copy_job(&job)]);
                    let _ = job.done.send(one.map_err(|e| e.to_string()));
                }
            }
        }
    }
}

fn copy_job(job: &DmaJob) -> CopyJob<'_> {
    CopyJob {
        src: &job.src,
        src_offset: job.src_offset,
        dst: &job.dst,
        dst_offset: job.dst_offset,
        len: job.len,
    }
}

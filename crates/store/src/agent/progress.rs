//! The agent's one DMA context and its progress loop: a thread that owns the engine,
//! takes the copies transfers post, runs everything queued as one batch, and tells
//! each poster when its copy landed. Transfers post the next chunk's copy and go on
//! with storage I/O meanwhile, which is where the pipelining comes from.
//!
//! The loop is supervised: a panic (an engine bug) is caught, logged and counted
//! (`dpumesh_thread_panics_total{thread="bluecache-dma"}`), the copies of the batch
//! it was running fail (their posters hear so), and the loop runs again; one that
//! keeps panicking is left down, and what is posted then fails at once.

use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};
use dpumesh_dpa::SharedRegion;
use dpumesh_dpa::dma::{CopyJob, DmaEngine};
use dpumesh_supervise::{RestartPolicy, Supervisor};

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
    pub fn start(engine: Box<dyn DmaEngine>) -> std::io::Result<Self> {
        let name = engine.name();
        let (tx, rx) = crossbeam_channel::unbounded::<DmaJob>();
        // Not part of the node's readiness (the data plane serves without the store);
        // its panics are in the logs and `dpumesh_thread_panics_total`.
        let thread = Supervisor::new().spawn(
            "bluecache-dma",
            RestartPolicy::default(),
            (engine, rx),
            |(engine, rx)| run(&mut **engine, rx),
            |_| {},
        )?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use dpumesh_dpa::dma::{DmaError, SoftwareDma};

    /// Panics on its first submission, then copies as the software engine does.
    struct PanicsOnce(bool);

    impl DmaEngine for PanicsOnce {
        fn name(&self) -> &'static str {
            "panics-once"
        }

        fn copy(&mut self, jobs: &[CopyJob<'_>]) -> Result<(), DmaError> {
            if !std::mem::replace(&mut self.0, true) {
                panic!("an engine bug");
            }
            SoftwareDma.copy(jobs)
        }
    }

    fn copy(
        progress: &Progress,
        src: &Arc<SharedRegion>,
        dst: &Arc<SharedRegion>,
    ) -> Result<(), String> {
        let (done, landed) = crossbeam_channel::bounded(1);
        progress.post(DmaJob {
            src: src.clone(),
            src_offset: 0,
            dst: dst.clone(),
            dst_offset: 0,
            len: 4,
            done,
        });
        landed
            .recv_timeout(std::time::Duration::from_secs(10))
            .map_err(|e| format!("no answer: {e}"))?
    }

    #[test]
    fn a_panicking_engine_fails_its_batch_and_the_loop_copies_again() {
        let src = Arc::new(SharedRegion::create_unique("dpumesh-test-src", 4096).unwrap());
        let dst = Arc::new(SharedRegion::create_unique("dpumesh-test-dst", 4096).unwrap());
        src.write(0, b"abcd").unwrap();
        let progress = Progress::start(Box::new(PanicsOnce(false))).unwrap();
        // The batch the panic took with it is answered (its sender is gone), not hung.
        assert!(copy(&progress, &src, &dst).is_err());
        // The loop runs again and copies.
        copy(&progress, &src, &dst).unwrap();
        let mut got = [0u8; 4];
        dst.read(0, &mut got).unwrap();
        assert_eq!(&got, b"abcd");
    }
}

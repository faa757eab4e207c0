//! The futures of asynchronous steps ([`crate::graph::Work::Future`]), run on the
//! event loop's own thread: each is polled when it starts and again whenever its
//! waker is called (from any thread: the waker notes the task and wakes the
//! transport's `poll`, as a finished pool job does). A task waiting for a socket or a
//! timer holds no thread; one whose request finished (answered, or its step timed
//! out) is dropped, which cancels it.

use std::sync::Arc;
use std::task::{Context, Poll, Wake};

use parking_lot::Mutex;

use crate::graph::StepFuture;
use crate::pool::{Done, JobKey};
use crate::result::StepError;
use crate::run::panic_text;
use crate::transport::Waker;

struct Task {
    key: JobKey,
    future: StepFuture,
    waker: std::task::Waker,
}

/// Notes its task as woken and wakes the loop.
struct TaskWaker {
    id: usize,
    woken: Arc<Mutex<Vec<usize>>>,
    wake: Waker,
}

impl Wake for TaskWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.lock().push(self.id);
        (self.wake)();
    }
}

/// The live tasks of one loop, by id (ids are reused).
pub(crate) struct Tasks {
    slots: Vec<Option<Task>>,
    free: Vec<usize>,
    woken: Arc<Mutex<Vec<usize>>>,
    /// Taken from `woken` each turn (kept to reuse its memory).
    batch: Vec<usize>,
    wake: Waker,
    live: usize,
}

impl Tasks {
    /// Tasks whose wakers wake the loop with `wake`.
    pub(crate) fn new(wake: Waker) -> Self {
        Self {
            slots: Vec::new(),
            free: Vec::new(),
            woken: Arc::new(Mutex::new(Vec::new())),
            batch: Vec::new(),
            wake,
            live: 0,
        }
    }

    /// Tasks not finished yet.
    pub(crate) fn live(&self) -> usize {
        self.live
    }

    /// Adds the task of step `key` and polls it once: its outcome if it finished.
    pub(crate) fn spawn(&mut self, key: JobKey, future: StepFuture) -> Option<Done> {
        let id = self.free.pop().unwrap_or_else(|| {
            self.slots.push(None);
            self.slots.len() - 1
        });
        let waker = std::task::Waker::from(Arc::new(TaskWaker {
            id,
            woken: self.woken.clone(),
            wake: self.wake.clone(),
        }));
        self.slots[id] = Some(Task { key, future, waker });
        self.live += 1;
        self.poll(id)
    }

    /// Polls every task woken since the last call; appends the finished ones to
    /// `out`. How many were polled.
    pub(crate) fn poll_woken(&mut self, out: &mut Vec<Done>) -> usize {
        std::mem::swap(&mut self.batch, &mut self.woken.lock());
        let mut batch = std::mem::take(&mut self.batch);
        let n = batch.len();
        for id in batch.drain(..) {
            // An id woken twice, or woken after its task ended (its id maybe reused
            // since: a spurious poll, which futures allow), is polled at most once here.
            if let Some(done) = self.poll(id) {
                out.push(done);
            }
        }
        self.batch = batch;
        n
    }

    fn poll(&mut self, id: usize) -> Option<Done> {
        let task = self.slots.get_mut(id)?.as_mut()?;
        let waker = task.waker.clone();
        let mut cx = Context::from_waker(&waker);
        let polled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            task.future.as_mut().poll(&mut cx)
        }));
        let outcome = match polled {
            Ok(Poll::Pending) => return None,
            Ok(Poll::Ready(Ok(out))) => Ok(out),
            Ok(Poll::Ready(Err(message))) => Err(StepError::Failed(message)),
            Err(panic) => Err(StepError::Panicked(panic_text(&*panic))),
        };
        let task = self.slots[id].take().expect("polled above");
        self.free.push(id);
        self.live -= 1;
        Some(Done {
            key: task.key,
            outcome,
        })
    }

    /// Drops (cancels) the tasks of the request in `slot` of `generation`.
    pub(crate) fn cancel(&mut self, slot: u32, generation: u32) {
        if self.live == 0 {
            return;
        }
        for (id, entry) in self.slots.iter_mut().enumerate() {
            if entry
                .as_ref()
                .is_some_and(|t| t.key.slot == slot && t.key.generation == generation)
            {
                *entry = None;
                self.free.push(id);
                self.live -= 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::result::StepOutput;

    fn key(slot: u32) -> JobKey {
        JobKey {
            slot,
            generation: 0,
            node: 0,
        }
    }

    /// A future that is pending until `gate` is set, counting its polls.
    fn gated(gate: Arc<Mutex<Option<std::task::Waker>>>, open: Arc<AtomicUsize>) -> StepFuture {
        Box::pin(std::future::poll_fn(move |cx| {
            if open.load(Ordering::SeqCst) == 1 {
                Poll::Ready(Ok(StepOutput::from("done")))
            } else {
                *gate.lock() = Some(cx.waker().clone());
                Poll::Pending
            }
        }))
    }

    #[test]
    fn a_ready_future_finishes_in_its_first_poll_and_a_waiting_one_when_woken() {
        let wakes = Arc::new(AtomicUsize::new(0));
        let counted = wakes.clone();
        let mut tasks = Tasks::new(Arc::new(move || {
            counted.fetch_add(1, Ordering::SeqCst);
        }));
        let ready = tasks.spawn(key(1), Box::pin(async { Ok(StepOutput::from("now")) }));
        assert_eq!(ready.unwrap().outcome.unwrap().body, "now");
        assert_eq!(tasks.live(), 0);

        let gate = Arc::new(Mutex::new(None));
        let open = Arc::new(AtomicUsize::new(0));
        assert!(
            tasks
                .spawn(key(2), gated(gate.clone(), open.clone()))
                .is_none()
        );
        assert_eq!(tasks.live(), 1);
        let mut out = Vec::new();
        assert_eq!(tasks.poll_woken(&mut out), 0, "nothing woke it");
        open.store(1, Ordering::SeqCst);
        // Woken from another thread, as a socket's reactor would.
        let waker = gate.lock().take().unwrap();
        std::thread::spawn(move || waker.wake()).join().unwrap();
        assert_eq!(wakes.load(Ordering::SeqCst), 1, "the loop was woken");
        assert_eq!(tasks.poll_woken(&mut out), 1);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].key.slot, 2);
        assert_eq!(tasks.live(), 0);
    }

    #[test]
    fn a_panic_fails_the_step_and_a_finished_request_cancels_its_tasks() {
        let mut tasks = Tasks::new(Arc::new(|| {}));
        let panicked = tasks
            .spawn(key(1), Box::pin(async { panic!("boom") }))
            .unwrap();
        assert!(matches!(panicked.outcome, Err(StepError::Panicked(m)) if m.contains("boom")));
        let gate = Arc::new(Mutex::new(None));
        let open = Arc::new(AtomicUsize::new(0));
        assert!(
            tasks
                .spawn(key(7), gated(gate.clone(), open.clone()))
                .is_none()
        );
        assert!(tasks.spawn(key(8), gated(gate, open)).is_none());
        tasks.cancel(7, 0);
        assert_eq!(tasks.live(), 1, "only slot 7's task is dropped");
        tasks.cancel(8, 1);
        assert_eq!(
            tasks.live(),
            1,
            "another generation of slot 8 is not its request"
        );
    }
}

//! A job's answer, owed until it is sent: whatever happens to the worker, the caller
//! hears back exactly once.

use tokio::sync::oneshot;

use super::PoolError;

/// Where a finished phase goes: an awaiting task, or a function called on the worker
/// (for callers that are not async, e.g. a data-path reactor with its own wake-up).
pub(super) enum Target<T> {
    Oneshot(oneshot::Sender<Result<T, PoolError>>),
    Callback(Box<dyn FnOnce(Result<T, PoolError>) + Send>),
}

/// A job's answer, owed: sent once with the result, or — if the job is dropped
/// unanswered because its worker panicked — with [`PoolError::WorkerLost`].
pub(super) struct Reply<T>(Option<Target<T>>);

impl<T> Reply<T> {
    pub(super) fn oneshot(tx: oneshot::Sender<Result<T, PoolError>>) -> Self {
        Self(Some(Target::Oneshot(tx)))
    }

    pub(super) fn callback(f: impl FnOnce(Result<T, PoolError>) + Send + 'static) -> Self {
        Self(Some(Target::Callback(Box::new(f))))
    }

    pub(super) fn send(mut self, value: Result<T, PoolError>) {
        match self.0.take() {
            Some(Target::Oneshot(tx)) => {
                let _ = tx.send(value);
            }
            Some(Target::Callback(f)) => f(value),
            None => {}
        }
    }
}

impl<T> Drop for Reply<T> {
    fn drop(&mut self) {
        // Only a job abandoned by a panicking worker gets here with its answer owed.
        match self.0.take() {
            Some(Target::Oneshot(tx)) => {
                let _ = tx.send(Err(PoolError::WorkerLost));
            }
            Some(Target::Callback(f)) => {
                // A callback that panics while we are unwinding would abort.
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    f(Err(PoolError::WorkerLost))
                }));
            }
            None => {}
        }
    }
}

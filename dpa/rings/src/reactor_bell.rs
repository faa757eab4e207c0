//! A bell's eventfd in a tokio reactor's wait set: for a consumer that sleeps in its
//! runtime's `epoll` with its sockets (a pod driving its loop and its tasks on one
//! thread) instead of in [`crate::bell::Bell::wait`].
#![allow(unsafe_code)]

use std::os::fd::{BorrowedFd, OwnedFd};

use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

/// A bell's eventfd, registered with the current runtime's reactor.
#[derive(Debug)]
pub struct ReactorBell {
    fd: AsyncFd<OwnedFd>,
}

impl ReactorBell {
    /// Registers a duplicate of `eventfd` (a bell's: [`crate::bell::Bell::fd`]) with
    /// the reactor of the runtime this is called in.
    pub fn new(eventfd: BorrowedFd<'_>) -> std::io::Result<Self> {
        let owned = eventfd.try_clone_to_owned()?;
        // SAFETY: tokio requires that the descriptor stay open, and keep its number,
        // for as long as it is registered. The AsyncFd owns this duplicate, which no
        // one else holds, and closes it only on drop, after deregistering it.
        let fd = unsafe { AsyncFd::register_with_interest(owned, Interest::READABLE) }?;
        Ok(Self { fd })
    }

    /// Waits until the eventfd is readable (rung). The readiness is forgotten: the
    /// caller drains the eventfd ([`crate::bell::Bell::drain`]), so its next ring
    /// is a new edge.
    pub async fn rung(&self) -> std::io::Result<()> {
        let mut ready = self.fd.readable().await?;
        ready.clear_ready();
        Ok(())
    }
}

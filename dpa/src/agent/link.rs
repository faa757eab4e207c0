//! The agent's channel to its DPU: requests from many threads, answers with the
//! descriptors that came with them, and requests nobody answers (doorbells). Pushes
//! from the DPU go to the agent's [`super::PushSink`], given when the link is made.

use std::os::fd::{BorrowedFd, OwnedFd};

use crate::control::transport::MuxClient;
use crate::control::{ControlError, Request, Response};

/// What the agent needs of its channel to the DPU.
pub trait DpuLink: Send + Sync {
    /// Sends `request` (with `fds`, where the channel carries them) and waits for
    /// the answer; an `Error` answer is [`ControlError::Refused`].
    fn request(
        &self,
        request: Request,
        fds: &[BorrowedFd<'_>],
    ) -> Result<(Response, Vec<OwnedFd>), ControlError>;

    /// Sends a request that is not answered.
    fn notify(&self, request: Request) -> Result<(), ControlError>;

    /// Whether regions ride as descriptors (the node's Unix socket, software), or
    /// must be exported for DMA across PCIe.
    fn carries_descriptors(&self) -> bool;
}

impl DpuLink for MuxClient {
    fn request(
        &self,
        request: Request,
        fds: &[BorrowedFd<'_>],
    ) -> Result<(Response, Vec<OwnedFd>), ControlError> {
        self.request_with_fds(request, fds)
    }

    fn notify(&self, request: Request) -> Result<(), ControlError> {
        MuxClient::notify(self, request)
    }

    fn carries_descriptors(&self) -> bool {
        true
    }
}

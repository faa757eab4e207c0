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

/// The agent's link over DOCA Comch (`doca` feature: a BlueField host, to its DPU's
/// `dpumesh node --data-path doca`): regions cross as their PCI exports, never as
/// descriptors. Comch is progressed by one thread (its callbacks run inside
/// `doca_pe_progress`), which owns the client: requests reach it on a channel, and
/// between them it progresses every 100 µs to take the DPU's pushes. Compiled
/// wherever the feature is; not run (it needs a BlueField).
#[cfg(feature = "doca")]
pub struct ComchLink {
    jobs: Option<crossbeam_channel::Sender<Job>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

#[cfg(feature = "doca")]
enum Job {
    Ask(
        Request,
        crossbeam_channel::Sender<Result<Response, ControlError>>,
    ),
    Tell(Request),
}

#[cfg(feature = "doca")]
impl std::fmt::Debug for ComchLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ComchLink")
    }
}

#[cfg(feature = "doca")]
impl ComchLink {
    /// Connects to the DPU's Comch server `server` through the host device at `pci`
    /// and says Hello as host `name`; the DPU's pushes go to `sink`.
    pub fn connect(
        pci: &str,
        server: &str,
        name: &str,
        sink: super::PushSink,
    ) -> Result<Self, ControlError> {
        use crate::control::comch::ComchClient;
        use crossbeam_channel::RecvTimeoutError;
        let (jobs, queue) = crossbeam_channel::unbounded::<Job>();
        let (ready, connected) = crossbeam_channel::bounded(1);
        let (pci, server, name) = (pci.to_owned(), server.to_owned(), name.to_owned());
        let thread = std::thread::Builder::new()
            .name("dpumesh-agent-comch".to_owned())
            .spawn(move || {
                let timeout = std::time::Duration::from_secs(10);
                let mut client = match ComchClient::connect(
                    &pci,
                    &server,
                    crate::control::Role::Host,
                    &name,
                    timeout,
                ) {
                    Ok(client) => {
                        let _ = ready.send(Ok(()));
                        client
                    }
                    Err(e) => {
                        let _ = ready.send(Err(e));
                        return;
                    }
                };
                let why = loop {
                    match queue.recv_timeout(std::time::Duration::from_micros(100)) {
                        Ok(Job::Ask(request, answer)) => {
                            let _ = answer.send(client.request(request));
                        }
                        Ok(Job::Tell(request)) => {
                            if let Err(e) = client.notify(request) {
                                break e.to_string();
                            }
                        }
                        Err(RecvTimeoutError::Timeout) => {
                            if let Err(e) = client.poll() {
                                break e.to_string();
                            }
                        }
                        Err(RecvTimeoutError::Disconnected) => {
                            break "the agent stopped".to_owned();
                        }
                    }
                    for push in client.take_pushes() {
                        sink.deliver(push);
                    }
                };
                sink.deliver(Response::Teardown { reason: why });
            })?;
        connected.recv().map_err(|_| ControlError::Closed)??;
        Ok(Self {
            jobs: Some(jobs),
            thread: Some(thread),
        })
    }
}

#[cfg(feature = "doca")]
impl Drop for ComchLink {
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(feature = "doca")]
impl DpuLink for ComchLink {
    fn request(
        &self,
        request: Request,
        fds: &[BorrowedFd<'_>],
    ) -> Result<(Response, Vec<OwnedFd>), ControlError> {
        if !fds.is_empty() {
            return Err(ControlError::Body(
                "descriptors do not cross Comch: regions go as their PCI exports".to_owned(),
            ));
        }
        let (answer, answered) = crossbeam_channel::bounded(1);
        self.jobs
            .as_ref()
            .ok_or(ControlError::Closed)?
            .send(Job::Ask(request, answer))
            .map_err(|_| ControlError::Closed)?;
        answered
            .recv()
            .map_err(|_| ControlError::Closed)?
            .map(|r| (r, Vec::new()))
    }

    fn notify(&self, request: Request) -> Result<(), ControlError> {
        self.jobs
            .as_ref()
            .ok_or(ControlError::Closed)?
            .send(Job::Tell(request))
            .map_err(|_| ControlError::Closed)
    }

    fn carries_descriptors(&self) -> bool {
        false
    }
}

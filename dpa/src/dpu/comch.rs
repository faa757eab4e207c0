//! The node's control channel on DOCA Comch (`doca` feature): on a BlueField the
//! host's agent registers pods here rather than on a Unix socket. Comch is progressed
//! by the one thread that made the server (its callbacks run inside
//! `doca_pe_progress`), so the server lives and dies on a thread of its own. Written
//! and compiled; it needs a BlueField to run.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::control::ControlError;
use crate::control::comch::ComchServer;
use crate::control::transport::Handler;

/// Where the node's Comch server runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ComchAddress {
    /// The DPU's device (its PCI address on the DPU, e.g. `03:00.0`).
    pub pci: String,
    /// The representor of the host function whose agent connects.
    pub rep_pci: String,
    /// The server's name (what the host agent connects to).
    pub name: String,
}

impl std::str::FromStr for ComchAddress {
    type Err = String;

    /// `PCI,REP_PCI,NAME`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let parts: Vec<&str> = s.split(',').map(str::trim).collect();
        match parts.as_slice() {
            [pci, rep, name] if !pci.is_empty() && !rep.is_empty() && !name.is_empty() => {
                Ok(Self {
                    pci: (*pci).to_owned(),
                    rep_pci: (*rep).to_owned(),
                    name: (*name).to_owned(),
                })
            }
            _ => Err(format!(
                "{s:?} is not a Comch address: PCI,REP_PCI,NAME (the DPU's device, the host function's representor, the server's name)"
            )),
        }
    }
}

/// The Comch server's thread.
#[derive(Debug)]
pub struct ComchThread {
    name: String,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ComchThread {
    /// Starts the server on its thread; returns once it serves (or why it cannot).
    pub fn start(address: &ComchAddress, handler: Arc<dyn Handler>) -> Result<Self, ControlError> {
        let stop = Arc::new(AtomicBool::new(false));
        let (ready, started) = crossbeam_channel::bounded(1);
        let thread = {
            let stop = stop.clone();
            let address = address.clone();
            std::thread::Builder::new()
                .name("dpumesh-comch".to_owned())
                .spawn(move || {
                    let mut server = match ComchServer::start(
                        &address.pci,
                        &address.rep_pci,
                        &address.name,
                        handler,
                    ) {
                        Ok(server) => {
                            let _ = ready.send(Ok(()));
                            server
                        }
                        Err(e) => {
                            let _ = ready.send(Err(e));
                            return;
                        }
                    };
                    while !stop.load(Ordering::Relaxed) {
                        if let Err(e) = server.serve_for(Duration::from_millis(100)) {
                            tracing::error!(error = %e, "the Comch control channel failed");
                            break;
                        }
                    }
                })?
        };
        started.recv().map_err(|_| ControlError::Closed)??;
        Ok(Self {
            name: address.name.clone(),
            stop,
            thread: Some(thread),
        })
    }

    /// The server's name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for ComchThread {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

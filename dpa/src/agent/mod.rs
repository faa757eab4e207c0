//! The host agent (`dpumesh host`, one per host): on a BlueField the proxy runs on
//! the DPU's own kernel, so nothing maps memory in both it and the host's pods. Pods
//! register here, on the Unix socket they use anyway and with the same frames (the
//! host library and every binding are unchanged). The agent makes each pod's pools,
//! rings and bell in host memory, exports them (`doca_mmap_export_pci` on a BlueField;
//! in software the regions themselves ride as descriptors) and registers the pod with
//! the DPU ([`Request::AdoptPod`]); the DPU reaches them across PCIe.
//!
//! It also carries what DMA cannot: the DPU cannot write a host eventfd, so it asks
//! the agent to wake a pod ([`Response::Wake`]), and a pod cannot write the DPU's, so
//! the agent's per-lane bells, which every pod rings after publishing, become one
//! [`Request::Doorbell`] per burst.
//!
//! - [`link`]: the agent's channel to its DPU ([`DpuLink`]: the node's Unix socket
//!   here, Comch on a BlueField);
//! - `pods`: a pod's regions, laid out and exported;
//! - here: the agent's server and what it relays.

pub mod link;
mod pods;

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

use crate::bell::{Bell, WaitSet};
use crate::control::transport::{ControlServer, Endpoint, Handler, Peer, StoreReply};
use crate::control::{ErrorCode, PodShape, Request, Response, Role};
use crate::dma::export::RegionExporter;
use crate::ring::Producer;

pub use link::DpuLink;
use pods::AgentPod;

/// Why the agent could not start.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Control(#[from] crate::control::ControlError),
    #[error(transparent)]
    Bell(#[from] crate::bell::BellError),
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error("the DPU answered {0}")]
    Unexpected(String),
}

/// How the agent runs.
pub struct AgentConfig {
    /// A name for region names and logs (the host's).
    pub name: String,
    /// Where pods register (`/run/dpumesh/NODE.sock`).
    pub listen: std::path::PathBuf,
    /// Exports each region for the DPU (on a BlueField: `DocaExporter`); `None`: the
    /// software split, where the regions ride as descriptors to the node.
    pub exporter: Option<Arc<Mutex<dyn RegionExporter>>>,
}

/// What the agent's threads share.
struct State {
    name: String,
    link: Arc<dyn DpuLink>,
    shape: PodShape,
    node: String,
    exporter: Option<Arc<Mutex<dyn RegionExporter>>>,
    /// One bell per lane, which every pod rings after publishing to that lane's TX SQ.
    lane_bells: Vec<Bell>,
    /// Pods by the connection that registered them.
    pods: Mutex<HashMap<u64, AgentPod>>,
    /// How to wake each pod, by its id (what a `Wake` names).
    wakers: Mutex<HashMap<u32, Arc<Mutex<Producer>>>>,
    /// Why the DPU link closed, once it did.
    closed: Mutex<Option<String>>,
    stop: AtomicBool,
}

/// A running host agent.
pub struct HostAgent {
    state: Arc<State>,
    server: Option<ControlServer>,
    doorbells: Option<std::thread::JoinHandle<()>>,
    /// Rung to stop the doorbell thread.
    stop_bell: Bell,
}

impl std::fmt::Debug for HostAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostAgent")
            .field("name", &self.state.name)
            .finish_non_exhaustive()
    }
}

/// Where the DPU's pushes go: set once the agent's state exists (the link is made
/// before it, and pushes may come at once).
#[derive(Default, Clone)]
pub struct PushSink(Arc<Mutex<Option<std::sync::Weak<State>>>>);

impl std::fmt::Debug for PushSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PushSink")
    }
}

impl PushSink {
    /// Hands one unsolicited frame from the DPU to the agent.
    pub fn deliver(&self, push: Response) {
        let Some(state) = self.0.lock().as_ref().and_then(std::sync::Weak::upgrade) else {
            return;
        };
        match push {
            Response::Wake { pod } => {
                let waker = state.wakers.lock().get(&pod).cloned();
                if let Some(waker) = waker {
                    waker.lock().wake();
                }
            }
            Response::Teardown { reason } => {
                tracing::warn!(%reason, "the DPU closed the host agent's link");
                state.closed.lock().get_or_insert(reason);
            }
            other => tracing::warn!(?other, "an unexpected push from the DPU"),
        }
    }
}

impl HostAgent {
    /// Starts the agent: asks the DPU (over `link`, whose pushes go to `sink`) how
    /// pods are laid out, makes the lane bells and listens for pods.
    pub fn start(
        config: AgentConfig,
        link: Arc<dyn DpuLink>,
        sink: &PushSink,
        node: String,
    ) -> Result<Self, AgentError> {
        let shape = match link.request(Request::PodShape, &[])?.0 {
            Response::PodShape(shape) => shape,
            other => return Err(AgentError::Unexpected(format!("{other:?} to PodShape"))),
        };
        let lane_bells = (0..shape.lanes)
            .map(|k| {
                let bell = Bell::create_sealed(&format!("dpumesh-{}-agent-l{k}", config.name))?;
                // The agent always listens: a pod rings after every publish it makes
                // (see `doorbells` for why it cannot know when the DPU sleeps).
                bell.sleep_begins();
                Ok(bell)
            })
            .collect::<Result<Vec<_>, crate::bell::BellError>>()?;
        let state = Arc::new(State {
            name: config.name,
            link,
            shape,
            node,
            exporter: config.exporter,
            lane_bells,
            pods: Mutex::default(),
            wakers: Mutex::default(),
            closed: Mutex::default(),
            stop: AtomicBool::new(false),
        });
        *sink.0.lock() = Some(Arc::downgrade(&state));
        let stop_bell = Bell::create_sealed(&format!("dpumesh-{}-agent-stop", state.name))?;
        stop_bell.sleep_begins();
        let doorbells = {
            let state = state.clone();
            let stop = stop_bell.clone();
            std::thread::Builder::new()
                .name("dpumesh-agent-doorbells".to_owned())
                .spawn(move || doorbells(&state, &stop))?
        };
        let server = ControlServer::start(
            &Endpoint::Unix(config.listen),
            Arc::new(AgentHandler(state.clone())),
        )?;
        tracing::info!(lanes = shape.lanes, node = %state.node, "host agent serving");
        Ok(Self {
            state,
            server: Some(server),
            doorbells: Some(doorbells),
            stop_bell,
        })
    }

    /// Pods registered through it.
    pub fn pods(&self) -> usize {
        self.state.pods.lock().len()
    }

    /// Why the DPU link closed, if it did (the agent is of no use then: its pods'
    /// regions are unreachable; a supervisor restarts it).
    pub fn closed(&self) -> Option<String> {
        self.state.closed.lock().clone()
    }
}

impl Drop for HostAgent {
    fn drop(&mut self) {
        // Pods hear Teardown first; their departures unregister them at the DPU.
        self.server.take();
        self.state.stop.store(true, Ordering::Relaxed);
        self.stop_bell.ring();
        if let Some(t) = self.doorbells.take() {
            let _ = t.join();
        }
    }
}

/// Turns rings of the lane bells into doorbells for the DPU: one per wake-up of this
/// thread per lane, however many pods rang meanwhile (the eventfd counts them).
///
/// The pods ring after every publish because the agent's bells always say someone
/// sleeps: the shards' sleep is on the DPU, and telling the host of each one would
/// cost a DMA write per sleep. (Planned: the DPU pushes its shard's `waiting` word
/// into the lane bell when it goes to sleep, so pods ring only a sleeping shard.)
fn doorbells(state: &State, stop: &Bell) {
    let mut set = match WaitSet::new() {
        Ok(set) => set,
        Err(e) => {
            tracing::error!(error = %e, "the host agent cannot watch its bells");
            return;
        }
    };
    let stop_token = state.lane_bells.len() as u64;
    for (k, bell) in state.lane_bells.iter().enumerate() {
        if let Err(e) = set.add(bell.fd(), k as u64) {
            tracing::error!(error = %e, "the host agent cannot watch its bells");
            return;
        }
    }
    if set.add(stop.fd(), stop_token).is_err() {
        return;
    }
    while !state.stop.load(Ordering::Relaxed) {
        if set.wait(Duration::from_secs(1)).is_err() {
            std::thread::sleep(Duration::from_millis(10));
        }
        for (k, bell) in state.lane_bells.iter().enumerate() {
            if bell.drain() {
                let _ = state.link.notify(Request::Doorbell { lane: k as u32 });
            }
        }
    }
}

struct AgentHandler(Arc<State>);

impl Handler for AgentHandler {
    fn node_name(&self) -> String {
        self.0.node.clone()
    }

    fn handle(&self, peer: &Peer, request: Request) -> Response {
        self.handle_with_fds(peer, request).0
    }

    fn handle_with_fds(&self, peer: &Peer, request: Request) -> (Response, Vec<OwnedFd>) {
        let state = &self.0;
        match request {
            Request::RegisterPod {
                name,
                service,
                pid,
                token,
            } => {
                if peer.role != Role::Host {
                    return (
                        refuse(ErrorCode::BadRequest, "only hosts register pods"),
                        Vec::new(),
                    );
                }
                if state.pods.lock().contains_key(&peer.id) {
                    return (
                        refuse(
                            ErrorCode::BadRequest,
                            "this connection registered a pod already",
                        ),
                        Vec::new(),
                    );
                }
                match pods::register(state, &name, &service, pid, token) {
                    Ok((pod, exports, fds)) => {
                        state.wakers.lock().insert(pod.id, pod.waker.clone());
                        state.pods.lock().insert(peer.id, pod);
                        (Response::PodRegistered(Box::new(exports)), fds)
                    }
                    Err(refusal) => (refusal, Vec::new()),
                }
            }
            Request::UnregisterPod { pod_id } => {
                let ours = state
                    .pods
                    .lock()
                    .get(&peer.id)
                    .is_some_and(|p| p.id == pod_id);
                if !ours {
                    return (
                        refuse(
                            ErrorCode::UnknownPod,
                            &format!("pod {pod_id} is not registered by this connection"),
                        ),
                        Vec::new(),
                    );
                }
                self.leave(peer);
                (Response::Ok, Vec::new())
            }
            // What the DPU answers for anyone, relayed as asked.
            request @ (Request::Ping | Request::Resolve { .. } | Request::Locate { .. }) => {
                match state.link.request(request, &[]) {
                    Ok((response, _)) => (response, Vec::new()),
                    Err(e) => (refuse(ErrorCode::Internal, &e.to_string()), Vec::new()),
                }
            }
            // Only the agent speaks these to the DPU.
            Request::PodShape | Request::AdoptPod { .. } | Request::Doorbell { .. } => (
                refuse(ErrorCode::BadRequest, "pods register with RegisterPod"),
                Vec::new(),
            ),
            Request::Hello { .. } | Request::Store(_) | Request::Authenticate { .. } => (
                refuse(ErrorCode::Internal, "a request took the wrong path"),
                Vec::new(),
            ),
        }
    }

    fn handle_store(&self, _peer: &Peer, _message: Vec<u8>, _fds: Vec<OwnedFd>, reply: StoreReply) {
        reply.refuse(
            ErrorCode::BadRequest,
            "the BlueCache store is not reachable through the host agent (its buffers would need exporting too)",
        );
    }

    fn disconnected(&self, peer: &Peer) {
        self.leave(peer);
    }
}

impl AgentHandler {
    /// The pod of `peer` leaves: the DPU lets go of it first (its shards stop
    /// touching its regions), then its exports are withdrawn and its regions freed.
    fn leave(&self, peer: &Peer) {
        let Some(pod) = self.0.pods.lock().remove(&peer.id) else {
            return;
        };
        self.0.wakers.lock().remove(&pod.id);
        if let Err(e) = self
            .0
            .link
            .request(Request::UnregisterPod { pod_id: pod.id }, &[])
        {
            tracing::warn!(pod = pod.id, error = %e, "the DPU did not confirm a pod's departure");
        }
        pods::withdraw(&self.0, pod);
    }
}

fn refuse(code: ErrorCode, message: &str) -> Response {
    Response::Error {
        code,
        message: message.to_owned(),
    }
}

/// The descriptor of `fd`, duplicated (what rides with an answer).
fn dup(fd: std::os::fd::BorrowedFd<'_>) -> std::io::Result<OwnedFd> {
    rustix::io::fcntl_dupfd_cloexec(fd.as_fd(), 0).map_err(std::io::Error::from)
}

//! The DMA work of one shard of a node's DPU proxy: it polls the host TX SQs of the
//! shard's pods, moves buffers with its [`DmaEngine`] (memcpy here, DOCA DMA on
//! BlueField-3), writes the pods' host RX SQs and wakes them. It has no thread of its
//! own: the shard that owns it runs [`DmaManager::pass`] in its loop, takes what pods
//! sent with [`DmaManager::next_for_proxy`] and hands its decisions back with
//! [`DmaManager::from_proxy`] — a request goes from a pod's ring to the proxy's chain
//! and on to the next pod's ring without changing threads.
//!
//! - **Intake** (host TX SQ of pod A, cases 1 and 3 and responses): the header is
//!   copied from A's TX header pool into a DPU header slot, which goes to the ARM
//!   (the shard's proxy, on the same thread: [`DmaManager::next_for_proxy`]); A's header slot goes straight back to A with a completion. A's
//!   body slot is claimed by the manager and stays where it is: the body has not moved
//!   yet, only the head goes to the proxy.
//! - **Delivery** (the ARM's decision, through [`DmaManager::from_proxy`]): the header is copied into the
//!   destination pod's RX header pool; the body is either already in that pod's RX
//!   body pool (case 2: the fabric wrote it there) and changes owner, or still in the
//!   source pod's TX body pool (case 3) and is copied pod A → pod B directly, after
//!   which A gets its slot back with a completion.
//! - **Completions from the ARM**: a body that left the node over the fabric (case 1)
//!   goes back to its pod the same way.
//!
//! Every buffer a descriptor names is checked against the pool it claims to be in and
//! against its owner before anything moves, so a pod cannot make the DPU copy memory
//! it does not own. Failures go back to the sender as error descriptors naming the
//! cause; a full destination ring holds deliveries (bounded) instead of dropping them.
//! A pod that stops reading its ring (hung, stopped, deadlocked) is back-pressure, not
//! a queue to grow: once its ring held descriptors and its read position did not move
//! for [`STALL_AFTER`], what is held for it and what comes next is refused at once
//! (`RingFull`: the proxy tries another pod or answers 503 with `retry-after`), until
//! it reads again.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, TryRecvError};

use super::{CopyJob, DmaEngine};
use crate::descriptor::{Buffer, Descriptor, DescriptorStatus, Destination, Kind, StreamPart};
use crate::pool::{BufferPool, OwnerId, PoolError, SlotRef};
use crate::ring::{Consumer, Producer, RingError};

mod complete;
mod intake;
mod mirror;
mod window;

pub use mirror::{Known, MirrorPort, MirrorSides};
pub use window::WindowCopyError;

/// Descriptors taken from one ring per pass, so one busy pod cannot starve others.
const BUDGET: usize = 32;
/// Deliveries held for a pod whose RX ring is full; beyond this they fail.
const MAX_HELD: usize = 4096;
/// A pod whose ring holds descriptors and whose read position did not move for this
/// long counts as not reading. Long enough for a pod that computes between reads on a
/// loaded machine (500 ms was not, in a debug build with a fuzzer running), short
/// enough that a hung pod does not hold the ingress's slots for long.
pub const STALL_AFTER: Duration = Duration::from_secs(2);
/// How often the pods' read positions are looked at.
const WATCH_EVERY: Duration = Duration::from_millis(50);
/// Completions queued for one pod before the pod counts as not reading.
const MAX_QUEUED_COMPLETIONS: usize = 1 << 16;
/// How long a departed pod's port is kept for bodies still on their way elsewhere.
pub const LEAVE_GRACE: Duration = Duration::from_secs(10);

/// A pod as the DMA manager sees it.
#[derive(Debug)]
pub struct PodPort {
    /// The pod's id (also its owner id in its pools).
    pub id: u32,
    /// Heads the pod sends.
    pub tx_header: BufferPool,
    /// Bodies the pod sends.
    pub tx_body: BufferPool,
    /// Heads delivered to the pod.
    pub rx_header: BufferPool,
    /// Bodies delivered to the pod.
    pub rx_body: BufferPool,
    /// Host TX SQ (the pod produces).
    pub tx_sq: Consumer,
    /// Host RX SQ (the pod consumes).
    pub rx_sq: Producer,
    /// The lane these rings are (the shard's index): stamped on every descriptor
    /// delivered, so the pod answers on the same lane.
    pub lane: u8,
    /// The pod's regions are on the other side of PCIe: the pools and rings above are
    /// local mirrors, kept in step through the engine's reach ([`MirrorPort`]).
    pub mirror: Option<Box<MirrorPort>>,
    /// Across PCIe: where the fabric reads and writes the pod's bodies ([`Staging`]).
    pub staging: Option<Staging>,
}

/// A pod's body pools as the fabric reaches them when the pod is across PCIe: regions
/// of this side's memory with the pools' layout (a body is at the same offset in
/// both), which the fabric is registered on instead of the host's memory (on a
/// BlueField, the DPU's RDMA device cannot reach host memory through it). The manager
/// keeps them in step by DMA at the two points a body crosses: a TX body is copied
/// from the host into `tx` when the proxy is about to give it to the fabric
/// (`DmaManager::stage_tx`; a body that stays on the host is never staged), and an RX
/// body the fabric (or the proxy) put into `rx` is copied to the host when it is
/// delivered. Every shard's port of the pod shares them (a
/// slot has one owner at a time).
#[derive(Debug, Clone)]
pub struct Staging {
    /// The RX body pool's staging region.
    pub rx: Arc<crate::shm::SharedRegion>,
    /// The TX body pool's staging region.
    pub tx: Arc<crate::shm::SharedRegion>,
}

/// What the node tells the manager.
#[derive(Debug)]
pub enum Command {
    /// Start polling a pod.
    AddPod(Box<PodPort>),
    /// The pod left: take what it already sent, stop polling it, and drop its port
    /// once every body the manager claimed from it is handed on (at most
    /// [`LEAVE_GRACE`]); answer then.
    RemovePod(u32, crossbeam_channel::Sender<()>),
    /// Stop: drop every pod.
    Stop,
}

/// Counters, readable from any thread.
#[derive(Debug, Default)]
pub struct DmaStats {
    /// Descriptors taken from host TX SQs.
    pub intake: AtomicU64,
    /// Descriptors written to host RX SQs (requests and responses).
    pub delivered: AtomicU64,
    /// Completions written.
    pub completions: AtomicU64,
    /// Error descriptors written.
    pub errors: AtomicU64,
    /// Bytes copied by the engine.
    pub bytes: AtomicU64,
    /// Copy batches.
    pub copies: AtomicU64,
    /// Deliveries currently held for full rings.
    pub held: AtomicU64,
}

/// The DMA work of one shard; driven by the shard's thread.
pub struct DmaManager<E: DmaEngine> {
    engine: E,
    pods: HashMap<u32, PodPort>,
    order: Vec<u32>,
    dpu_tx_header: BufferPool,
    dpu_rx_header: BufferPool,
    commands: Receiver<Command>,
    stopped: bool,
    held: HashMap<u32, VecDeque<Descriptor>>,
    /// Which pods stopped reading their ring.
    stalls: Stalls,
    /// What pods sent (heads now in a DPU pool) and delivery notices, for the proxy,
    /// in order.
    to_proxy: VecDeque<Descriptor>,
    /// Departed pods whose ports are kept until their claimed bodies are handed on.
    leaving: Vec<Leaving>,
    /// Completions waiting for room in a pod's RX SQ.
    completions: HashMap<u32, VecDeque<Descriptor>>,
    /// Pods given descriptors since they were last woken, and how many: a pod is woken
    /// once per batch ([`DmaManager::wake_pods`]), not once per descriptor.
    unwoken: Vec<(u32, u32)>,
    stats: Arc<DmaStats>,
}

/// A pod given this many descriptors to act on (deliveries and errors; slots handed
/// back do not count) is woken at once rather than at the end of the batch: it can
/// start on them while the rest of the batch is still being routed.
const WAKE_BATCH: u32 = 16;

/// Pods that stopped reading their RX ring, as the manager watches them.
#[derive(Debug)]
struct Stalls {
    /// Each pod's RX ring read position when last seen to move.
    watch: HashMap<u32, Watch>,
    /// Pods not reading their ring: deliveries to them are refused.
    stalled: HashSet<u32>,
    /// When the rings are looked at next.
    next: Instant,
}

/// A pod's RX ring read position and since when it has not moved.
#[derive(Debug, Clone, Copy)]
struct Watch {
    consumed: u64,
    since: Instant,
}

#[derive(Debug)]
struct Leaving {
    id: u32,
    since: std::time::Instant,
    done: crossbeam_channel::Sender<()>,
}

impl<E: DmaEngine> std::fmt::Debug for DmaManager<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DmaManager")
            .field("engine", &self.engine.name())
            .field("pods", &self.order)
            .finish_non_exhaustive()
    }
}

/// Why a descriptor could not be carried; becomes an error descriptor.
#[derive(Debug, Clone)]
struct Refusal {
    status: DescriptorStatus,
    detail: String,
}

impl Refusal {
    fn new(status: DescriptorStatus, detail: impl Into<String>) -> Self {
        Self {
            status,
            detail: detail.into(),
        }
    }
}

impl From<PoolError> for Refusal {
    fn from(e: PoolError) -> Self {
        let status = match e {
            PoolError::Exhausted { .. } => DescriptorStatus::PoolExhausted,
            _ => DescriptorStatus::BadBuffer,
        };
        Self::new(status, e.to_string())
    }
}

impl<E: DmaEngine> DmaManager<E> {
    /// A manager over a shard's DPU header pools; pods come and go by `commands`.
    pub fn new(
        engine: E,
        dpu_tx_header: BufferPool,
        dpu_rx_header: BufferPool,
        commands: Receiver<Command>,
        stats: Arc<DmaStats>,
    ) -> Self {
        Self {
            engine,
            pods: HashMap::new(),
            order: Vec::new(),
            dpu_tx_header,
            dpu_rx_header,
            commands,
            stopped: false,
            held: HashMap::new(),
            stalls: Stalls {
                watch: HashMap::new(),
                stalled: HashSet::new(),
                next: Instant::now(),
            },
            to_proxy: VecDeque::new(),
            leaving: Vec::new(),
            completions: HashMap::new(),
            unwoken: Vec::new(),
            stats,
        }
    }

    /// Looks at each pod's RX ring: one that holds descriptors and whose read position
    /// did not move for the stall time is marked not reading (what is held for it
    /// fails); one that moved is reading.
    fn watch_rings(&mut self, now: Instant) {
        for (&id, pod) in &self.pods {
            let ring = pod.rx_sq.ring();
            let consumed = ring.consumed();
            let w = self.stalls.watch.entry(id).or_insert(Watch {
                consumed,
                since: now,
            });
            if ring.depth() == 0 || consumed != w.consumed {
                *w = Watch {
                    consumed,
                    since: now,
                };
                if self.stalls.stalled.remove(&id) {
                    tracing::info!(pod = id, "the pod reads its RX ring again");
                }
            } else if now.saturating_duration_since(w.since) >= STALL_AFTER
                && self.stalls.stalled.insert(id)
            {
                tracing::warn!(
                    pod = id,
                    "the pod has not read its RX ring for {} ms: deliveries to it are refused until it does",
                    now.saturating_duration_since(w.since).as_millis()
                );
            }
        }
        let stalled: Vec<u32> = self.stalls.stalled.iter().copied().collect();
        for id in stalled {
            for d in self.held.remove(&id).unwrap_or_default() {
                self.stats.held.fetch_sub(1, Ordering::Relaxed);
                let refusal = self.stall_refusal(id, now);
                self.fail_delivery(&d, refusal);
            }
        }
    }

    /// Whether pod `id` is marked not reading and still has not moved its ring.
    fn refuses(&mut self, id: u32) -> bool {
        if !self.stalls.stalled.contains(&id) {
            return false;
        }
        let moved = match (self.pods.get(&id), self.stalls.watch.get(&id)) {
            (Some(pod), Some(w)) => pod.rx_sq.ring().consumed() != w.consumed,
            _ => true,
        };
        if moved {
            self.stalls.stalled.remove(&id);
            self.stalls.watch.remove(&id);
            tracing::info!(pod = id, "the pod reads its RX ring again");
        }
        !moved
    }

    fn stall_refusal(&self, id: u32, now: Instant) -> Refusal {
        let since = self
            .stalls
            .watch
            .get(&id)
            .map_or(Duration::ZERO, |w| now.saturating_duration_since(w.since));
        Refusal::new(
            DescriptorStatus::RingFull,
            format!(
                "pod {id} has not read its RX ring for {} ms",
                since.as_millis()
            ),
        )
    }

    /// Wakes every pod given descriptors since its last wake-up (those that sleep: a
    /// polling pod costs nothing here). Whoever drives the manager calls this at the
    /// end of each batch of work and before it sleeps; a pod whose descriptors wait
    /// for this call sees them anyway if it polls.
    pub fn wake_pods(&mut self) {
        for (id, _) in self.unwoken.drain(..) {
            if let Some(pod) = self.pods.get(&id)
                && pod.mirror.is_none()
            {
                pod.rx_sq.wake();
            }
        }
        // Pods across PCIe: what the batch gave them goes over now (and wakes them).
        for i in 0..self.order.len() {
            let id = self.order[i];
            self.push_mirror(id);
        }
    }

    /// Brings mirrored pod `id`'s mirrors up to its host regions.
    fn pull_mirror(&mut self, id: u32) {
        let Some(pod) = self.pods.get_mut(&id) else {
            return;
        };
        let (Some(mirror), Some(reach)) = (pod.mirror.as_mut(), self.engine.reach()) else {
            return;
        };
        let pools = [&pod.tx_header, &pod.tx_body, &pod.rx_header, &pod.rx_body];
        if let Err(e) = mirror.pull(reach, &pod.tx_sq, &pod.rx_sq, pools) {
            self.stats.errors.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(pod = id, error = %e, "cannot read the pod's rings and words across PCIe");
        }
    }

    /// Brings mirrored pod `id`'s host regions up to its mirrors.
    fn push_mirror(&mut self, id: u32) {
        let Some(pod) = self.pods.get_mut(&id) else {
            return;
        };
        let (Some(mirror), Some(reach)) = (pod.mirror.as_mut(), self.engine.reach()) else {
            return;
        };
        let pools = [&pod.tx_header, &pod.tx_body, &pod.rx_header, &pod.rx_body];
        if let Err(e) = mirror.push(reach, id, &pod.tx_sq, &pod.rx_sq, pools) {
            self.stats.errors.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(pod = id, error = %e, "cannot write the pod's rings and words across PCIe");
        }
    }

    /// Lets go of a dropped port's regions across PCIe.
    fn forget(&mut self, port: PodPort) {
        if let (Some(mut mirror), Some(reach)) = (port.mirror, self.engine.reach()) {
            mirror.release(reach);
        }
    }

    /// Publishes `d` on pod `id`'s RX SQ; its wake-up waits for the batch's end.
    fn publish_to_pod(&mut self, id: u32, d: &Descriptor) -> Result<(), RingError> {
        let Some(pod) = self.pods.get_mut(&id) else {
            return Ok(());
        };
        let mut d = *d;
        d.lane = pod.lane;
        pod.rx_sq.push_quietly(&d)?;
        // A slot handed back is no work the pod must start on: it waits for the
        // batch's end (or for deliveries) instead of counting toward an early wake.
        let urgent = !d.kind.completion || d.kind.error;
        match self.unwoken.iter_mut().find(|(p, _)| *p == id) {
            Some((_, n)) if urgent && *n + 1 >= WAKE_BATCH && pod.mirror.is_none() => {
                *n = 0;
                pod.rx_sq.wake();
            }
            Some((_, n)) => *n += u32::from(urgent),
            None => self.unwoken.push((id, u32::from(urgent))),
        }
        Ok(())
    }

    /// Applies pending commands; false once told to stop (every pod is dropped).
    fn commands(&mut self) -> bool {
        if self.stopped {
            return false;
        }
        loop {
            match self.commands.try_recv() {
                Ok(Command::AddPod(mut port)) => {
                    let p = &mut *port;
                    if let Some(mirror) = p.mirror.as_mut() {
                        let pools = [&p.tx_header, &p.tx_body, &p.rx_header, &p.rx_body];
                        let adopted = match self.engine.reach() {
                            Some(reach) => mirror.adopt(reach, pools),
                            None => Err(crate::dma::DmaError::Engine {
                                engine: self.engine.name(),
                                detail: "this engine does not reach across PCIe".to_owned(),
                            }),
                        };
                        if let Err(e) = adopted {
                            self.stats.errors.fetch_add(1, Ordering::Relaxed);
                            tracing::error!(pod = p.id, error = %e, "cannot reach the pod's regions: it gets nothing from this shard");
                            continue;
                        }
                    }
                    self.order.push(port.id);
                    self.pods.insert(port.id, *port);
                }
                Ok(Command::RemovePod(id, done)) => self.remove_pod(id, done),
                Ok(Command::Stop) | Err(TryRecvError::Disconnected) => {
                    self.stopped = true;
                    let ports: Vec<PodPort> = self.pods.drain().map(|(_, p)| p).collect();
                    for port in ports {
                        self.forget(port);
                    }
                    self.order.clear();
                    return false;
                }
                Err(TryRecvError::Empty) => return true,
            }
        }
    }

    /// Whether a pass would find something to do: a command, a descriptor in a pod's
    /// TX SQ, something held, or something for the proxy.
    pub fn has_work(&self) -> bool {
        !self.commands.is_empty()
            || !self.to_proxy.is_empty()
            || !self.held.is_empty()
            || !self.completions.is_empty()
            || self.pods.values().any(|p| p.tx_sq.has_next())
    }

    /// Whether deliveries or completions wait for room in a pod's RX SQ (pods do not
    /// say when they make room: the caller retries soon).
    pub fn holding(&self) -> bool {
        !self.held.is_empty() || !self.completions.is_empty()
    }

    /// The next descriptor for the proxy: a pod's request or response (its header in
    /// a DPU pool), or a notice that a delivery failed.
    pub fn next_for_proxy(&mut self) -> Option<Descriptor> {
        self.to_proxy.pop_front()
    }

    /// The proxy's decision about a descriptor: a delivery to a pod, or a completion
    /// (buffers the proxy is done with).
    pub fn from_proxy(&mut self, d: Descriptor) {
        self.handle_from_arm(d);
    }

    fn remove_pod(&mut self, id: u32, done: crossbeam_channel::Sender<()>) {
        // What the pod published before it went still goes out (a pod may send and
        // exit at once); then it is polled no more.
        self.pull_mirror(id);
        while let Some(pod) = self.pods.get_mut(&id) {
            match pod.tx_sq.try_pop() {
                Ok(Some(d)) => {
                    self.stats.intake.fetch_add(1, Ordering::Relaxed);
                    self.intake(id, d);
                }
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(pod = id, error = %e, "malformed descriptor on a departing pod's TX SQ");
                    self.stats.errors.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        self.order.retain(|&p| p != id);
        // Deliveries held for it will never land: give their buffers back.
        self.stalls.watch.remove(&id);
        self.stalls.stalled.remove(&id);
        if let Some(held) = self.held.remove(&id) {
            for d in held {
                self.stats.held.fetch_sub(1, Ordering::Relaxed);
                self.fail_delivery(
                    &d,
                    Refusal::new(DescriptorStatus::PodGone, format!("pod {id} went away")),
                );
            }
        }
        self.leaving.push(Leaving {
            id,
            since: std::time::Instant::now(),
            done,
        });
        self.drop_departed();
    }

    /// Drops departed pods' ports once no body they sent is still claimed (or the
    /// grace period is over).
    fn drop_departed(&mut self) {
        let pods = &mut self.pods;
        let mut dropped = Vec::new();
        self.leaving.retain(|l| {
            let busy = pods
                .get(&l.id)
                .is_some_and(|p| p.tx_body.held_by(OwnerId::DMA) > 0);
            if busy && l.since.elapsed() < LEAVE_GRACE {
                return true;
            }
            dropped.extend(pods.remove(&l.id));
            let _ = l.done.send(());
            false
        });
        for port in dropped {
            self.forget(port);
        }
    }

    fn is_leaving(&self, id: u32) -> bool {
        self.leaving.iter().any(|l| l.id == id)
    }

    /// One pass over the shard's pods: commands, held work, and up to a budget of
    /// descriptors from each pod's TX SQ; returns how much work was done.
    pub fn pass(&mut self) -> usize {
        if !self.commands() {
            return 0;
        }
        if !self.leaving.is_empty() {
            self.drop_departed();
        }
        // One clock read per pass (vDSO, no system call): the watch itself runs every
        // `WATCH_EVERY`.
        let now = Instant::now();
        if now >= self.stalls.next {
            self.stalls.next = now + WATCH_EVERY;
            self.watch_rings(now);
        }
        let mut work = self.retry_held();
        for i in 0..self.order.len() {
            let id = self.order[i];
            self.pull_mirror(id);
            for _ in 0..BUDGET {
                // Back-pressure: leave descriptors in the pod's ring while the proxy
                // has not taken what came before.
                if self.to_proxy.len() >= MAX_HELD {
                    break;
                }
                let Some(pod) = self.pods.get_mut(&id) else {
                    break;
                };
                match pod.tx_sq.try_pop() {
                    Ok(Some(d)) => {
                        work += 1;
                        self.stats.intake.fetch_add(1, Ordering::Relaxed);
                        self.intake(id, d);
                    }
                    Ok(None) => break,
                    Err(e) => {
                        work += 1;
                        tracing::warn!(pod = id, error = %e, "malformed descriptor on a host TX SQ");
                        self.stats.errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }
        work
    }

    pub(super) fn count_copy(&self, bytes: u64) {
        self.stats.copies.fetch_add(1, Ordering::Relaxed);
        self.stats.bytes.fetch_add(bytes, Ordering::Relaxed);
    }
}

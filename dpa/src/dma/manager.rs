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
use crate::descriptor::{Buffer, Descriptor, DescriptorStatus, Destination, Kind};
use crate::pool::{BufferPool, OwnerId, PoolError, SlotRef};
use crate::ring::{Consumer, Producer, RingError};

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
    /// Each pod's RX ring read position when last seen to move.
    watch: HashMap<u32, Watch>,
    /// Pods not reading their ring: deliveries to them are refused.
    stalled: HashSet<u32>,
    next_watch: Instant,
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
            watch: HashMap::new(),
            stalled: HashSet::new(),
            next_watch: Instant::now(),
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
            let w = self.watch.entry(id).or_insert(Watch {
                consumed,
                since: now,
            });
            if ring.depth() == 0 || consumed != w.consumed {
                *w = Watch {
                    consumed,
                    since: now,
                };
                if self.stalled.remove(&id) {
                    tracing::info!(pod = id, "the pod reads its RX ring again");
                }
            } else if now.saturating_duration_since(w.since) >= STALL_AFTER
                && self.stalled.insert(id)
            {
                tracing::warn!(
                    pod = id,
                    "the pod has not read its RX ring for {} ms: deliveries to it are refused until it does",
                    now.saturating_duration_since(w.since).as_millis()
                );
            }
        }
        let stalled: Vec<u32> = self.stalled.iter().copied().collect();
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
        if !self.stalled.contains(&id) {
            return false;
        }
        let moved = match (self.pods.get(&id), self.watch.get(&id)) {
            (Some(pod), Some(w)) => pod.rx_sq.ring().consumed() != w.consumed,
            _ => true,
        };
        if moved {
            self.stalled.remove(&id);
            self.watch.remove(&id);
            tracing::info!(pod = id, "the pod reads its RX ring again");
        }
        !moved
    }

    fn stall_refusal(&self, id: u32, now: Instant) -> Refusal {
        let since = self
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
            if let Some(pod) = self.pods.get(&id) {
                pod.rx_sq.wake();
            }
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
            Some((_, n)) if urgent && *n + 1 >= WAKE_BATCH => {
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
                Ok(Command::AddPod(port)) => {
                    self.order.push(port.id);
                    self.pods.insert(port.id, *port);
                }
                Ok(Command::RemovePod(id, done)) => self.remove_pod(id, done),
                Ok(Command::Stop) | Err(TryRecvError::Disconnected) => {
                    self.stopped = true;
                    self.pods.clear();
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
        self.watch.remove(&id);
        self.stalled.remove(&id);
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
        self.leaving.retain(|l| {
            let busy = pods
                .get(&l.id)
                .is_some_and(|p| p.tx_body.held_by(OwnerId::DMA) > 0);
            if busy && l.since.elapsed() < LEAVE_GRACE {
                return true;
            }
            pods.remove(&l.id);
            let _ = l.done.send(());
            false
        });
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
        if now >= self.next_watch {
            self.next_watch = now + WATCH_EVERY;
            self.watch_rings(now);
        }
        let mut work = self.retry_held();
        for i in 0..self.order.len() {
            let id = self.order[i];
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

    // === intake: host TX SQ → sidecar TX SQ ===

    fn intake(&mut self, pod_id: u32, d: Descriptor) {
        if d.kind.completion || d.kind.error {
            self.refuse_to_pod(
                pod_id,
                &d,
                Refusal::new(
                    DescriptorStatus::Malformed,
                    "pods do not send completions or errors",
                ),
            );
            return;
        }
        match self.claim_and_copy_header(pod_id, &d) {
            Ok(forward) => self.send_to_arm(forward),
            Err(refusal) => self.refuse_to_pod(pod_id, &d, refusal),
        }
    }

    /// Checks the pod owns what `d` names, copies the header into a DPU slot, hands
    /// the pod's header slot back, and claims the body slot. Returns what the ARM gets.
    fn claim_and_copy_header(
        &mut self,
        pod_id: u32,
        d: &Descriptor,
    ) -> Result<Descriptor, Refusal> {
        let owner = OwnerId(pod_id);
        let pod = self.pods.get(&pod_id).expect("polled pods exist");
        let header_slot = if d.header.is_none() {
            None
        } else {
            Some(pod.tx_header.slot_of(d.header)?)
        };
        let body_slot = if d.body.is_none() {
            None
        } else {
            Some(pod.tx_body.slot_of(d.body)?)
        };
        // Claim both (ownership check and hand-over in one step each).
        if let Some(s) = header_slot {
            pod.tx_header.transfer(s, owner, OwnerId::DMA)?;
        }
        if let Some(s) = body_slot
            && let Err(e) = pod.tx_body.transfer(s, owner, OwnerId::DMA)
        {
            if let Some(h) = header_slot {
                let _ = pod.tx_header.transfer(h, OwnerId::DMA, owner);
            }
            return Err(e.into());
        }
        let mut forward = *d;
        forward.src_pod = pod_id;
        if let Some(h) = header_slot {
            let copied = self.copy_header_to_dpu(pod_id, d.header);
            let pod = self.pods.get(&pod_id).expect("polled pods exist");
            // The pod's header slot goes back either way; the completion frees it.
            let _ = pod.tx_header.transfer(h, OwnerId::DMA, owner);
            let header = match copied {
                Ok(header) => header,
                Err(refusal) => {
                    if let Some(b) = body_slot {
                        let _ = pod.tx_body.transfer(b, OwnerId::DMA, owner);
                    }
                    return Err(refusal);
                }
            };
            self.complete_to_pod(pod_id, d, d.header, Buffer::NONE);
            forward.header = header;
        }
        Ok(forward)
    }

    fn copy_header_to_dpu(&mut self, pod_id: u32, header: Buffer) -> Result<Buffer, Refusal> {
        let pod = self.pods.get(&pod_id).expect("polled pods exist");
        if header.len > self.dpu_tx_header.layout().slot_size {
            return Err(Refusal::new(
                DescriptorStatus::BadBuffer,
                format!(
                    "header of {} bytes exceeds the DPU's {}-byte header slots",
                    header.len,
                    self.dpu_tx_header.layout().slot_size
                ),
            ));
        }
        let src_offset = pod.tx_header.offset_of(header)?;
        let dpu_slot = self.dpu_tx_header.alloc(OwnerId::DMA)?;
        // Cannot fail: the length was checked against the slot size above.
        let dst = self.dpu_tx_header.buffer(dpu_slot, header.len)?;
        let job = CopyJob {
            src: pod.tx_header.region(),
            src_offset,
            dst: self.dpu_tx_header.region(),
            dst_offset: self.dpu_tx_header.offset_of(dst)?,
            len: header.len as u64,
        };
        if let Err(e) = self.engine.copy(&[job]) {
            let _ = self.dpu_tx_header.release(dpu_slot, OwnerId::DMA);
            return Err(Refusal::new(DescriptorStatus::CopyFailed, e.to_string()));
        }
        self.count_copy(header.len as u64);
        self.dpu_tx_header
            .transfer(dpu_slot, OwnerId::DMA, OwnerId::PROXY)?;
        Ok(dst)
    }

    fn send_to_arm(&mut self, d: Descriptor) {
        self.to_proxy.push_back(d);
    }

    // === from the ARM: sidecar RX SQ → host RX SQ ===

    fn handle_from_arm(&mut self, d: Descriptor) {
        if d.kind.completion {
            self.arm_completion(&d);
            return;
        }
        let Destination::Pod(dst) = d.dst else {
            self.fail_delivery(
                &d,
                Refusal::new(DescriptorStatus::Malformed, "the ARM delivers to pods only"),
            );
            return;
        };
        if self.is_leaving(dst) {
            self.fail_delivery(
                &d,
                Refusal::new(DescriptorStatus::PodGone, format!("pod {dst} went away")),
            );
            return;
        }
        if !self.pods.contains_key(&dst) {
            self.fail_delivery(
                &d,
                Refusal::new(
                    DescriptorStatus::UnknownPod,
                    format!("pod {dst} is not registered on this node"),
                ),
            );
            return;
        }
        if !self.stalled.is_empty() && self.refuses(dst) {
            let refusal = self.stall_refusal(dst, Instant::now());
            self.fail_delivery(&d, refusal);
            return;
        }
        if self.held.get(&dst).is_some_and(|q| !q.is_empty()) {
            self.hold(dst, d);
            return;
        }
        self.deliver(dst, d);
    }

    fn hold(&mut self, dst: u32, d: Descriptor) {
        let queue = self.held.entry(dst).or_default();
        if queue.len() >= MAX_HELD {
            self.fail_delivery(
                &d,
                Refusal::new(
                    DescriptorStatus::RingFull,
                    format!("pod {dst}'s RX ring stays full"),
                ),
            );
            return;
        }
        self.stats.held.fetch_add(1, Ordering::Relaxed);
        queue.push_back(d);
    }

    /// Moves header and body into pod `dst` and writes its RX SQ; holds `d` if the
    /// ring is full (nothing moved yet), fails it on any other error.
    fn deliver(&mut self, dst: u32, d: Descriptor) {
        let pod = self.pods.get_mut(&dst).expect("checked by the caller");
        // Room for the delivery and for the completion a case 3 copy may send to the
        // source pod, which can be this pod (a service calling itself); completions
        // waiting for this pod go first.
        if pod.rx_sq.free() < 2 || self.completions.get(&dst).is_some_and(|q| !q.is_empty()) {
            self.hold(dst, d);
            return;
        }
        match self.move_into_pod(dst, &d) {
            Ok(delivered) => {
                match self.publish_to_pod(dst, &delivered) {
                    Ok(()) => {
                        self.stats.delivered.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => {
                        // Only a ring whose consumer corrupted it refuses here: the pod
                        // does not get this, and its slots go back.
                        tracing::warn!(pod = dst, error = %e, "host RX SQ refused a delivery it had room for");
                        let pod = self.pods.get(&dst).expect("checked by the caller");
                        let owner = OwnerId(dst);
                        for (pool, b) in [
                            (&pod.rx_header, delivered.header),
                            (&pod.rx_body, delivered.body),
                        ] {
                            if let Ok(slot) = pool.slot_of(b) {
                                let _ = pool.release(slot, owner);
                            }
                        }
                        self.report_to_arm(&d, DescriptorStatus::RingFull);
                    }
                }
            }
            Err(refusal) => self.fail_delivery(&d, refusal),
        }
    }

    fn move_into_pod(&mut self, dst: u32, d: &Descriptor) -> Result<Descriptor, Refusal> {
        let owner = OwnerId(dst);
        let mut out = *d;
        // The header: from a DPU pool (owned by the ARM) into the pod's RX pool. The
        // DPU slot is freed only once the whole delivery has succeeded, so a failure
        // leaves it with the ARM for `fail_delivery` to free exactly once.
        let mut dpu_header = None;
        if !d.header.is_none() {
            let (src_is_tx, src_slot) = self.dpu_header_slot(d.header)?;
            let pod = self.pods.get(&dst).expect("checked");
            let slot = pod.rx_header.alloc(owner)?;
            let buffer = pod.rx_header.buffer(slot, d.header.len).inspect_err(|_| {
                let _ = pod.rx_header.release(slot, owner);
            })?;
            let src = if src_is_tx {
                &self.dpu_tx_header
            } else {
                &self.dpu_rx_header
            };
            let job = CopyJob {
                src: src.region(),
                src_offset: src.offset_of(d.header)?,
                dst: pod.rx_header.region(),
                dst_offset: pod.rx_header.offset_of(buffer)?,
                len: d.header.len as u64,
            };
            if let Err(e) = self.engine.copy(&[job]) {
                let _ = pod.rx_header.release(slot, owner);
                return Err(Refusal::new(DescriptorStatus::CopyFailed, e.to_string()));
            }
            self.count_copy(d.header.len as u64);
            dpu_header = Some((src_is_tx, src_slot));
            out.header = buffer;
        }
        if !d.body.is_none() {
            out.body = match self.move_body(dst, d) {
                Ok(body) => body,
                Err(refusal) => {
                    // Undo the header move: the pod never sees this descriptor.
                    if !out.header.is_none() {
                        let pod = self.pods.get(&dst).expect("checked");
                        if let Ok(s) = pod.rx_header.slot_of(out.header) {
                            let _ = pod.rx_header.release(s, owner);
                        }
                    }
                    return Err(refusal);
                }
            };
        }
        if let Some((is_tx, slot)) = dpu_header {
            let pool = if is_tx {
                &self.dpu_tx_header
            } else {
                &self.dpu_rx_header
            };
            let _ = pool.release(slot, OwnerId::PROXY);
        }
        Ok(out)
    }

    fn dpu_header_slot(&self, header: Buffer) -> Result<(bool, SlotRef), Refusal> {
        let (is_tx, pool) = if header.addr.region() == self.dpu_tx_header.id() {
            (true, &self.dpu_tx_header)
        } else if header.addr.region() == self.dpu_rx_header.id() {
            (false, &self.dpu_rx_header)
        } else {
            return Err(Refusal::new(
                DescriptorStatus::BadBuffer,
                format!("header {} is not in a DPU header pool", header.addr),
            ));
        };
        let slot = pool.slot_of(header)?;
        match pool.state(slot.index) {
            Some((_, OwnerId::PROXY)) => Ok((is_tx, slot)),
            other => Err(Refusal::new(
                DescriptorStatus::BadBuffer,
                format!(
                    "header {} is not held by the proxy ({other:?})",
                    header.addr
                ),
            )),
        }
    }

    /// Case 2: the body is in `dst`'s RX body pool already (the fabric put it there);
    /// case 3: it is in the source pod's TX body pool and is copied across.
    fn move_body(&mut self, dst: u32, d: &Descriptor) -> Result<Buffer, Refusal> {
        let owner = OwnerId(dst);
        let region = d.body.addr.region();
        let pod = self.pods.get(&dst).expect("checked");
        if region == pod.rx_body.id() {
            let slot = pod.rx_body.slot_of(d.body)?;
            match pod.rx_body.state(slot.index) {
                Some((_, holder)) if holder == OwnerId::PROXY || holder == OwnerId::FABRIC => {
                    pod.rx_body.transfer(slot, holder, owner)?;
                    return Ok(d.body);
                }
                other => {
                    return Err(Refusal::new(
                        DescriptorStatus::BadBuffer,
                        format!(
                            "body {} in pod {dst}'s RX pool is not held by the proxy ({other:?})",
                            d.body.addr
                        ),
                    ));
                }
            }
        }
        let src_id = d.src_pod;
        let Some(src) = self.pods.get(&src_id).filter(|p| p.tx_body.id() == region) else {
            return Err(Refusal::new(
                DescriptorStatus::BadBuffer,
                format!(
                    "body {} is neither in pod {dst}'s RX pool nor in source pod {src_id}'s TX pool",
                    d.body.addr
                ),
            ));
        };
        let src_slot = src.tx_body.slot_of(d.body)?;
        if src.tx_body.state(src_slot.index).map(|s| s.1) != Some(OwnerId::DMA) {
            return Err(Refusal::new(
                DescriptorStatus::BadBuffer,
                format!(
                    "body {} of pod {src_id} was not handed to the DMA manager",
                    d.body.addr
                ),
            ));
        }
        let pod = self.pods.get(&dst).expect("checked");
        let slot = pod.rx_body.alloc(owner)?;
        let buffer = match pod.rx_body.buffer(slot, d.body.len) {
            Ok(b) => b,
            Err(e) => {
                let _ = pod.rx_body.release(slot, owner);
                return Err(e.into());
            }
        };
        // Pod A → pod B, directly.
        let job = CopyJob {
            src: src.tx_body.region(),
            src_offset: src.tx_body.offset_of(d.body)?,
            dst: pod.rx_body.region(),
            dst_offset: pod.rx_body.offset_of(buffer)?,
            len: d.body.len as u64,
        };
        if let Err(e) = self.engine.copy(&[job]) {
            let _ = pod.rx_body.release(slot, owner);
            return Err(Refusal::new(DescriptorStatus::CopyFailed, e.to_string()));
        }
        self.count_copy(d.body.len as u64);
        self.return_body(src_id, d);
        Ok(buffer)
    }

    /// A body the manager claimed at intake goes back to its pod with a completion.
    fn return_body(&mut self, src_id: u32, d: &Descriptor) {
        let Some(src) = self.pods.get(&src_id) else {
            return;
        };
        let Ok(slot) = src.tx_body.slot_of(d.body) else {
            return;
        };
        if src
            .tx_body
            .transfer(slot, OwnerId::DMA, OwnerId(src_id))
            .is_ok()
        {
            self.complete_to_pod(src_id, d, Buffer::NONE, d.body);
        }
    }

    /// The ARM is done with what `d` names (a body it sent over the fabric, a header
    /// it consumed): buffers go back to their owners.
    fn arm_completion(&mut self, d: &Descriptor) {
        if !d.header.is_none()
            && let Ok((is_tx, slot)) = self.dpu_header_slot(d.header)
        {
            let pool = if is_tx {
                &self.dpu_tx_header
            } else {
                &self.dpu_rx_header
            };
            let _ = pool.release(slot, OwnerId::PROXY);
        }
        if !d.body.is_none() {
            let src = d.src_pod;
            if self
                .pods
                .get(&src)
                .is_some_and(|p| p.tx_body.id() == d.body.addr.region())
            {
                if d.kind.error {
                    // Tell the pod its request failed before its body left.
                    self.return_body_with_error(src, d);
                } else {
                    self.return_body(src, d);
                }
            }
        }
    }

    fn return_body_with_error(&mut self, src_id: u32, d: &Descriptor) {
        let Some(src) = self.pods.get(&src_id) else {
            return;
        };
        let Ok(slot) = src.tx_body.slot_of(d.body) else {
            return;
        };
        // Only a body this manager held goes back with a notice; anything else would
        // name a slot the pod may have reused.
        if src
            .tx_body
            .transfer(slot, OwnerId::DMA, OwnerId(src_id))
            .is_err()
        {
            return;
        }
        let status = d.error_status().unwrap_or(DescriptorStatus::CopyFailed);
        let mut e = *d;
        e.header = Buffer::NONE;
        e.kind = Kind {
            completion: true,
            error: true,
            response: false,
        };
        e.status = status as u16;
        e.dst = Destination::Pod(src_id);
        self.push_to_pod(src_id, e);
    }

    // === completions and errors ===

    fn complete_to_pod(&mut self, pod_id: u32, d: &Descriptor, header: Buffer, body: Buffer) {
        let mut c = *d;
        c.kind = Kind {
            completion: true,
            ..Kind::default()
        };
        c.header = header;
        c.body = body;
        c.status = 0;
        c.dst = Destination::Pod(pod_id);
        self.stats.completions.fetch_add(1, Ordering::Relaxed);
        self.push_to_pod(pod_id, c);
    }

    fn refuse_to_pod(&mut self, pod_id: u32, d: &Descriptor, refusal: Refusal) {
        tracing::debug!(pod = pod_id, req = d.req_id, step = d.step_id, status = ?refusal.status, detail = %refusal.detail, "refused a host descriptor");
        let mut e = *d;
        // The error hands the named buffers back: the pod still owns them.
        e.kind = Kind {
            completion: true,
            error: true,
            response: false,
        };
        e.status = refusal.status as u16;
        e.dst = Destination::Pod(pod_id);
        self.stats.errors.fetch_add(1, Ordering::Relaxed);
        self.push_to_pod(pod_id, e);
    }

    /// Completions and errors are never dropped while the pod lives: they hand slots
    /// back. A full RX SQ queues them (in order, ahead of deliveries to that pod); the
    /// queue is bounded by the pod's slots, since each TX slot has one completion.
    fn push_to_pod(&mut self, pod_id: u32, d: Descriptor) {
        if !self.pods.contains_key(&pod_id) {
            return;
        }
        let queued = self.completions.get(&pod_id).is_some_and(|q| !q.is_empty());
        if queued || self.publish_to_pod(pod_id, &d).is_err() {
            let queue = self.completions.entry(pod_id).or_default();
            if queue.len() >= MAX_QUEUED_COMPLETIONS {
                tracing::warn!(pod = pod_id, "pod reads no completions; one was dropped");
                self.stats.errors.fetch_add(1, Ordering::Relaxed);
                return;
            }
            queue.push_back(d);
        }
    }

    /// Tells the ARM that `d` could not be delivered (nothing left to release).
    fn report_to_arm(&mut self, d: &Descriptor, status: DescriptorStatus) {
        let mut e = *d;
        e.header = Buffer::NONE;
        e.body = Buffer::NONE;
        e.kind = Kind {
            completion: true,
            error: true,
            response: d.kind.response,
        };
        e.status = status as u16;
        self.stats.errors.fetch_add(1, Ordering::Relaxed);
        self.send_to_arm(e);
    }

    /// A delivery failed: the buffers go back, and the ARM hears why (it answers the
    /// caller: ingress or the pod that asked).
    fn fail_delivery(&mut self, d: &Descriptor, refusal: Refusal) {
        tracing::debug!(req = d.req_id, step = d.step_id, status = ?refusal.status, detail = %refusal.detail, "delivery failed");
        self.stats.errors.fetch_add(1, Ordering::Relaxed);
        if !d.header.is_none()
            && let Ok((is_tx, slot)) = self.dpu_header_slot(d.header)
        {
            let pool = if is_tx {
                &self.dpu_tx_header
            } else {
                &self.dpu_rx_header
            };
            let _ = pool.release(slot, OwnerId::PROXY);
        }
        if !d.body.is_none() {
            let src = d.src_pod;
            if self
                .pods
                .get(&src)
                .is_some_and(|p| p.tx_body.id() == d.body.addr.region())
            {
                self.return_body(src, d);
            } else if let Destination::Pod(dst) = d.dst
                && let Some(pod) = self.pods.get(&dst)
                && let Ok(slot) = pod.rx_body.slot_of(d.body)
            {
                let _ = pod.rx_body.release(slot, OwnerId::PROXY);
                let _ = pod.rx_body.release(slot, OwnerId::FABRIC);
            }
        }
        // Behind anything already held for the ARM, so notices keep their order.
        self.stats.errors.fetch_sub(1, Ordering::Relaxed);
        self.report_to_arm(d, refusal.status);
    }

    fn retry_held(&mut self) -> usize {
        let mut work = 0;
        // Completions first: they free the slots pods may be waiting for.
        let queued: Vec<u32> = self.completions.keys().copied().collect();
        for pod_id in queued {
            if !self.pods.contains_key(&pod_id) {
                self.completions.remove(&pod_id);
                continue;
            }
            let mut queue = self.completions.remove(&pod_id).expect("listed above");
            while let Some(d) = queue.front() {
                if self.publish_to_pod(pod_id, d).is_err() {
                    break;
                }
                queue.pop_front();
                work += 1;
            }
            if !queue.is_empty() {
                self.completions.insert(pod_id, queue);
            }
        }
        let pods: Vec<u32> = self.held.keys().copied().collect();
        for dst in pods {
            while let Some(room) = self.pods.get_mut(&dst).map(|p| p.rx_sq.free()) {
                // A delivery needs room for itself and a completion (see `deliver`):
                // with less, it would go straight back to the end of the queue, out
                // of order, and this loop would spin until the pod read its ring.
                if room < 2 || self.completions.contains_key(&dst) {
                    break;
                }
                let Some(d) = self.held.get_mut(&dst).and_then(VecDeque::pop_front) else {
                    break;
                };
                self.stats.held.fetch_sub(1, Ordering::Relaxed);
                work += 1;
                self.deliver(dst, d);
            }
            if self.held.get(&dst).is_some_and(VecDeque::is_empty) {
                self.held.remove(&dst);
            }
        }
        work
    }

    fn count_copy(&self, bytes: u64) {
        self.stats.copies.fetch_add(1, Ordering::Relaxed);
        self.stats.bytes.fetch_add(bytes, Ordering::Relaxed);
    }
}

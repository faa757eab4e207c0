//! The façade a proxy shard drives: its DMA manager's pass, descriptors to and from
//! the pods of its lane, DPU header slots and pods' body slots.

use std::sync::Arc;
use std::time::Duration;

use crate::bell::Bell;
use crate::descriptor::{Buffer, Descriptor};
use crate::dma::DmaEngine;
use crate::dma::manager::DmaManager;
use crate::pool::{BufferPool, OwnerId, PoolError};
use crate::ring::RingError;

use super::registry::{PodInfo, Shared};

/// The DMA work of one proxy shard: the pods the node gave it (their rings and pools),
/// run inline on the shard's thread — descriptors from pods come in, decisions go out,
/// and no other thread is involved. Sleep on [`DpuShard::bell`]: pods ring it after
/// they publish.
pub struct DpuShard {
    pub(super) index: usize,
    pub(super) dma: DmaManager<Box<dyn DmaEngine>>,
    pub(super) bell: Bell,
    pub(super) dpu_tx_header: BufferPool,
    pub(super) dpu_rx_header: BufferPool,
    pub(super) shared: Option<Arc<Shared>>,
}

impl std::fmt::Debug for DpuShard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DpuShard")
            .field("index", &self.index)
            .finish_non_exhaustive()
    }
}

impl DpuShard {
    fn shared(&self) -> &Shared {
        self.shared.as_ref().expect("set when the node starts")
    }

    /// The shard's number on its node.
    pub fn index(&self) -> usize {
        self.index
    }

    /// The bell pods ring after publishing (and the node, when pods come and go).
    pub fn bell(&self) -> &Bell {
        &self.bell
    }

    /// One pass of DMA work: pods added or removed, descriptors from the pods' TX
    /// SQs (their heads copied into this shard's DPU pool), held deliveries retried.
    /// Returns how much was done.
    pub fn pass(&mut self) -> usize {
        self.dma.pass()
    }

    /// Wakes the pods given descriptors since their last wake-up: call it at the end
    /// of each batch of work and before sleeping (one wake-up per pod per batch).
    pub fn wake_pods(&mut self) {
        self.dma.wake_pods();
    }

    /// Whether a pass or [`DpuShard::try_recv`] would find something.
    pub fn has_work(&self) -> bool {
        self.dma.has_work()
    }

    /// Whether deliveries wait for room in a pod's ring (retry soon: pods do not say
    /// when they make room).
    pub fn holding(&self) -> bool {
        self.dma.holding()
    }

    /// Whether a descriptor is waiting for the proxy.
    pub fn has_next(&self) -> bool {
        self.dma.has_work()
    }

    /// The next descriptor for the proxy: a pod's request or response (its header in
    /// a DPU pool), or a notice that a delivery failed. Runs a pass when none is
    /// waiting.
    pub fn try_recv(&mut self) -> Result<Option<Descriptor>, RingError> {
        if let Some(d) = self.dma.next_for_proxy() {
            return Ok(Some(d));
        }
        self.dma.pass();
        Ok(self.dma.next_for_proxy())
    }

    /// Waits up to `timeout` (on the bell) for the next descriptor, doing the DMA
    /// work meanwhile: for a thread that serves only this shard (tests, tools).
    pub fn recv(&mut self, timeout: Duration) -> Result<Option<Descriptor>, RingError> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if let Some(d) = self.try_recv()? {
                return Ok(Some(d));
            }
            self.dma.wake_pods();
            let Some(left) = deadline.checked_duration_since(std::time::Instant::now()) else {
                return Ok(None);
            };
            // Held deliveries are retried soon: pods do not ring when they make room.
            let left = if self.holding() {
                left.min(Duration::from_micros(200))
            } else {
                left
            };
            let dma = &self.dma;
            self.bell.wait(Some(left), || dma.has_work());
        }
    }

    /// The header bytes a descriptor names (in a DPU header pool).
    pub fn header(&self, d: &Descriptor) -> Result<Vec<u8>, PoolError> {
        self.dpu_pool(d.header)?.read(d.header)
    }

    fn dpu_pool(&self, b: Buffer) -> Result<&BufferPool, PoolError> {
        if b.addr.region() == self.dpu_tx_header.id() {
            Ok(&self.dpu_tx_header)
        } else {
            Ok(&self.dpu_rx_header)
        }
    }

    /// Writes a new header (a reply, or a head that arrived over the fabric) into the
    /// shard's RX header pool, held by the proxy until it is delivered or released.
    pub fn alloc_header(&self, bytes: &[u8]) -> Result<Buffer, PoolError> {
        let pool = &self.dpu_rx_header;
        let slot = pool.alloc(OwnerId::PROXY)?;
        pool.write(slot, bytes).inspect_err(|_| {
            let _ = pool.release(slot, OwnerId::PROXY);
        })
    }

    /// Frees a header the proxy holds (one it will not forward).
    pub fn release_header(&self, header: Buffer) -> Result<(), PoolError> {
        let pool = self.dpu_pool(header)?;
        let slot = pool.slot_of(header)?;
        pool.release(slot, OwnerId::PROXY)
    }

    /// Hands a decision to the DMA work: a delivery to a pod (done at once, or held
    /// while its ring is full), or a completion.
    pub fn forward(&mut self, d: &Descriptor) -> Result<(), RingError> {
        self.dma.from_proxy(*d);
        Ok(())
    }

    /// A registered pod by id.
    pub fn pod(&self, id: u32) -> Option<PodInfo> {
        self.shared().pods.lock().get(&id).cloned()
    }

    /// Copies a window of a streamed answer (`len` bytes at `at` in `slot`, a slot of
    /// pod `pod`'s RX body pool the fabric holds) into a fresh slot of that pool, held
    /// by the fabric until it is delivered: the window is free for the next part.
    pub fn copy_rx_window(
        &mut self,
        pod: u32,
        slot: Buffer,
        at: u64,
        len: u32,
    ) -> Result<Buffer, crate::dma::manager::WindowCopyError> {
        self.dma.copy_rx_window(pod, slot, at, len)
    }

    /// Copies `len` bytes at `from` of a TX body pod `pod` sent (claimed at intake)
    /// into its staging copy when it is across PCIe, before the fabric reads them
    /// (`dma::manager::Staging`); nothing for a pod this node maps.
    pub fn stage_tx(
        &mut self,
        pod: u32,
        body: Buffer,
        from: u32,
        len: u32,
    ) -> Result<(), crate::dma::manager::WindowCopyError> {
        self.dma.stage_tx(pod, body, from, len)
    }

    /// Copies a stream part pod `src` sent (in its TX body pool, claimed at
    /// intake) into a fresh slot of pod `dst`'s RX body pool, held by the fabric
    /// until it is delivered; the part is handed back to `src` apart, under its own
    /// ids.
    pub fn copy_tx_to_rx(
        &mut self,
        src: u32,
        part: Buffer,
        dst: u32,
    ) -> Result<Buffer, crate::dma::manager::WindowCopyError> {
        self.dma.copy_tx_to_rx(src, part, dst)
    }

    /// Copies the body of a stream part pod `pod` sent (in its TX pool, claimed at
    /// intake) to `at` within `buffer`, a slot of its RX pool the fabric holds (a
    /// streamed request's buffer, which a peer reads a window at a time).
    pub fn copy_into_window(
        &mut self,
        pod: u32,
        part: Buffer,
        buffer: Buffer,
        at: u64,
    ) -> Result<(), crate::dma::manager::WindowCopyError> {
        self.dma.copy_into_window(pod, part, buffer, at)
    }

    /// Reserves a body slot in pod `pod`'s RX body pool for a body that arrives from
    /// outside the node (the fabric writes it there; case 2). Held by the fabric until
    /// the delivery hands it to the pod.
    pub fn reserve_body(&self, pod: u32, len: u32) -> Result<Buffer, PoolError> {
        let info = self
            .pod(pod)
            .ok_or_else(|| PoolError::Layout(format!("pod {pod} is not registered")))?;
        if info.rx_body_memory().is_none() {
            // The fabric would write into the mirror, which holds no bytes: a pod
            // across PCIe has a staging copy for this (docs/data-path.md, layer 4).
            return Err(PoolError::Layout(format!(
                "pod {pod} is across PCIe and has no staging copy of its bodies on this side"
            )));
        }
        let slot = info.rx_body.alloc(OwnerId::FABRIC)?;
        info.rx_body.buffer(slot, len).inspect_err(|_| {
            let _ = info.rx_body.release(slot, OwnerId::FABRIC);
        })
    }
}

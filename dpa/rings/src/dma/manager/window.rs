//! Parts of a streamed answer to a pod's call, copied into slots of the caller's RX
//! body pool before they are delivered (host memory to host memory: the DMA engine's
//! work, as any copy between pods is). A copy is then delivered like any body the
//! fabric put in the pod's pool.
//!
//! - **From another node** (case 1): the peer RDMA-writes each part into a *window*
//!   of one reply slot of the caller's RX body pool, held by the fabric for the whole
//!   stream. The window must be free again for the peer's next part while the pod
//!   still reads this one, so the part is copied into a slot of its own.
//! - **From a pod of this node** (case 3): the part is in the callee's TX slot. It
//!   is copied here rather than on delivery because a delivery hands the source's
//!   slot back under the delivered descriptor's ids, and those are the caller's: the
//!   callee must get its slot back under its own stream's ids (its window of parts
//!   in flight counts them). The same holds for a pod's streamed request body going
//!   to a pod of its node.
//!
//! A pod's streamed request body going to another node goes the other way: each part
//! is copied from its TX slot into a window of one request buffer, which the peer
//! reads (`copy_into_window`). The buffer is a slot of the pod's RX body pool the
//! fabric holds: RX slots are this side's to allocate, while the pod allocates its TX
//! slots itself, and across PCIe a TX slot taken here would be free in the host's
//! words.
//!
//! For a pod across PCIe the fabric's side of its bodies is its [`Staging`]: what the
//! fabric reads is staged first (`stage_tx`, by the proxy before it hands a TX body
//! to the fabric), what the fabric or these copies wrote into the staging reaches the
//! host at delivery (`unstage_rx_body`). A part copied for a pod of this node is
//! read from the host; into a receiver across PCIe it goes through the staging, so a
//! streamed part between two pods across PCIe crosses twice (a mark of the slots
//! written straight to the host would save one, at the cost of clearing it on every
//! path a slot leaves by).

use super::*;

/// Why a window could not be copied out.
#[derive(Debug, thiserror::Error)]
pub enum WindowCopyError {
    /// The pod is not one of this manager's.
    #[error("pod {0} is not served by this shard")]
    UnknownPod(u32),
    /// The range does not lie within the slot.
    #[error("bytes {at}..{end} lie outside the {size}-byte slot", end = at + u64::from(*len))]
    OutOfSlot {
        /// Where the range starts in the slot.
        at: u64,
        /// Its length.
        len: u32,
        /// The slot's size.
        size: u32,
    },
    /// The slot is not the fabric's (the stream's reply slot is held by the fabric
    /// until the stream ends).
    #[error("slot {0} of the pod's RX body pool is not held by the fabric")]
    NotTheFabrics(u32),
    /// The callee's part is not in its TX pool, held by this manager.
    #[error("the part is not in pod {0}'s TX pool, handed to the DMA manager")]
    NotHandedOver(u32),
    /// No slot free, or a slot that does not name the pool.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// The copy failed.
    #[error(transparent)]
    Dma(#[from] super::super::DmaError),
}

impl<E: DmaEngine> DmaManager<E> {
    /// Copies `len` bytes at `at` within `slot` (a slot of pod `pod_id`'s RX body
    /// pool that the fabric holds) into a fresh slot of that pool, held by the fabric
    /// until the proxy delivers it (or releases it); the window may be written again
    /// once this returns.
    pub fn copy_rx_window(
        &mut self,
        pod_id: u32,
        slot: Buffer,
        at: u64,
        len: u32,
    ) -> Result<Buffer, WindowCopyError> {
        let pod = self
            .pods
            .get(&pod_id)
            .ok_or(WindowCopyError::UnknownPod(pod_id))?;
        let pool = &pod.rx_body;
        // Across PCIe the peer wrote the window into the staging copy, and the copy
        // stays there until it is delivered.
        let region = pod.staging.as_ref().map_or(pool.region(), |s| &s.rx);
        let size = pool.layout().slot_size;
        if at + u64::from(len) > u64::from(size) {
            return Err(WindowCopyError::OutOfSlot { at, len, size });
        }
        let from = pool.slot_of(Buffer::new(slot.addr, 0))?;
        if pool.state(from.index).map(|s| s.1) != Some(OwnerId::FABRIC) {
            return Err(WindowCopyError::NotTheFabrics(from.index));
        }
        let to = pool.alloc(OwnerId::FABRIC)?;
        let copied = (|| {
            let buffer = pool.buffer(to, len)?;
            let job = CopyJob {
                src: region,
                src_offset: pool.offset_of(Buffer::new(slot.addr, 0))? + at,
                dst: region,
                dst_offset: pool.offset_of(buffer)?,
                len: u64::from(len),
            };
            self.engine.copy(&[job])?;
            Ok::<_, WindowCopyError>(buffer)
        })();
        match copied {
            Ok(buffer) => {
                self.count_copy(u64::from(len));
                Ok(buffer)
            }
            Err(e) => {
                let _ = pool.release(to, OwnerId::FABRIC);
                Err(e)
            }
        }
    }

    /// Copies the body of `part` (a stream part pod `src` sent, its body in `src`'s
    /// TX pool and claimed at intake) into a fresh slot of pod `dst`'s RX body pool,
    /// held by the fabric until the proxy delivers it; the part itself is handed back
    /// to `src` separately, under its own ids.
    pub fn copy_tx_to_rx(
        &mut self,
        src: u32,
        part: Buffer,
        dst: u32,
    ) -> Result<Buffer, WindowCopyError> {
        let from = self
            .pods
            .get(&src)
            .ok_or(WindowCopyError::UnknownPod(src))?;
        let slot = from
            .tx_body
            .slot_of(part)
            .map_err(|_| WindowCopyError::NotHandedOver(src))?;
        if from.tx_body.state(slot.index).map(|s| s.1) != Some(OwnerId::DMA) {
            return Err(WindowCopyError::NotHandedOver(src));
        }
        let to = self
            .pods
            .get(&dst)
            .ok_or(WindowCopyError::UnknownPod(dst))?;
        let pool = &to.rx_body;
        // Into the receiver's staging copy across PCIe: its delivery takes it on to
        // the host, as any body the fabric put there.
        let into = to.staging.as_ref().map_or(pool.region(), |s| &s.rx);
        let fresh = pool.alloc(OwnerId::FABRIC)?;
        let copied = (|| {
            let buffer = pool.buffer(fresh, part.len)?;
            let job = CopyJob {
                src: from.tx_body.region(),
                src_offset: from.tx_body.offset_of(part)?,
                dst: into,
                dst_offset: pool.offset_of(buffer)?,
                len: u64::from(part.len),
            };
            self.engine.copy(&[job])?;
            Ok::<_, WindowCopyError>(buffer)
        })();
        match copied {
            Ok(buffer) => {
                self.count_copy(u64::from(part.len));
                Ok(buffer)
            }
            Err(e) => {
                let _ = pool.release(fresh, OwnerId::FABRIC);
                Err(e)
            }
        }
    }

    /// Copies the body of `part` (a stream part pod `pod` sent, in its TX pool and
    /// claimed at intake) to `at` within `buffer`, a slot of its RX pool the fabric
    /// holds (a streamed request's buffer, read by a peer a window at a time).
    pub fn copy_into_window(
        &mut self,
        pod: u32,
        part: Buffer,
        buffer: Buffer,
        at: u64,
    ) -> Result<(), WindowCopyError> {
        let port = self
            .pods
            .get(&pod)
            .ok_or(WindowCopyError::UnknownPod(pod))?;
        let pool = &port.tx_body;
        let into = &port.rx_body;
        let size = into.layout().slot_size;
        if at + u64::from(part.len) > u64::from(size) {
            return Err(WindowCopyError::OutOfSlot {
                at,
                len: part.len,
                size,
            });
        }
        let from = pool
            .slot_of(part)
            .map_err(|_| WindowCopyError::NotHandedOver(pod))?;
        if pool.state(from.index).map(|s| s.1) != Some(OwnerId::DMA) {
            return Err(WindowCopyError::NotHandedOver(pod));
        }
        let to = into.slot_of(Buffer::new(buffer.addr, 0))?;
        if into.state(to.index).map(|s| s.1) != Some(OwnerId::FABRIC) {
            return Err(WindowCopyError::NotTheFabrics(to.index));
        }
        // Across PCIe the peer reads the buffer from the staging copy; the part is
        // read from the host.
        let to_region = port.staging.as_ref().map_or(into.region(), |s| &s.rx);
        let job = CopyJob {
            src: pool.region(),
            src_offset: pool.offset_of(part)?,
            dst: to_region,
            dst_offset: into.offset_of(Buffer::new(buffer.addr, 0))? + at,
            len: u64::from(part.len),
        };
        self.engine.copy(&[job])?;
        self.count_copy(u64::from(part.len));
        Ok(())
    }

    /// Copies `len` bytes at `from` of a TX body pod `pod_id` sent (claimed at intake,
    /// held by this manager) from the host into its staging copy, where the fabric
    /// reads them: called before the fabric is given them (case 1), and only then, so
    /// a body that stays on the host (case 3) crosses PCIe once. Nothing for a pod
    /// this side maps.
    pub fn stage_tx(
        &mut self,
        pod_id: u32,
        body: Buffer,
        from: u32,
        len: u32,
    ) -> Result<(), WindowCopyError> {
        let pod = self
            .pods
            .get(&pod_id)
            .ok_or(WindowCopyError::UnknownPod(pod_id))?;
        let Some(staging) = &pod.staging else {
            return Ok(());
        };
        let size = body.len;
        if u64::from(from) + u64::from(len) > u64::from(size) {
            return Err(WindowCopyError::OutOfSlot {
                at: u64::from(from),
                len,
                size,
            });
        }
        let slot = pod.tx_body.slot_of(body)?;
        if pod.tx_body.state(slot.index).map(|s| s.1) != Some(OwnerId::DMA) {
            return Err(WindowCopyError::NotHandedOver(pod_id));
        }
        let offset = pod.tx_body.offset_of(body)? + u64::from(from);
        let job = CopyJob {
            src: pod.tx_body.region(),
            src_offset: offset,
            dst: &staging.tx,
            dst_offset: offset,
            len: u64::from(len),
        };
        self.engine.copy(&[job])?;
        self.count_copy(u64::from(len));
        Ok(())
    }

    /// Copies an RX body the fabric (or the proxy) put into pod `pod_id`'s staging
    /// copy on to the host, before it is delivered; nothing for a pod this side maps.
    pub(super) fn unstage_rx_body(&mut self, pod_id: u32, body: Buffer) -> Result<(), Refusal> {
        let Some(pod) = self.pods.get(&pod_id) else {
            return Ok(());
        };
        let Some(staging) = &pod.staging else {
            return Ok(());
        };
        let offset = pod.rx_body.offset_of(body)?;
        let job = CopyJob {
            src: &staging.rx,
            src_offset: offset,
            dst: pod.rx_body.region(),
            dst_offset: offset,
            len: u64::from(body.len),
        };
        self.engine
            .copy(&[job])
            .map_err(|e| Refusal::new(DescriptorStatus::CopyFailed, e.to_string()))?;
        self.count_copy(u64::from(body.len));
        Ok(())
    }
}

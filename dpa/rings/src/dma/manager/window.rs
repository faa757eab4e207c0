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
//! is copied from its TX slot into a window of one request buffer (a slot of the
//! same pool the fabric holds), which the peer reads (`copy_into_tx_window`).

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
                src: pool.region(),
                src_offset: pool.offset_of(Buffer::new(slot.addr, 0))? + at,
                dst: pool.region(),
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
        let fresh = pool.alloc(OwnerId::FABRIC)?;
        let copied = (|| {
            let buffer = pool.buffer(fresh, part.len)?;
            let job = CopyJob {
                src: from.tx_body.region(),
                src_offset: from.tx_body.offset_of(part)?,
                dst: pool.region(),
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
    /// claimed at intake) to `at` within `buffer`, a slot of the same pool the fabric
    /// holds (a streamed request's buffer, read by a peer a window at a time).
    pub fn copy_into_tx_window(
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
        let size = pool.layout().slot_size;
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
        let to = pool.slot_of(Buffer::new(buffer.addr, 0))?;
        if pool.state(to.index).map(|s| s.1) != Some(OwnerId::FABRIC) {
            return Err(WindowCopyError::NotTheFabrics(to.index));
        }
        let job = CopyJob {
            src: pool.region(),
            src_offset: pool.offset_of(part)?,
            dst: pool.region(),
            dst_offset: pool.offset_of(Buffer::new(buffer.addr, 0))? + at,
            len: u64::from(part.len),
        };
        self.engine.copy(&[job])?;
        self.count_copy(u64::from(part.len));
        Ok(())
    }
}

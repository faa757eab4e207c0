//! One segment's transfer, chunk by chunk through the staging slots.
//!
//! PUSH: the progress loop DMAs chunk *i+1* (and more, up to the window) from the
//! host buffer into staging while this thread checksums chunk *i* and writes it to
//! storage. PULL: this thread reads chunk *i+1* from storage into staging while the
//! progress loop DMAs chunk *i* back into the host buffer (the seed's pipelined
//! reader/DMA worker). With `pipelined: false` the window is one chunk: each waits
//! for the one before.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use crossbeam_channel::{Receiver, Sender};
use dpumesh_dpa::SharedRegion;

use super::progress::DmaJob;
use super::{Inner, PeerState, PutError};
use crate::backend::{ObjectMeta, ObjectWriter, StorageError};
use crate::protocol::{Segment, SegmentResult, Status, check_key};

/// Chunks in flight for one transfer, and the slots they hold. Dropping it waits for
/// the DMA of every chunk still in flight before giving its slot back (the engine may
/// still be writing it).
struct Window<'a> {
    inner: &'a Inner,
    done_tx: Sender<Result<(), String>>,
    done_rx: Receiver<Result<(), String>>,
    flight: VecDeque<(u32, usize)>,
}

impl<'a> Window<'a> {
    fn new(inner: &'a Inner) -> Self {
        let (done_tx, done_rx) = crossbeam_channel::unbounded();
        Self {
            inner,
            done_tx,
            done_rx,
            flight: VecDeque::new(),
        }
    }

    /// A slot for the next chunk: waits only when none is in flight (else tries).
    fn slot(&self, peer: &PeerState) -> Option<u32> {
        if self.flight.is_empty() {
            self.inner.slots.acquire(&peer.cancelled)
        } else {
            self.inner.slots.try_acquire()
        }
    }

    /// The next chunk of a `total`-byte transfer to start, as (slot, offset, length):
    /// while fewer than the window are in flight and chunks remain, and a slot is had.
    fn next_chunk(
        &self,
        peer: &PeerState,
        next: &mut u64,
        total: u64,
    ) -> Option<(u32, u64, usize)> {
        let size = self.inner.slots.size as u64;
        let at = *next * size;
        if self.flight.len() >= self.inner.window || at >= total {
            return None;
        }
        let slot = self.slot(peer)?;
        *next += 1;
        Some((slot, at, (total - at).min(size) as usize))
    }

    fn post(
        &mut self,
        slot: u32,
        len: usize,
        src: (&Arc<SharedRegion>, u64),
        dst: (&Arc<SharedRegion>, u64),
    ) {
        self.inner.progress.post(DmaJob {
            src: src.0.clone(),
            src_offset: src.1,
            dst: dst.0.clone(),
            dst_offset: dst.1,
            len: len as u64,
            done: self.done_tx.clone(),
        });
        self.flight.push_back((slot, len));
    }

    /// Waits for the oldest chunk's DMA; hands back its slot and length (the slot
    /// stays held: the caller releases it).
    fn await_oldest_copy(&mut self) -> Option<Result<(u32, usize), String>> {
        let (slot, len) = self.flight.pop_front()?;
        let result = self
            .done_rx
            .recv()
            .unwrap_or_else(|_| Err("the DMA progress loop stopped".into()));
        Some(match result {
            Ok(()) => Ok((slot, len)),
            Err(e) => {
                self.inner.slots.release(slot);
                Err(e)
            }
        })
    }
}

impl Drop for Window<'_> {
    fn drop(&mut self) {
        while let Some((slot, _)) = self.flight.pop_front() {
            let _ = self.done_rx.recv();
            self.inner.slots.release(slot);
        }
    }
}

/// CRC-32 of a range of the staging buffer, read through a small bounce buffer (the
/// region's bytes are never borrowed as a slice: see `dpumesh_dpa::shm`).
fn checksum(region: &SharedRegion, offset: u64, len: usize, hasher: &mut crc32fast::Hasher) {
    thread_local! {
        static BOUNCE: std::cell::RefCell<Vec<u8>> = std::cell::RefCell::new(vec![0; 64 << 10]);
    }
    BOUNCE.with_borrow_mut(|buf| {
        let mut done = 0;
        while done < len {
            let n = (len - done).min(buf.len());
            if region.read(offset + done as u64, &mut buf[..n]).is_ok() {
                hasher.update(&buf[..n]);
            }
            done += n;
        }
    });
}

/// The buffer and range a segment names, checked.
fn buffer_range(peer: &PeerState, seg: &Segment) -> Result<Arc<SharedRegion>, SegmentResult> {
    check_key(&seg.key).map_err(|why| SegmentResult::failed(Status::BadKey, why))?;
    let region = peer
        .buffers
        .lock()
        .get(&seg.buffer)
        .cloned()
        .ok_or_else(|| {
            SegmentResult::failed(
                Status::BadBuffer,
                format!("buffer {} is not registered by this client", seg.buffer),
            )
        })?;
    let end = seg.offset.checked_add(seg.len);
    if end.is_none_or(|end| end > region.len() as u64) {
        return Err(SegmentResult::failed(
            Status::BadBuffer,
            format!(
                "range {}+{} is outside buffer {} of {} bytes",
                seg.offset,
                seg.len,
                seg.buffer,
                region.len()
            ),
        ));
    }
    Ok(region)
}

fn storage(e: &StorageError) -> SegmentResult {
    SegmentResult::failed(Status::Storage, e.to_string())
}

/// A transfer whose client went away. Counted here, before the caller's writer and
/// window drop: whoever sees the temporary gone and the slots back also sees the count.
pub(super) fn cancelled(inner: &Inner) -> SegmentResult {
    inner.stats.cancelled.fetch_add(1, Ordering::Relaxed);
    SegmentResult::failed(Status::Cancelled, "the client went away")
}

/// Host buffer → storage.
pub(super) fn push(inner: &Inner, peer: &PeerState, seg: &Segment) -> SegmentResult {
    let host = match buffer_range(peer, seg) {
        Ok(r) => r,
        Err(result) => return result,
    };
    if let Err(e) = inner.catalog.lock().check_size(seg.len) {
        return SegmentResult::failed(Status::TooLarge, e.to_string());
    }
    let mut writer = match inner.backend.create(&seg.key) {
        Ok(w) => w,
        Err(e) => return storage(&e),
    };
    let mut hasher = crc32fast::Hasher::new();
    let mut window = Window::new(inner);
    let mut next = 0u64;
    loop {
        while let Some((slot, at, len)) = window.next_chunk(peer, &mut next, seg.len) {
            window.post(
                slot,
                len,
                (&host, seg.offset + at),
                (&inner.staging, inner.slots.offset(slot)),
            );
        }
        if peer.cancelled.load(Ordering::Acquire) {
            // The writer's drop removes the temporary; the window's drop frees slots.
            return cancelled(inner);
        }
        let Some(landed) = window.await_oldest_copy() else {
            break;
        };
        let (slot, len) = match landed {
            Ok(landed) => landed,
            Err(e) => return SegmentResult::failed(Status::Dma, e),
        };
        let offset = inner.slots.offset(slot);
        checksum(&inner.staging, offset, len, &mut hasher);
        let written = writer.append(&inner.staging, offset, len);
        inner.slots.release(slot);
        if let Err(e) = written {
            return storage(&e);
        }
    }
    drop(window);
    let meta = ObjectMeta {
        key: seg.key.clone(),
        size: seg.len,
        crc32: hasher.finalize(),
    };
    commit(inner, writer, &meta)
}

/// Publishes a written object and records it (evicting what no longer fits).
fn commit(inner: &Inner, writer: Box<dyn ObjectWriter>, meta: &ObjectMeta) -> SegmentResult {
    // Under the catalog's lock, so that the order of commits is the catalog's order
    // (two pushes of one key: the last renamed is the one recorded).
    let mut catalog = inner.catalog.lock();
    if let Err(e) = writer.commit(meta) {
        return storage(&e);
    }
    let evicted = match catalog.admit(meta.clone()) {
        Ok(evicted) => evicted,
        Err(e) => return SegmentResult::failed(Status::TooLarge, e.to_string()),
    };
    inner.hot.remove(&meta.key);
    for key in &evicted {
        inner.hot.remove(key);
        if let Err(e) = inner.backend.remove(key) {
            tracing::warn!(key, error = %e, "an evicted object could not be removed");
        }
    }
    drop(catalog);
    inner
        .stats
        .evictions
        .fetch_add(evicted.len() as u64, Ordering::Relaxed);
    inner.stats.pushed.fetch_add(meta.size, Ordering::Relaxed);
    metrics::counter!("dpumesh_store_evictions_total").increment(evicted.len() as u64);
    metrics::counter!("dpumesh_store_bytes_total", "direction" => "push").increment(meta.size);
    SegmentResult::ok(meta.size, meta.crc32)
}

/// Bytes the node holds → storage (no DMA: they are in DPU memory already).
pub(super) fn put_local(inner: &Inner, key: &str, bytes: Vec<u8>) -> Result<ObjectMeta, PutError> {
    check_key(key).map_err(PutError::BadKey)?;
    inner.catalog.lock().check_size(bytes.len() as u64)?;
    let mut writer = inner.backend.create(key)?;
    writer.append_bytes(&bytes)?;
    let meta = ObjectMeta {
        key: key.to_owned(),
        size: bytes.len() as u64,
        crc32: crc32fast::hash(&bytes),
    };
    let result = commit(inner, writer, &meta);
    if result.status != Status::Ok {
        return Err(PutError::Refused {
            status: result.status,
            message: result.message,
        });
    }
    // Read back soon, by the node itself: kept in memory too.
    inner.hot.put(key, Arc::new(bytes));
    Ok(meta)
}

/// Storage → bytes the node holds.
pub(super) fn get_local(inner: &Inner, key: &str) -> Result<Option<Vec<u8>>, StorageError> {
    if inner.catalog.lock().touch(key).is_none() {
        inner.hot.remove(key);
        return Ok(None);
    }
    if let Some(bytes) = inner.hot.get(key) {
        inner
            .stats
            .pulled
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        return Ok(Some(bytes.to_vec()));
    }
    let Some(mut reader) = inner.backend.open(key)? else {
        inner.catalog.lock().remove(key);
        return Ok(None);
    };
    let meta = reader.meta().clone();
    let mut bytes = vec![0u8; meta.size as usize];
    reader.read_bytes(&mut bytes)?;
    if inner.verify_reads && crc32fast::hash(&bytes) != meta.crc32 {
        inner.catalog.lock().remove(key);
        let _ = inner.backend.remove(key);
        return Err(StorageError::Damaged {
            what: key.to_owned(),
            why: "its bytes do not match their CRC (dropped)".into(),
        });
    }
    inner.stats.pulled.fetch_add(meta.size, Ordering::Relaxed);
    metrics::counter!("dpumesh_store_bytes_total", "direction" => "pull").increment(meta.size);
    if bytes.len() <= super::hot::MAX_OBJECT {
        inner.hot.put(key, Arc::new(bytes.clone()));
    }
    Ok(Some(bytes))
}

/// Storage → host buffer.
pub(super) fn pull(inner: &Inner, peer: &PeerState, seg: &Segment) -> SegmentResult {
    let host = match buffer_range(peer, seg) {
        Ok(r) => r,
        Err(result) => return result,
    };
    let not_found = || SegmentResult::failed(Status::NotFound, format!("no object {:?}", seg.key));
    if inner.catalog.lock().touch(&seg.key).is_none() {
        return not_found();
    }
    let mut reader = match inner.backend.open(&seg.key) {
        Ok(Some(r)) => r,
        Ok(None) => {
            inner.catalog.lock().remove(&seg.key);
            inner.hot.remove(&seg.key);
            return not_found();
        }
        Err(e) => return storage(&e),
    };
    // The file's own header is the truth (a replacement may have landed meanwhile).
    let meta = reader.meta().clone();
    if seg.len < meta.size {
        return SegmentResult::failed(
            Status::TooSmall,
            format!(
                "object {:?} has {} bytes, the range has room for {}",
                seg.key, meta.size, seg.len
            ),
        );
    }
    let mut hasher = crc32fast::Hasher::new();
    let mut window = Window::new(inner);
    let mut next = 0u64;
    loop {
        while let Some((slot, at, len)) = window.next_chunk(peer, &mut next, meta.size) {
            let offset = inner.slots.offset(slot);
            // The storage read runs here while earlier chunks' DMA runs in the loop.
            if let Err(e) = reader.read_next(&inner.staging, offset, len) {
                inner.slots.release(slot);
                return storage(&e);
            }
            if inner.verify_reads {
                checksum(&inner.staging, offset, len, &mut hasher);
            }
            window.post(
                slot,
                len,
                (&inner.staging, offset),
                (&host, seg.offset + at),
            );
        }
        if peer.cancelled.load(Ordering::Acquire) {
            return cancelled(inner);
        }
        match window.await_oldest_copy() {
            None => break,
            Some(Ok((slot, _))) => inner.slots.release(slot),
            Some(Err(e)) => return SegmentResult::failed(Status::Dma, e),
        }
    }
    drop(window);
    if inner.verify_reads {
        let crc = hasher.finalize();
        if crc != meta.crc32 {
            tracing::error!(
                key = seg.key,
                stored = meta.crc32,
                read = crc,
                "a stored object does not match its checksum: dropped"
            );
            let mut catalog = inner.catalog.lock();
            catalog.remove(&seg.key);
            inner.hot.remove(&seg.key);
            let _ = inner.backend.remove(&seg.key);
            return SegmentResult::failed(
                Status::Corrupt,
                format!(
                    "object {:?} read back with CRC {crc:#010x}, stored with {:#010x}: dropped",
                    seg.key, meta.crc32
                ),
            );
        }
    }
    inner.stats.pulled.fetch_add(meta.size, Ordering::Relaxed);
    metrics::counter!("dpumesh_store_bytes_total", "direction" => "pull").increment(meta.size);
    SegmentResult::ok(meta.size, meta.crc32)
}

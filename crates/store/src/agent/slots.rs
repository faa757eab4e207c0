//! The staging buffer's slots: `queue_depth` of them, each `slot_size` bytes, handed
//! to transfers one chunk at a time. A transfer that already holds slots only ever
//! *tries* for another (it can always progress by finishing one it holds), so
//! transfers sharing the pool never deadlock.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};

pub(crate) struct Slots {
    free_tx: Sender<u32>,
    free_rx: Receiver<u32>,
    pub size: usize,
    pub count: usize,
}

impl Slots {
    pub fn new(count: usize, size: usize) -> Self {
        let (free_tx, free_rx) = crossbeam_channel::bounded(count);
        for i in 0..count {
            free_tx.send(i as u32).expect("room for every slot");
        }
        Self {
            free_tx,
            free_rx,
            size,
            count,
        }
    }

    /// The slot's offset in the staging buffer.
    pub fn offset(&self, slot: u32) -> u64 {
        u64::from(slot) * self.size as u64
    }

    /// Waits for a free slot; `None` once `cancel` is set.
    pub fn acquire(&self, cancel: &AtomicBool) -> Option<u32> {
        loop {
            if cancel.load(Ordering::Acquire) {
                return None;
            }
            if let Ok(slot) = self.free_rx.recv_timeout(Duration::from_millis(50)) {
                return Some(slot);
            }
        }
    }

    pub fn try_acquire(&self) -> Option<u32> {
        self.free_rx.try_recv().ok()
    }

    pub fn release(&self, slot: u32) {
        let _ = self.free_tx.send(slot);
    }

    /// Slots free now.
    pub fn free(&self) -> usize {
        self.free_rx.len()
    }
}

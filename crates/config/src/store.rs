//! The mesh file's `store` section: each node's BlueCache agent (a DPU-resident
//! object store fed by DMA; `dpumesh-store`).

use std::path::PathBuf;

use serde::Deserialize;

use crate::units::ByteSize;

/// Where a node keeps its objects.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StoreBackend {
    /// Files in a directory on the DPU's storage (survive restarts).
    #[default]
    Posix,
    /// Memory (gone with the process; for caches that need not survive).
    Memory,
}

/// The `store` section. Every node runs an agent when it is present.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreConfig {
    #[serde(default)]
    pub backend: StoreBackend,
    /// The folder under which each node keeps its objects, in `DIR/NODE` (default:
    /// `RUN_DIR/bluecache`, so one mesh file serves every node).
    pub dir: Option<PathBuf>,
    /// Bytes a node's store may hold; past it, the least recently used objects are
    /// evicted (default 1GiB).
    pub capacity: Option<ByteSize>,
    /// Staging slots: chunks in flight across all transfers (default 16).
    pub queue_depth: Option<u32>,
    /// Bytes per staging slot: one DMA per chunk of this size (default 256KiB).
    pub slot_size: Option<ByteSize>,
    /// Batches served at once (default 2).
    pub io_threads: Option<u32>,
    /// Overlap storage I/O with DMA (default true; off only to measure the gain).
    pub pipelined: Option<bool>,
    /// Check every pulled object against its stored CRC-32 (default true).
    pub verify_reads: Option<bool>,
    /// Sync data and directory before a PUSH counts as stored: survives power loss,
    /// at a cost (default false: a process crash still loses nothing committed).
    pub fsync: Option<bool>,
    /// DPU memory for small objects the node reads itself (the HTTP cache's bodies,
    /// each ≤ 64KiB), in front of storage (default 64MiB; 0: none).
    pub memory: Option<ByteSize>,
}

impl StoreConfig {
    pub fn capacity(&self) -> u64 {
        self.capacity.map_or(1 << 30, |b| b.0 as u64)
    }
    pub fn queue_depth(&self) -> usize {
        self.queue_depth.unwrap_or(16) as usize
    }
    pub fn slot_size(&self) -> usize {
        self.slot_size.map_or(256 << 10, |b| b.0)
    }
    pub fn io_threads(&self) -> usize {
        self.io_threads.unwrap_or(2) as usize
    }
    pub fn pipelined(&self) -> bool {
        self.pipelined.unwrap_or(true)
    }
    pub fn verify_reads(&self) -> bool {
        self.verify_reads.unwrap_or(true)
    }
    pub fn fsync(&self) -> bool {
        self.fsync.unwrap_or(false)
    }
    pub fn memory(&self) -> u64 {
        self.memory.map_or(64 << 20, |b| b.0 as u64)
    }

    /// Checks the bounds; a message naming the key.
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        if !(1..=4096).contains(&self.queue_depth()) {
            return Err(("store.queue_depth", "must be 1 to 4096".into()));
        }
        if !(4096..=(64 << 20)).contains(&self.slot_size()) {
            return Err(("store.slot_size", "must be 4KiB to 64MiB".into()));
        }
        if !(1..=64).contains(&self.io_threads()) {
            return Err(("store.io_threads", "must be 1 to 64".into()));
        }
        if self.capacity() == 0 {
            return Err(("store.capacity", "must be more than 0".into()));
        }
        Ok(())
    }
}

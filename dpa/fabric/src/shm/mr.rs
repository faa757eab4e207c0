//! Memory registration for the shared-memory fabric.
//!
//! Each protection domain publishes the regions registered in it in a table in shared
//! memory. A peer that WRITEs or READs by rkey reads the entry (a seqlock: a torn
//! read is retried, a changed entry is noticed), checks the access right and the
//! bounds, maps the region's file once, and copies — the target's CPU never takes
//! part, as with a NIC. A key names its table slot and a generation, so a key that was
//! deregistered (and its slot reused) never reaches the new region.
//!
//! ```text
//! table:  header line | entry[SLOTS], ENTRY bytes each, 8-byte atomic words:
//! entry:  seq (odd while written) | key | access | offset | len | addr | path_len | path…
//! ```

use std::collections::HashMap;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering, fence};

use parking_lot::Mutex;

use crate::{Access, FabricError, WcStatus};
use dpumesh_rings::shm::SharedRegion;

const MAGIC: u64 = u32::from_le_bytes(*b"DPMR") as u64;
const VERSION: u64 = 1;
/// Regions one protection domain can have registered at once.
pub(super) const SLOTS: usize = 4096;
const SLOT_BITS: u32 = 12;
const HEADER: u64 = 64;
const ENTRY_WORDS: usize = 32;
const ENTRY: u64 = (ENTRY_WORDS * 8) as u64;
/// Longest region path an entry holds.
const PATH_MAX: usize = (ENTRY_WORDS - 7) * 8;
/// Bytes of a table.
pub(super) const TABLE_LEN: usize = HEADER as usize + SLOTS * ENTRY as usize;

/// One registered range, as its owner knows it.
#[derive(Debug)]
pub(super) struct LocalMr {
    pub(super) region: Arc<SharedRegion>,
    /// Offset of the range in the region.
    pub(super) offset: u64,
    pub(super) len: u64,
    /// Virtual address (in the owner's mapping) of the range's first byte.
    pub(super) addr: u64,
    pub(super) access: Access,
}

impl LocalMr {
    /// The region offset of `[addr, addr + len)`, if it lies inside the range.
    pub(super) fn locate(&self, addr: u64, len: u64) -> Option<u64> {
        let start = addr.checked_sub(self.addr)?;
        (start.checked_add(len)? <= self.len).then_some(self.offset + start)
    }
}

/// A protection domain's table, at its owner.
#[derive(Debug)]
pub(super) struct MrTable {
    region: Arc<SharedRegion>,
    state: Mutex<TableState>,
    local: parking_lot::RwLock<HashMap<u32, Arc<LocalMr>>>,
}

#[derive(Debug)]
struct TableState {
    free: Vec<usize>,
    generations: Vec<u32>,
}

fn words(region: &SharedRegion, slot: usize) -> &[AtomicU64] {
    region
        .atomic_u64s(HEADER + slot as u64 * ENTRY, ENTRY_WORDS)
        .expect("the table was sized for SLOTS entries")
}

impl MrTable {
    pub(super) fn create() -> Result<Self, FabricError> {
        let region = SharedRegion::create_unique("dpumesh-shmf-mr", TABLE_LEN)
            .map_err(|e| FabricError::Register(e.to_string()))?;
        let header = region
            .atomic_u64s(0, 2)
            .map_err(|e| FabricError::Register(e.to_string()))?;
        header[1].store(SLOTS as u64, Ordering::Relaxed);
        header[0].store(MAGIC | VERSION << 32, Ordering::Release);
        Ok(Self {
            region: Arc::new(region),
            state: Mutex::new(TableState {
                free: (0..SLOTS).rev().collect(),
                generations: vec![0; SLOTS],
            }),
            local: parking_lot::RwLock::new(HashMap::new()),
        })
    }

    pub(super) fn path(&self) -> &Path {
        self.region.path()
    }

    /// Publishes `len` bytes of `region` at `offset`; returns the key.
    pub(super) fn register(
        &self,
        region: &Arc<SharedRegion>,
        offset: u64,
        len: u64,
        access: Access,
    ) -> Result<u32, FabricError> {
        if len == 0
            || offset
                .checked_add(len)
                .is_none_or(|end| end > region.len() as u64)
        {
            return Err(FabricError::Register(format!(
                "range {offset}+{len} is outside the {}-byte region {}",
                region.len(),
                region.name()
            )));
        }
        let path = region.path().as_os_str().as_encoded_bytes();
        if path.len() > PATH_MAX {
            return Err(FabricError::Register(format!(
                "region path {} is longer than {PATH_MAX} bytes",
                region.path().display()
            )));
        }
        let key = {
            let mut state = self.state.lock();
            let slot = state.free.pop().ok_or_else(|| {
                FabricError::Register(format!("{SLOTS} regions are registered already"))
            })?;
            // Generations start at 1, so no key is 0; they wrap within 20 bits.
            let generation = (state.generations[slot] % ((1 << (32 - SLOT_BITS)) - 1)) + 1;
            state.generations[slot] = generation;
            let key = generation << SLOT_BITS | slot as u32;
            let addr = region.base_addr() + offset;
            let w = words(&self.region, slot);
            let seq = w[0].load(Ordering::Relaxed);
            w[0].store(seq + 1, Ordering::Relaxed);
            fence(Ordering::Release);
            w[1].store(
                u64::from(key) | u64::from(access.bits()) << 32,
                Ordering::Relaxed,
            );
            w[2].store(offset, Ordering::Relaxed);
            w[3].store(len, Ordering::Relaxed);
            w[4].store(addr, Ordering::Relaxed);
            w[5].store(path.len() as u64, Ordering::Relaxed);
            for (i, chunk) in path.chunks(8).enumerate() {
                let mut word = [0u8; 8];
                word[..chunk.len()].copy_from_slice(chunk);
                w[6 + i].store(u64::from_le_bytes(word), Ordering::Relaxed);
            }
            w[0].store(seq + 2, Ordering::Release);
            self.local.write().insert(
                key,
                Arc::new(LocalMr {
                    region: region.clone(),
                    offset,
                    len,
                    addr,
                    access,
                }),
            );
            key
        };
        Ok(key)
    }

    /// Withdraws `key`: peers that look it up from now on are refused.
    pub(super) fn deregister(&self, key: u32) {
        let slot = (key & ((1 << SLOT_BITS) - 1)) as usize;
        let mut state = self.state.lock();
        let w = words(&self.region, slot);
        if w[1].load(Ordering::Relaxed) as u32 != key {
            return;
        }
        let seq = w[0].load(Ordering::Relaxed);
        w[0].store(seq + 1, Ordering::Relaxed);
        fence(Ordering::Release);
        w[1].store(0, Ordering::Relaxed);
        w[0].store(seq + 2, Ordering::Release);
        state.free.push(slot);
        self.local.write().remove(&key);
    }

    /// The owner's own view of `key` (its receives, its local buffers).
    pub(super) fn local(&self, key: u32) -> Option<Arc<LocalMr>> {
        self.local.read().get(&key).cloned()
    }
}

/// A peer's table, as the initiator of remote accesses sees it.
#[derive(Debug)]
pub(super) struct PeerRegions {
    table: SharedRegion,
    /// Resolved entries, trusted while their slot's sequence number is unchanged.
    cache: Mutex<HashMap<u32, (u64, Resolved)>>,
    /// The peer's regions, mapped once each.
    maps: Mutex<HashMap<PathBuf, Arc<SharedRegion>>>,
}

#[derive(Debug, Clone)]
struct Resolved {
    region: Arc<SharedRegion>,
    offset: u64,
    len: u64,
    addr: u64,
    access: Access,
}

impl PeerRegions {
    /// Maps the table at `path` (the peer's, named in the handshake).
    pub(super) fn open(path: &Path) -> Result<Self, String> {
        let table = SharedRegion::open(path).map_err(|e| e.to_string())?;
        if table.len() < TABLE_LEN {
            return Err(format!(
                "{} is too small for a region table",
                path.display()
            ));
        }
        let header = table.atomic_u64s(0, 2).map_err(|e| e.to_string())?;
        let magic = header[0].load(Ordering::Acquire);
        if magic != MAGIC | VERSION << 32 || header[1].load(Ordering::Relaxed) != SLOTS as u64 {
            return Err(format!(
                "{} holds no region table of version {VERSION} (found {magic:#x})",
                path.display()
            ));
        }
        Ok(Self {
            table,
            cache: Mutex::new(HashMap::new()),
            maps: Mutex::new(HashMap::new()),
        })
    }

    /// Where `[addr, addr + len)` of the peer's key `key` is: the region (mapped here)
    /// and the offset in it, if the key is live, grants `need`, and covers the range.
    pub(super) fn resolve(
        &self,
        key: u32,
        addr: u64,
        len: u64,
        need: Access,
    ) -> Result<(Arc<SharedRegion>, u64), WcStatus> {
        let slot = (key & ((1 << SLOT_BITS) - 1)) as usize;
        let w = words(&self.table, slot);
        let seq = w[0].load(Ordering::Acquire);
        let cached = self
            .cache
            .lock()
            .get(&key)
            .filter(|(s, _)| *s == seq && seq & 1 == 0)
            .map(|(_, r)| r.clone());
        let r = match cached {
            Some(r) => r,
            None => {
                let r = self.read_entry(key, slot).ok_or(WcStatus::RemoteAccess)?;
                self.cache.lock().insert(key, (r.1, r.0.clone()));
                r.0
            }
        };
        if !r.access.contains(need) {
            return Err(WcStatus::RemoteAccess);
        }
        let start = addr.checked_sub(r.addr).ok_or(WcStatus::RemoteAccess)?;
        if start.checked_add(len).is_none_or(|end| end > r.len) {
            return Err(WcStatus::RemoteAccess);
        }
        Ok((r.region, r.offset + start))
    }

    /// Reads entry `slot` consistently (retrying a torn read); `None` if it does not
    /// hold `key`. Returns the entry and the sequence number it was read at.
    fn read_entry(&self, key: u32, slot: usize) -> Option<(Resolved, u64)> {
        let w = words(&self.table, slot);
        for _ in 0..1000 {
            let seq = w[0].load(Ordering::Acquire);
            if seq & 1 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let word1 = w[1].load(Ordering::Relaxed);
            let offset = w[2].load(Ordering::Relaxed);
            let len = w[3].load(Ordering::Relaxed);
            let addr = w[4].load(Ordering::Relaxed);
            let path_len = (w[5].load(Ordering::Relaxed) as usize).min(PATH_MAX);
            let mut path = Vec::with_capacity(path_len);
            for i in 0..path_len.div_ceil(8) {
                path.extend_from_slice(&w[6 + i].load(Ordering::Relaxed).to_le_bytes());
            }
            path.truncate(path_len);
            fence(Ordering::Acquire);
            if w[0].load(Ordering::Relaxed) != seq {
                continue;
            }
            if word1 as u32 != key {
                return None;
            }
            let access = Access::from_bits((word1 >> 32) as u32);
            let path = PathBuf::from(std::ffi::OsStr::from_bytes(&path));
            let region = self.map(&path)?;
            // The peer's range must lie inside the file we mapped.
            if offset
                .checked_add(len)
                .is_none_or(|end| end > region.len() as u64)
            {
                return None;
            }
            return Some((
                Resolved {
                    region,
                    offset,
                    len,
                    addr,
                    access,
                },
                seq,
            ));
        }
        None
    }

    fn map(&self, path: &Path) -> Option<Arc<SharedRegion>> {
        let mut maps = self.maps.lock();
        if let Some(region) = maps.get(path) {
            return Some(region.clone());
        }
        let region = Arc::new(SharedRegion::open(path).ok()?);
        maps.insert(path.to_owned(), region.clone());
        Some(region)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_resolves_live_keys_within_bounds_and_rights_only() {
        let table = MrTable::create().unwrap();
        let region = Arc::new(SharedRegion::create_unique("dpumesh-test-mr", 8192).unwrap());
        let key = table
            .register(&region, 4096, 1024, Access::REMOTE_WRITE)
            .unwrap();
        let base = region.base_addr() + 4096;
        let peer = PeerRegions::open(table.path()).unwrap();
        let (mapped, offset) = peer
            .resolve(key, base + 10, 100, Access::REMOTE_WRITE)
            .unwrap();
        assert_eq!(offset, 4106);
        mapped.write(offset, b"hi").unwrap();
        assert_eq!(region.read_vec(4106, 2).unwrap(), b"hi", "the same memory");
        // Out of bounds, the wrong right, a wrong key.
        assert_eq!(
            peer.resolve(key, base + 1000, 100, Access::REMOTE_WRITE)
                .unwrap_err(),
            WcStatus::RemoteAccess
        );
        assert_eq!(
            peer.resolve(key, base - 1, 1, Access::REMOTE_WRITE)
                .unwrap_err(),
            WcStatus::RemoteAccess
        );
        assert_eq!(
            peer.resolve(key, base, 1, Access::REMOTE_READ).unwrap_err(),
            WcStatus::RemoteAccess
        );
        assert!(
            peer.resolve(key ^ 1, base, 1, Access::REMOTE_WRITE)
                .is_err()
        );
        // Deregistered, then the slot reused: the old key reaches nothing.
        table.deregister(key);
        assert!(peer.resolve(key, base, 1, Access::REMOTE_WRITE).is_err());
        let other = Arc::new(SharedRegion::create_unique("dpumesh-test-mr", 4096).unwrap());
        let new_key = table.register(&other, 0, 4096, Access::all()).unwrap();
        assert_ne!(new_key, key);
        assert!(peer.resolve(key, base, 1, Access::REMOTE_WRITE).is_err());
        assert!(
            peer.resolve(new_key, other.base_addr(), 4096, Access::REMOTE_READ)
                .is_ok()
        );
        // Registering outside the region is refused.
        assert!(table.register(&other, 4000, 200, Access::all()).is_err());
    }
}

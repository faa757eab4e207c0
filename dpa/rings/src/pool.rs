//! Buffer pools in shared memory: fixed-size slots, each with an ownership word that
//! every process of the node sees.
//!
//! A slot is free or owned by one participant (a pod, the DMA manager, the proxy).
//! Ownership moves with the descriptor that names the slot ([`BufferPool::transfer`]),
//! and the last owner frees it on completion. A slot's word is `generation << 32 |
//! owner`: every allocation bumps the generation, so a stale handle can never free a
//! slot that has since been handed to someone else. A participant that dies leaves
//! its slots marked with its id; [`BufferPool::reclaim`] frees them all.
//!
//! Sizing: `slot_size` is the largest message a slot takes
//! whole (a head: 4–16 KiB; a body: the largest body the route accepts, or bodies span
//! several slots), and `slot_count` is the number of messages in flight at once
//! (ring depth × in-flight requests per pod, plus what the DMA manager holds). A pool
//! costs `slot_count × slot_size` of pinned memory on hardware, so size bodies for the
//! common case and let rare large bodies fall back to a bigger pool.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::descriptor::{BufAddr, Buffer};
use crate::shm::{SharedRegion, ShmError};

const MAGIC: u32 = u32::from_le_bytes(*b"DPPL");
const VERSION: u32 = 1;
/// Header: magic, version, slot_size, slot_count, data_offset, region id, hint.
const HEADER: u64 = 64;
/// Slot data starts page-aligned, so slots of page-multiple sizes are page-aligned
/// (what DMA engines and verbs registration prefer).
const PAGE: u64 = 4096;

/// A participant's id; 0 means "free".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OwnerId(pub u32);

impl OwnerId {
    /// The DMA manager of a node.
    pub const DMA: OwnerId = OwnerId(u32::MAX);
    /// The DPU proxy (ARM) of a node.
    pub const PROXY: OwnerId = OwnerId(u32::MAX - 1);
    /// The fabric, for buffers it writes into on behalf of a remote peer.
    pub const FABRIC: OwnerId = OwnerId(u32::MAX - 2);
}

/// How a pool is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolLayout {
    /// Bytes per slot (a multiple of 64).
    pub slot_size: u32,
    /// Number of slots.
    pub slot_count: u32,
}

impl PoolLayout {
    /// `count` slots of `size` bytes.
    pub fn new(slot_size: u32, slot_count: u32) -> Self {
        Self {
            slot_size,
            slot_count,
        }
    }

    fn data_offset(&self) -> u64 {
        (HEADER + self.slot_count as u64 * 8).next_multiple_of(PAGE)
    }

    /// Bytes of shared memory the pool needs.
    pub fn region_len(&self) -> u64 {
        self.data_offset() + self.slot_count as u64 * self.slot_size as u64
    }

    fn check(&self) -> Result<(), PoolError> {
        if self.slot_count == 0 || self.slot_size == 0 || !self.slot_size.is_multiple_of(64) {
            return Err(PoolError::Layout(format!(
                "{} slots of {} bytes: need at least one slot, and a slot size that is a non-zero multiple of 64",
                self.slot_count, self.slot_size
            )));
        }
        if self.region_len() > BufAddr::MAX_OFFSET {
            return Err(PoolError::Layout(format!(
                "{} slots of {} bytes exceed the 256 TiB a region can address",
                self.slot_count, self.slot_size
            )));
        }
        Ok(())
    }
}

/// A slot and the generation it was allocated in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlotRef {
    pub index: u32,
    /// Generation at allocation.
    pub generation: u32,
}

/// Why a pool operation failed.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// The region is not usable.
    #[error(transparent)]
    Shm(#[from] ShmError),
    /// The layout is impossible.
    #[error("bad pool layout: {0}")]
    Layout(String),
    /// The region holds no pool of this version.
    #[error(
        "region {region} holds no buffer pool (magic {magic:#x}, version {version}; expected version {VERSION})"
    )]
    NotAPool {
        /// The region's name.
        region: String,
        /// The magic found.
        magic: u32,
        /// The version found.
        version: u32,
    },
    /// Every slot is taken: back-pressure for the caller.
    #[error("pool {region} is exhausted ({count} slots of {size} bytes all in use)")]
    Exhausted {
        /// The region's name.
        region: String,
        count: u32,
        size: u32,
    },
    /// The slot is not owned by who claims it (freed, reclaimed, or someone else's).
    #[error(
        "slot {index} of pool {region} is not held by owner {owner} (its word says owner {actual}, generation {generation})"
    )]
    NotOwner {
        /// The region's name.
        region: String,
        /// The slot.
        index: u32,
        /// Who claimed it.
        owner: u32,
        /// Who holds it.
        actual: u32,
        generation: u32,
    },
    /// A handle from an earlier allocation.
    #[error(
        "slot {index} of pool {region} was reallocated (handle generation {held}, now {current})"
    )]
    Stale {
        /// The region's name.
        region: String,
        /// The slot.
        index: u32,
        /// The handle's generation.
        held: u32,
        /// The slot's generation.
        current: u32,
    },
    /// An address or length outside the pool's slots.
    #[error(
        "{what} does not lie within one slot of pool {region} (region {id}, {count} slots of {size} bytes)"
    )]
    Address {
        /// What was looked up.
        what: String,
        /// The region's name.
        region: String,
        /// The region id.
        id: u16,
        count: u32,
        size: u32,
    },
}

/// A pool mapped in this process.
#[derive(Debug, Clone)]
pub struct BufferPool {
    region: Arc<SharedRegion>,
    id: u16,
    layout: PoolLayout,
    data: u64,
}

fn word(generation: u32, owner: OwnerId) -> u64 {
    (generation as u64) << 32 | owner.0 as u64
}

fn split(w: u64) -> (u32, u32) {
    ((w >> 32) as u32, w as u32)
}

impl BufferPool {
    /// Lays a new pool over `region` (which must be fresh: zeroed, not yet shared),
    /// with region id `id` (used in the addresses of its slots).
    pub fn create(
        region: Arc<SharedRegion>,
        id: u16,
        layout: PoolLayout,
    ) -> Result<Self, PoolError> {
        layout.check()?;
        if id == 0 {
            return Err(PoolError::Layout("region id 0 is reserved".to_owned()));
        }
        if (region.len() as u64) < layout.region_len() {
            return Err(PoolError::Layout(format!(
                "region {} has {} bytes; the pool needs {}",
                region.name(),
                region.len(),
                layout.region_len()
            )));
        }
        let h = region.atomic_u64s(0, 8)?;
        h[1].store(
            layout.slot_size as u64 | (layout.slot_count as u64) << 32,
            Ordering::Relaxed,
        );
        h[2].store(layout.data_offset(), Ordering::Relaxed);
        h[3].store(id as u64, Ordering::Relaxed);
        // The magic goes last: a process that attaches sees a whole header or none.
        h[0].store(MAGIC as u64 | (VERSION as u64) << 32, Ordering::Release);
        Ok(Self {
            data: layout.data_offset(),
            region,
            id,
            layout,
        })
    }

    /// Creates a region for a pool and lays the pool over it.
    pub fn create_in_shm(prefix: &str, id: u16, layout: PoolLayout) -> Result<Self, PoolError> {
        layout.check()?;
        let region = SharedRegion::create_unique(prefix, layout.region_len() as usize)?;
        Self::create(Arc::new(region), id, layout)
    }

    /// Creates a sealed region for a pool (shared by its descriptor, see
    /// [`SharedRegion::create_sealed`]) and lays the pool over it.
    pub fn create_sealed(name: &str, id: u16, layout: PoolLayout) -> Result<Self, PoolError> {
        layout.check()?;
        let region = SharedRegion::create_sealed(name, layout.region_len() as usize)?;
        Self::create(Arc::new(region), id, layout)
    }

    /// Attaches to a pool another process created, checking its header against the
    /// region.
    pub fn attach(region: Arc<SharedRegion>) -> Result<Self, PoolError> {
        let h = region.atomic_u64s(0, 8)?;
        let head = h[0].load(Ordering::Acquire);
        let (magic, version) = (head as u32, (head >> 32) as u32);
        if magic != MAGIC || version != VERSION {
            return Err(PoolError::NotAPool {
                region: region.name().to_owned(),
                magic,
                version,
            });
        }
        let sizes = h[1].load(Ordering::Relaxed);
        let layout = PoolLayout::new(sizes as u32, (sizes >> 32) as u32);
        layout.check()?;
        let data = h[2].load(Ordering::Relaxed);
        let id = h[3].load(Ordering::Relaxed) as u16;
        if data != layout.data_offset() || (region.len() as u64) < layout.region_len() || id == 0 {
            return Err(PoolError::Layout(format!(
                "pool header of {} does not match its {}-byte region",
                region.name(),
                region.len()
            )));
        }
        Ok(Self {
            region,
            id,
            layout,
            data,
        })
    }

    /// The region id in this pool's addresses.
    pub fn id(&self) -> u16 {
        self.id
    }

    pub fn layout(&self) -> PoolLayout {
        self.layout
    }

    /// The shared region.
    pub fn region(&self) -> &Arc<SharedRegion> {
        &self.region
    }

    /// The byte range (offset, length) of the slots' ownership words.
    pub(crate) fn words_range(&self) -> (u64, u64) {
        (HEADER, self.layout.slot_count as u64 * 8)
    }

    /// The slots' ownership words (`generation << 32 | owner`).
    pub(crate) fn words(&self) -> &[AtomicU64] {
        // Checked at create/attach: the words are in bounds and aligned.
        self.region
            .atomic_u64s(HEADER, self.layout.slot_count as usize)
            .unwrap_or_default()
    }

    fn hint(&self) -> &AtomicU64 {
        &self
            .region
            .atomic_u64s(32, 1)
            .expect("the header is in bounds")[0]
    }

    /// Takes a free slot for `owner`, or reports exhaustion (never blocks, never
    /// overwrites).
    pub fn alloc(&self, owner: OwnerId) -> Result<SlotRef, PoolError> {
        assert_ne!(owner.0, 0, "owner id 0 means free");
        let words = self.words();
        let n = words.len();
        // Start at the slot freed last: its pages are faulted in and likely still in
        // cache (a pool of large slots used round-robin would touch cold memory on
        // every message). Claiming it moves the hint on, so concurrent allocators
        // spread out instead of fighting over one word.
        let start = self.hint().load(Ordering::Relaxed) as usize % n;
        for i in 0..n {
            let index = (start + i) % n;
            let current = words[index].load(Ordering::Relaxed);
            let (generation, holder) = split(current);
            if holder != 0 {
                continue;
            }
            let next = word(generation.wrapping_add(1), owner);
            if words[index]
                .compare_exchange(current, next, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
            {
                self.hint().store((index + 1) as u64, Ordering::Relaxed);
                return Ok(SlotRef {
                    index: index as u32,
                    generation: generation.wrapping_add(1),
                });
            }
        }
        Err(PoolError::Exhausted {
            region: self.region.name().to_owned(),
            count: self.layout.slot_count,
            size: self.layout.slot_size,
        })
    }

    fn swap_owner(&self, slot: SlotRef, from: OwnerId, to: u32) -> Result<(), PoolError> {
        // Owner 0 means free: "from free" would take a slot without an allocation.
        if from.0 == 0 {
            return Err(PoolError::NotOwner {
                region: self.region.name().to_owned(),
                index: slot.index,
                owner: 0,
                actual: self.state(slot.index).map_or(0, |s| s.1.0),
                generation: slot.generation,
            });
        }
        let words = self.words();
        let Some(w) = words.get(slot.index as usize) else {
            return Err(self.address_error(format!("slot {}", slot.index)));
        };
        let expected = word(slot.generation, from);
        let next = (slot.generation as u64) << 32 | to as u64;
        // Release: writes into the slot happen before whoever takes it next sees it.
        w.compare_exchange(expected, next, Ordering::AcqRel, Ordering::Acquire)
            .map(|_| ())
            .map_err(|actual| {
                let (generation, holder) = split(actual);
                if generation != slot.generation {
                    PoolError::Stale {
                        region: self.region.name().to_owned(),
                        index: slot.index,
                        held: slot.generation,
                        current: generation,
                    }
                } else {
                    PoolError::NotOwner {
                        region: self.region.name().to_owned(),
                        index: slot.index,
                        owner: from.0,
                        actual: holder,
                        generation,
                    }
                }
            })
    }

    /// Frees a slot `owner` holds; the next allocation tries it first.
    pub fn release(&self, slot: SlotRef, owner: OwnerId) -> Result<(), PoolError> {
        self.swap_owner(slot, owner, 0)?;
        self.hint().store(slot.index as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Hands a slot from `from` to `to` (with the descriptor that names it).
    pub fn transfer(&self, slot: SlotRef, from: OwnerId, to: OwnerId) -> Result<(), PoolError> {
        assert_ne!(to.0, 0, "owner id 0 means free");
        self.swap_owner(slot, from, to.0)
    }

    /// The slot's current generation and owner (0 = free).
    pub fn state(&self, index: u32) -> Option<(u32, OwnerId)> {
        let (generation, owner) = split(self.words().get(index as usize)?.load(Ordering::Acquire));
        Some((generation, OwnerId(owner)))
    }

    /// Frees every slot `owner` holds (it died or left); returns how many.
    pub fn reclaim(&self, owner: OwnerId) -> usize {
        let mut freed = 0;
        for w in self.words() {
            let current = w.load(Ordering::Acquire);
            let (generation, holder) = split(current);
            if holder == owner.0
                && w.compare_exchange(
                    current,
                    (generation as u64) << 32,
                    Ordering::AcqRel,
                    Ordering::Relaxed,
                )
                .is_ok()
            {
                freed += 1;
            }
        }
        freed
    }

    /// Slots in use.
    pub fn in_use(&self) -> usize {
        self.words()
            .iter()
            .filter(|w| split(w.load(Ordering::Relaxed)).1 != 0)
            .count()
    }

    /// Slots held by `owner`.
    pub fn held_by(&self, owner: OwnerId) -> usize {
        self.words()
            .iter()
            .filter(|w| split(w.load(Ordering::Relaxed)).1 == owner.0)
            .count()
    }

    fn slot_offset(&self, index: u32) -> u64 {
        self.data + index as u64 * self.layout.slot_size as u64
    }

    /// The address of byte `offset` of a slot.
    pub fn addr(&self, slot: SlotRef) -> BufAddr {
        BufAddr::new(self.id, self.slot_offset(slot.index))
            .expect("pool layouts fit the address space")
    }

    /// The buffer of `len` bytes at the start of a slot.
    pub fn buffer(&self, slot: SlotRef, len: u32) -> Result<Buffer, PoolError> {
        if len > self.layout.slot_size {
            return Err(self.address_error(format!("{len} bytes")));
        }
        Ok(Buffer::new(self.addr(slot), len))
    }

    fn address_error(&self, what: String) -> PoolError {
        PoolError::Address {
            what,
            region: self.region.name().to_owned(),
            id: self.id,
            count: self.layout.slot_count,
            size: self.layout.slot_size,
        }
    }

    /// The slot a buffer lies in, with its current generation; the buffer must start
    /// at the slot's start and fit in it (descriptors never name anything else).
    pub fn slot_of(&self, buffer: Buffer) -> Result<SlotRef, PoolError> {
        let addr = buffer.addr;
        let bad = || self.address_error(format!("buffer {addr} of {} bytes", buffer.len));
        if addr.region() != self.id || addr.offset() < self.data {
            return Err(bad());
        }
        let rel = addr.offset() - self.data;
        let size = self.layout.slot_size as u64;
        let index = rel / size;
        if !rel.is_multiple_of(size)
            || index >= self.layout.slot_count as u64
            || buffer.len as u64 > size
        {
            return Err(bad());
        }
        let (generation, _) = self.state(index as u32).ok_or_else(bad)?;
        Ok(SlotRef {
            index: index as u32,
            generation,
        })
    }

    /// Writes `bytes` at the start of a slot.
    pub fn write(&self, slot: SlotRef, bytes: &[u8]) -> Result<Buffer, PoolError> {
        let buffer = self.buffer(slot, u32::try_from(bytes.len()).unwrap_or(u32::MAX))?;
        self.region.write(self.slot_offset(slot.index), bytes)?;
        Ok(buffer)
    }

    /// Reads a buffer of this pool.
    pub fn read(&self, buffer: Buffer) -> Result<Vec<u8>, PoolError> {
        let slot = self.slot_of(buffer)?;
        Ok(self
            .region
            .read_vec(self.slot_offset(slot.index), buffer.len as usize)?)
    }

    /// Reads a buffer of this pool into `out` (its first `buffer.len` bytes).
    pub fn read_into(&self, buffer: Buffer, out: &mut [u8]) -> Result<(), PoolError> {
        let slot = self.slot_of(buffer)?;
        let n = (buffer.len as usize).min(out.len());
        Ok(self
            .region
            .read(self.slot_offset(slot.index), &mut out[..n])?)
    }

    /// The region offset of a buffer of this pool (for DMA copies).
    pub fn offset_of(&self, buffer: Buffer) -> Result<u64, PoolError> {
        let slot = self.slot_of(buffer)?;
        Ok(self.slot_offset(slot.index))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(size: u32, count: u32) -> BufferPool {
        BufferPool::create_in_shm("dpumesh-test-pool", 1, PoolLayout::new(size, count)).unwrap()
    }

    #[test]
    fn slots_are_allocated_until_exhausted_then_freed() {
        let p = pool(256, 4);
        let a = OwnerId(1);
        let slots: Vec<_> = (0..4).map(|_| p.alloc(a).unwrap()).collect();
        let err = p.alloc(a).unwrap_err().to_string();
        assert!(
            err.contains("exhausted (4 slots of 256 bytes all in use)"),
            "{err}"
        );
        assert_eq!(p.in_use(), 4);
        p.release(slots[2], a).unwrap();
        let again = p.alloc(a).unwrap();
        assert_eq!(again.index, slots[2].index);
        assert_eq!(again.generation, slots[2].generation + 1);
    }

    #[test]
    fn the_slot_freed_last_is_handed_out_next() {
        let p = pool(64, 8);
        let a = OwnerId(1);
        let s = p.alloc(a).unwrap();
        let _t = p.alloc(a).unwrap();
        p.release(s, a).unwrap();
        // Six other slots are free, but the one just freed is hot: it comes back.
        assert_eq!(p.alloc(a).unwrap().index, s.index);
    }

    #[test]
    fn ownership_moves_and_stale_handles_are_refused() {
        let p = pool(64, 2);
        let (a, b) = (OwnerId(1), OwnerId(2));
        let s = p.alloc(a).unwrap();
        assert!(matches!(
            p.release(s, b),
            Err(PoolError::NotOwner { actual: 1, .. })
        ));
        p.transfer(s, a, b).unwrap();
        assert!(p.release(s, a).is_err(), "a handed it over");
        p.release(s, b).unwrap();
        let t = p.alloc(a).unwrap();
        // The slot freed last comes back: same index, new generation, and the old
        // handle cannot free it.
        assert_eq!(t.index, s.index);
        assert!(matches!(p.release(s, a), Err(PoolError::Stale { .. })));
        assert!(
            p.release(t, OwnerId(0)).is_err(),
            "nobody acts as owner 0 (free)"
        );
        p.release(t, a).unwrap();
    }

    #[test]
    fn reclaim_frees_only_the_dead_owners_slots() {
        let p = pool(64, 8);
        for _ in 0..3 {
            p.alloc(OwnerId(7)).unwrap();
        }
        let keep = p.alloc(OwnerId(8)).unwrap();
        assert_eq!(p.reclaim(OwnerId(7)), 3);
        assert_eq!(p.in_use(), 1);
        assert_eq!(p.held_by(OwnerId(8)), 1);
        p.release(keep, OwnerId(8)).unwrap();
    }

    #[test]
    fn addresses_map_back_to_slots_and_foreign_ones_are_refused() {
        let p = pool(128, 4);
        let s = p.alloc(OwnerId(1)).unwrap();
        let buf = p.write(s, b"head bytes").unwrap();
        assert_eq!(p.slot_of(buf).unwrap(), s);
        assert_eq!(p.read(buf).unwrap(), b"head bytes");
        assert!(
            p.slot_of(Buffer::new(buf.addr.offset_by(1).unwrap(), 1))
                .is_err()
        );
        assert!(p.slot_of(Buffer::new(buf.addr, 129)).is_err());
        assert!(
            p.slot_of(Buffer::new(BufAddr::new(2, 4096).unwrap(), 1))
                .is_err()
        );
        assert!(p.write(s, &[0; 129]).is_err());
    }

    #[test]
    fn another_mapping_attaches_and_shares_the_ownership_words() {
        let p = pool(64, 4);
        let q =
            BufferPool::attach(Arc::new(SharedRegion::open(p.region().path()).unwrap())).unwrap();
        assert_eq!(q.layout(), p.layout());
        assert_eq!(q.id(), 1);
        let s = p.alloc(OwnerId(3)).unwrap();
        assert_eq!(q.state(s.index), Some((s.generation, OwnerId(3))));
        q.release(s, OwnerId(3)).unwrap();
        assert_eq!(p.in_use(), 0);
        let bad = Arc::new(SharedRegion::create_unique("dpumesh-test-pool", 8192).unwrap());
        assert!(matches!(
            BufferPool::attach(bad),
            Err(PoolError::NotAPool { .. })
        ));
    }

    #[test]
    fn impossible_layouts_are_refused() {
        for layout in [
            PoolLayout::new(0, 4),
            PoolLayout::new(64, 0),
            PoolLayout::new(100, 4),
        ] {
            assert!(matches!(
                BufferPool::create_in_shm("dpumesh-test-pool", 1, layout),
                Err(PoolError::Layout(_))
            ));
        }
    }
}

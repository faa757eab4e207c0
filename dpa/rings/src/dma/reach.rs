//! Reaching memory on the other side of PCIe (docs/data-path.md, "On a BlueField",
//! layer 2). On a BlueField the DMA manager runs on the DPU and its pods' regions are
//! host memory it cannot load from or store to: it works on local mirrors of their
//! rings and ownership words, kept in step by DMA ([`Reach::pull`], [`Reach::push`]),
//! while the slots' bytes stay on the host and are copied there directly (a mirror
//! pool is [`Reach::alias`]ed to the host region, so the manager's copy jobs naming it
//! act on the host's).
//!
//! [`Loopback`] is the software engine with these semantics: the "other side" is
//! regions of this machine the manager never touches except through the engine, so
//! the whole protocol (one writer per word, what is pulled and pushed when) runs and
//! is tested here. `DocaDma` is the hardware one (`doca` feature).

use std::collections::HashMap;
use std::sync::Arc;

use crate::shm::SharedRegion;

use super::export::PciExport;
use super::{CopyJob, DmaEngine, DmaError};

/// A region on the other side, as the engine that adopted it names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemoteId(pub u32);

/// How a region on the other side is given to an engine.
#[derive(Debug, Clone)]
pub enum RemoteSide {
    /// A region of this machine standing for host memory ([`Loopback`]).
    Loopback(Arc<SharedRegion>),
    /// A host region's PCI export (`DocaDma` imports it).
    Pci(PciExport),
}

/// One range kept in step: `len` bytes at `offset` in both the remote region and the
/// local one (a mirror has its remote's layout).
#[derive(Debug, Clone, Copy)]
pub struct SyncRange<'a> {
    pub remote: RemoteId,
    pub local: &'a SharedRegion,
    pub offset: u64,
    pub len: u64,
}

/// What an engine that reaches across PCIe does besides copying.
pub trait Reach {
    /// Takes a region of the other side; it is named by the id from then on.
    fn adopt(&mut self, side: &RemoteSide) -> Result<RemoteId, DmaError>;

    /// Lets go of a region (and of any alias to it).
    fn release(&mut self, id: RemoteId);

    /// Copies each range from its remote region into its local one; returns when all
    /// have landed. The ranges of one call may land in any order.
    fn pull(&mut self, ranges: &[SyncRange<'_>]) -> Result<(), DmaError>;

    /// Copies each range from its local region into its remote one; returns when all
    /// have landed, each range's bytes in address order (a ring entry's `valid` word,
    /// its last, lands last). The ranges of one call may land in any order: what must
    /// follow something goes in a later call.
    fn push(&mut self, ranges: &[SyncRange<'_>]) -> Result<(), DmaError>;

    /// From now on, copy jobs naming `mirror` act on `remote` instead.
    fn alias(&mut self, mirror: &SharedRegion, remote: RemoteId);

    /// Tells the other side to wake pod `pod` (its bell and its ring's futex): the DPU
    /// cannot write a host eventfd.
    fn wake(&mut self, pod: u32);
}

/// What [`Loopback`] did, for tests and metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ReachStats {
    /// `pull` calls and the ranges they moved.
    pub pulls: u64,
    pub pulled_ranges: u64,
    /// `push` calls and the ranges they moved.
    pub pushes: u64,
    pub pushed_ranges: u64,
    /// Wake requests.
    pub wakes: u64,
}

/// The software engine across a pretend PCIe.
#[derive(Default)]
pub struct Loopback {
    remotes: HashMap<RemoteId, Arc<SharedRegion>>,
    /// Mirror region (by its base address) → the remote it stands for.
    aliases: HashMap<u64, RemoteId>,
    next: u32,
    stats: ReachStats,
}

impl std::fmt::Debug for Loopback {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loopback")
            .field("remotes", &self.remotes.len())
            .field("aliases", &self.aliases.len())
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl Loopback {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn stats(&self) -> ReachStats {
        self.stats
    }

    fn remote(&self, id: RemoteId) -> Result<&SharedRegion, DmaError> {
        self.remotes
            .get(&id)
            .map(|r| &**r)
            .ok_or_else(|| DmaError::Engine {
                engine: "loopback",
                detail: format!("no remote region {}", id.0),
            })
    }

    /// The region a copy job's end really names.
    fn resolve<'a>(&'a self, region: &'a SharedRegion) -> &'a SharedRegion {
        match self.aliases.get(&region.base_addr()) {
            Some(id) => self.remotes.get(id).map_or(region, |r| &**r),
            None => region,
        }
    }
}

impl DmaEngine for Loopback {
    fn name(&self) -> &'static str {
        "loopback"
    }

    fn copy(&mut self, jobs: &[CopyJob<'_>]) -> Result<(), DmaError> {
        for job in jobs {
            let (src, dst) = (self.resolve(job.src), self.resolve(job.dst));
            dst.copy_from(job.dst_offset, src, job.src_offset, job.len)?;
        }
        Ok(())
    }

    fn reach(&mut self) -> Option<&mut dyn Reach> {
        Some(self)
    }
}

impl Reach for Loopback {
    fn adopt(&mut self, side: &RemoteSide) -> Result<RemoteId, DmaError> {
        let RemoteSide::Loopback(region) = side else {
            return Err(DmaError::Engine {
                engine: "loopback",
                detail: "a PCI export needs a DOCA engine".to_owned(),
            });
        };
        self.next += 1;
        let id = RemoteId(self.next);
        self.remotes.insert(id, region.clone());
        Ok(id)
    }

    fn release(&mut self, id: RemoteId) {
        self.remotes.remove(&id);
        self.aliases.retain(|_, r| *r != id);
    }

    fn pull(&mut self, ranges: &[SyncRange<'_>]) -> Result<(), DmaError> {
        self.stats.pulls += 1;
        self.stats.pulled_ranges += ranges.len() as u64;
        for r in ranges {
            copy_words(
                self.remote(r.remote)?,
                r.local,
                r.offset,
                r.len,
                Order::Descending,
            )?;
        }
        Ok(())
    }

    fn push(&mut self, ranges: &[SyncRange<'_>]) -> Result<(), DmaError> {
        self.stats.pushes += 1;
        self.stats.pushed_ranges += ranges.len() as u64;
        for r in ranges {
            copy_words(
                r.local,
                self.remote(r.remote)?,
                r.offset,
                r.len,
                Order::Ascending,
            )?;
        }
        Ok(())
    }

    fn alias(&mut self, mirror: &SharedRegion, remote: RemoteId) {
        self.aliases.insert(mirror.base_addr(), remote);
    }

    fn wake(&mut self, _pod: u32) {
        // Counted only: the emulation's host side wakes its pods itself
        // (`MirrorSides::host_wake`).
        self.stats.wakes += 1;
    }
}

/// Which end of a range is copied first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Order {
    /// Last word first: a read of a ring entry meets its `valid` word (its last)
    /// before the words it guards, so an entry seen valid is seen whole (what a DMA
    /// read of a cache line gives).
    Descending,
    /// First word first: a written entry's `valid` word lands after the words it
    /// guards (what posted PCIe writes give).
    Ascending,
}

/// Copies `len` bytes at `offset` between two regions a word at a time (acquire loads,
/// release stores) in `order`, the way the other side's processes see DMA move them.
fn copy_words(
    from: &SharedRegion,
    to: &SharedRegion,
    offset: u64,
    len: u64,
    order: Order,
) -> Result<(), DmaError> {
    use std::sync::atomic::Ordering;
    if !offset.is_multiple_of(8) || !len.is_multiple_of(8) {
        return Ok(to.copy_from(offset, from, offset, len)?);
    }
    let n = (len / 8) as usize;
    let (src, dst) = (from.atomic_u64s(offset, n)?, to.atomic_u64s(offset, n)?);
    let mut copy = |i: usize| dst[i].store(src[i].load(Ordering::Acquire), Ordering::Release);
    match order {
        Order::Descending => (0..n).rev().for_each(&mut copy),
        Order::Ascending => (0..n).for_each(&mut copy),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_loopback_moves_bytes_only_through_its_calls() {
        let host = Arc::new(SharedRegion::create_sealed("dpumesh-test-host", 8192).unwrap());
        let mirror = SharedRegion::create_sealed("dpumesh-test-mirror", 8192).unwrap();
        let local = SharedRegion::create_sealed("dpumesh-test-local", 8192).unwrap();
        let mut engine = Loopback::new();
        let id = engine.adopt(&RemoteSide::Loopback(host.clone())).unwrap();
        host.write(100, b"from the host").unwrap();
        assert_eq!(
            mirror.read_vec(100, 13).unwrap(),
            vec![0; 13],
            "nothing moves by itself"
        );
        let range = |offset, len| SyncRange {
            remote: id,
            local: &mirror,
            offset,
            len,
        };
        engine.pull(&[range(100, 13)]).unwrap();
        assert_eq!(mirror.read_vec(100, 13).unwrap(), b"from the host");
        mirror.write(4000, b"to the host").unwrap();
        engine.push(&[range(4000, 11)]).unwrap();
        assert_eq!(host.read_vec(4000, 11).unwrap(), b"to the host");
        // A copy naming the mirror acts on the host region it stands for.
        engine.alias(&mirror, id);
        local.write(0, b"slot bytes").unwrap();
        engine
            .copy(&[CopyJob {
                src: &local,
                src_offset: 0,
                dst: &mirror,
                dst_offset: 6000,
                len: 10,
            }])
            .unwrap();
        assert_eq!(host.read_vec(6000, 10).unwrap(), b"slot bytes");
        assert_eq!(mirror.read_vec(6000, 10).unwrap(), vec![0; 10]);
        // Out of bounds is an error, and a released region is gone.
        assert!(engine.pull(&[range(8190, 4)]).is_err());
        engine.release(id);
        assert!(
            engine
                .pull(&[range(0, 1)])
                .unwrap_err()
                .to_string()
                .contains("no remote region")
        );
        let pci = RemoteSide::Pci(PciExport {
            addr: 1,
            len: 1,
            descriptor: vec![1],
        });
        assert!(engine.adopt(&pci).is_err());
    }
}

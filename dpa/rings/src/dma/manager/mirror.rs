//! A pod whose regions are on the other side of PCIe (docs/data-path.md, "On a
//! BlueField"): the manager works on local mirrors of its rings and pools, kept in
//! step through the engine's [`Reach`], one writer per word.
//!
//! - **TX SQ** (the pod produces): [`MirrorPort::pull`] reads the next [`BUDGET`]
//!   entries past the manager's position; [`MirrorPort::push`] writes the manager's
//!   position (`head`) back, so the pod sees room.
//! - **RX SQ** (the manager produces): `push` writes the entries published since the
//!   last push, then the `tail`; `pull` reads the pod's `head` and `waiting` words. A
//!   pod that may sleep is woken through the other side ([`Reach::wake`]) after its
//!   entries landed and its `waiting` words (its ring's and its bell's) were read
//!   again (the store–fence–load handshake, across PCIe).
//! - **Pools**: each ownership word has three values: the mirror's (`m`), the host's
//!   as last agreed (`known`, shared by every shard's port of the pod) and the host's
//!   now (`h`, pulled). `m == known` means the manager changed nothing: the mirror
//!   takes the host's word (a slot the pod allocated or freed). `m != known` means a
//!   change of the manager's own is pending: the mirror keeps it, and if it gives the
//!   slot to a pod it is pushed (before the ring entry that names the slot) and becomes
//!   `known`. States the manager holds for itself (DMA, proxy, fabric) never reach the
//!   host; the pod never writes a word it does not own.
//! - Slot bytes stay on the host: each mirror pool is aliased to its host region, so
//!   the manager's copies act there.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::dma::DmaError;
use crate::dma::reach::{Reach, RemoteId, RemoteSide, SyncRange};
use crate::pool::{BufferPool, OwnerId};
use crate::ring::{Consumer, HEAD, LINE, Producer, TAIL, WAKE};
use crate::shm::SharedRegion;

use super::BUDGET;

/// The regions on the other side a mirrored pod's port stands for.
#[derive(Clone)]
pub struct MirrorSides {
    /// TX header, TX body, RX header, RX body.
    pub pools: [RemoteSide; 4],
    pub tx_sq: RemoteSide,
    pub rx_sq: RemoteSide,
    /// The pod's bell (its first word: whether it sleeps on the bell's eventfd).
    pub bell: RemoteSide,
    /// How the other side wakes the pod when it is this machine (the loopback
    /// emulation: what a host agent does on the DPU's word); `None`: the engine's
    /// [`Reach::wake`].
    pub host_wake: Option<Arc<dyn Fn() + Send + Sync>>,
}

impl std::fmt::Debug for MirrorSides {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MirrorSides")
            .field("pools", &self.pools)
            .field("tx_sq", &self.tx_sq)
            .field("rx_sq", &self.rx_sq)
            .field("bell", &self.bell)
            .field("host_wake", &self.host_wake.is_some())
            .finish()
    }
}

/// The host's ownership words as last agreed, for one pool: shared by the ports of
/// one pod on every shard (their engines push to the same host words).
#[derive(Debug)]
pub struct Known(Vec<AtomicU64>);

impl Known {
    /// For a pool of `slots` slots, all free (as a new pool is on both sides).
    pub fn new(slots: u32) -> Arc<Self> {
        Arc::new(Self((0..slots).map(|_| AtomicU64::new(0)).collect()))
    }
}

/// What the manager keeps of a mirrored pod.
#[derive(Debug)]
pub struct MirrorPort {
    sides: MirrorSides,
    ids: Option<Ids>,
    known: [Arc<Known>; 4],
    /// Where the host's words are pulled into, per pool (this port's own).
    scratch: [SharedRegion; 4],
    /// Where the pod's bell word is pulled into.
    bell: SharedRegion,
    /// RX SQ entries pushed so far, and the TX SQ position pushed last.
    rx_pushed: u64,
    tx_pushed: u64,
}

#[derive(Debug, Clone, Copy)]
struct Ids {
    pools: [RemoteId; 4],
    tx_sq: RemoteId,
    rx_sq: RemoteId,
    bell: RemoteId,
}

fn owner(word: u64) -> u32 {
    word as u32
}

/// Whether the manager holds the slot for itself (never pushed to the host).
fn held_here(word: u64) -> bool {
    let o = owner(word);
    o == OwnerId::DMA.0 || o == OwnerId::PROXY.0 || o == OwnerId::FABRIC.0
}

/// What the mirror's word becomes after a pull: the host's, unless a change of the
/// manager's own is pending.
pub(crate) fn merged(mirror: u64, known: u64, host: u64) -> Option<u64> {
    (mirror == known && host != mirror).then_some(host)
}

/// Whether the mirror's word must be pushed: the manager gave the slot to a pod.
pub(crate) fn to_push(mirror: u64, known: u64) -> bool {
    mirror != known && owner(mirror) != 0 && !held_here(mirror)
}

impl MirrorPort {
    /// A port over `pools` (the mirrors, in [`MirrorSides::pools`] order) standing for
    /// `sides`; `known` is shared with the pod's ports on the other shards.
    pub fn new(
        sides: MirrorSides,
        pools: [&BufferPool; 4],
        known: [Arc<Known>; 4],
    ) -> Result<Self, crate::shm::ShmError> {
        let scratch = |p: &BufferPool| {
            let (offset, len) = p.words_range();
            SharedRegion::create_sealed("dpumesh-mirror-words", (offset + len) as usize)
        };
        Ok(Self {
            sides,
            ids: None,
            known,
            scratch: [
                scratch(pools[0])?,
                scratch(pools[1])?,
                scratch(pools[2])?,
                scratch(pools[3])?,
            ],
            bell: SharedRegion::create_sealed("dpumesh-mirror-bell", crate::bell::BELL_LEN)?,
            rx_pushed: 0,
            tx_pushed: 0,
        })
    }

    /// Takes the pod's regions into `reach` and aliases the mirror pools to them.
    pub(super) fn adopt(
        &mut self,
        reach: &mut dyn Reach,
        pools: [&BufferPool; 4],
    ) -> Result<(), DmaError> {
        let mut taken = Vec::new();
        let mut take = |side: &RemoteSide, reach: &mut dyn Reach| {
            let id = reach.adopt(side)?;
            taken.push(id);
            Ok::<_, DmaError>(id)
        };
        let result = (|| {
            let ids = Ids {
                pools: [
                    take(&self.sides.pools[0], reach)?,
                    take(&self.sides.pools[1], reach)?,
                    take(&self.sides.pools[2], reach)?,
                    take(&self.sides.pools[3], reach)?,
                ],
                tx_sq: take(&self.sides.tx_sq, reach)?,
                rx_sq: take(&self.sides.rx_sq, reach)?,
                bell: take(&self.sides.bell, reach)?,
            };
            Ok::<_, DmaError>(ids)
        })();
        match result {
            Ok(ids) => {
                for (pool, id) in pools.iter().zip(ids.pools) {
                    reach.alias(pool.region(), id);
                }
                self.ids = Some(ids);
                Ok(())
            }
            Err(e) => {
                for id in taken {
                    reach.release(id);
                }
                Err(e)
            }
        }
    }

    /// Lets go of the pod's regions.
    pub(super) fn release(&mut self, reach: &mut dyn Reach) {
        if let Some(ids) = self.ids.take() {
            for id in ids
                .pools
                .into_iter()
                .chain([ids.tx_sq, ids.rx_sq, ids.bell])
            {
                reach.release(id);
            }
        }
    }

    /// Brings the mirrors up to the host: the TX SQ's next entries, the RX SQ's
    /// `head` and `waiting`, the pools' words (one pull, every range in it).
    pub(super) fn pull(
        &mut self,
        reach: &mut dyn Reach,
        tx_sq: &Consumer,
        rx_sq: &Producer,
        pools: [&BufferPool; 4],
    ) -> Result<(), DmaError> {
        let Some(ids) = self.ids else { return Ok(()) };
        let tx = tx_sq.ring();
        let mut ranges: Vec<SyncRange<'_>> = Vec::with_capacity(8);
        for (offset, len) in tx.entry_ranges(tx_sq.position(), BUDGET as u32) {
            if len > 0 {
                ranges.push(SyncRange {
                    remote: ids.tx_sq,
                    local: tx.region(),
                    offset,
                    len,
                });
            }
        }
        // The pod's position and its waiting word: the HEAD and WAKE lines (the TAIL
        // line before them is the manager's).
        ranges.push(SyncRange {
            remote: ids.rx_sq,
            local: rx_sq.ring().region(),
            offset: HEAD,
            len: WAKE + LINE - HEAD,
        });
        for (k, pool) in pools.iter().enumerate() {
            let (offset, len) = pool.words_range();
            ranges.push(SyncRange {
                remote: ids.pools[k],
                local: &self.scratch[k],
                offset,
                len,
            });
        }
        reach.pull(&ranges)?;
        for (k, pool) in pools.iter().enumerate() {
            let (offset, _) = pool.words_range();
            let host = self.scratch[k]
                .atomic_u64s(offset, pool.words().len())
                .map_err(DmaError::Bounds)?;
            for ((word, known), h) in pool.words().iter().zip(&self.known[k].0).zip(host) {
                let h = h.load(Ordering::Relaxed);
                let m = word.load(Ordering::Acquire);
                let k = known.load(Ordering::Acquire);
                if let Some(new) = merged(m, k, h)
                    && word
                        .compare_exchange(m, new, Ordering::AcqRel, Ordering::Relaxed)
                        .is_ok()
                {
                    known.store(new, Ordering::Release);
                }
            }
        }
        Ok(())
    }

    /// Brings the host up to the mirrors: the words of slots given to a pod, then the
    /// RX SQ's new entries (and `tail`) with the TX SQ's position; wakes the pod when
    /// it got entries and its `waiting` word, read after they landed, says it sleeps.
    /// Returns whether the pod got entries.
    pub(super) fn push(
        &mut self,
        reach: &mut dyn Reach,
        pod: u32,
        tx_sq: &Consumer,
        rx_sq: &Producer,
        pools: [&BufferPool; 4],
    ) -> Result<bool, DmaError> {
        let Some(ids) = self.ids else {
            return Ok(false);
        };
        // 1. Words: from the scratch copy (the value pushed is the value made known,
        //    whatever another shard does to the mirror meanwhile).
        let mut words: Vec<SyncRange<'_>> = Vec::new();
        for (k, pool) in pools.iter().enumerate() {
            let (offset, _) = pool.words_range();
            for (i, (word, known)) in pool.words().iter().zip(&self.known[k].0).enumerate() {
                let m = word.load(Ordering::Acquire);
                if to_push(m, known.load(Ordering::Acquire)) {
                    let at = offset + 8 * i as u64;
                    self.scratch[k]
                        .atomic_u64s(at, 1)
                        .map_err(DmaError::Bounds)?[0]
                        .store(m, Ordering::Relaxed);
                    known.store(m, Ordering::Release);
                    match words.last_mut() {
                        Some(last)
                            if last.remote == ids.pools[k] && last.offset + last.len == at =>
                        {
                            last.len += 8
                        }
                        _ => words.push(SyncRange {
                            remote: ids.pools[k],
                            local: &self.scratch[k],
                            offset: at,
                            len: 8,
                        }),
                    }
                }
            }
        }
        if !words.is_empty() {
            reach.push(&words)?;
        }
        // 2. Entries (their slots' words landed first), and the TX SQ's position.
        let rx = rx_sq.ring();
        let tail = rx_sq.position();
        let fresh = tail.wrapping_sub(self.rx_pushed);
        let mut ranges: Vec<SyncRange<'_>> = Vec::with_capacity(3);
        if fresh > 0 {
            for (offset, len) in rx.entry_ranges(self.rx_pushed, fresh as u32) {
                if len > 0 {
                    ranges.push(SyncRange {
                        remote: ids.rx_sq,
                        local: rx.region(),
                        offset,
                        len,
                    });
                }
            }
        }
        let head = tx_sq.position();
        if head != self.tx_pushed {
            ranges.push(SyncRange {
                remote: ids.tx_sq,
                local: tx_sq.ring().region(),
                offset: HEAD,
                len: 8,
            });
        }
        if ranges.is_empty() {
            return Ok(false);
        }
        reach.push(&ranges)?;
        self.tx_pushed = head;
        if fresh == 0 {
            return Ok(false);
        }
        self.rx_pushed = tail;
        // 3. The tail (for the pod's depth count), and the pod's `waiting` word read
        //    after its entries landed: either it saw them or it said it sleeps.
        reach.push(&[SyncRange {
            remote: ids.rx_sq,
            local: rx.region(),
            offset: TAIL,
            len: 8,
        }])?;
        reach.pull(&[
            SyncRange {
                remote: ids.rx_sq,
                local: rx.region(),
                offset: WAKE,
                len: LINE,
            },
            SyncRange {
                remote: ids.bell,
                local: &self.bell,
                offset: 0,
                len: 8,
            },
        ])?;
        let on_bell =
            self.bell.atomic_u32s(0, 1).map_err(DmaError::Bounds)?[0].load(Ordering::Acquire) != 0;
        if rx.consumer_waits() || on_bell {
            match &self.sides.host_wake {
                Some(wake) => wake(),
                None => reach.wake(pod),
            }
        }
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(generation: u32, owner: u32) -> u64 {
        (generation as u64) << 32 | owner as u64
    }

    #[test]
    fn a_word_follows_the_host_unless_the_manager_changed_it() {
        let pod = 7;
        // The pod allocated a TX slot: the mirror takes it.
        assert_eq!(merged(w(1, 0), w(1, 0), w(2, pod)), Some(w(2, pod)));
        // The manager claimed it (DMA): kept, and never pushed.
        assert_eq!(merged(w(2, OwnerId::DMA.0), w(2, pod), w(2, pod)), None);
        assert!(!to_push(w(2, OwnerId::DMA.0), w(2, pod)));
        // Handed back to the pod: mirror and host agree again; the pod frees it.
        assert!(!to_push(w(2, pod), w(2, pod)));
        assert_eq!(merged(w(2, pod), w(2, pod), w(2, 0)), Some(w(2, 0)));
        // The manager gave an RX slot to the pod: pushed, then the pod's free follows.
        assert!(to_push(w(5, pod), w(4, 0)));
        assert_eq!(
            merged(w(5, pod), w(4, 0), w(4, 0)),
            None,
            "pending: not undone by a stale pull"
        );
        assert_eq!(merged(w(5, pod), w(5, pod), w(5, 0)), Some(w(5, 0)));
        // A slot the manager held for the fabric and freed again: nothing to push.
        assert!(!to_push(w(6, 0), w(5, 0)));
        assert!(!to_push(w(6, OwnerId::FABRIC.0), w(5, 0)));
        assert!(!to_push(w(6, OwnerId::PROXY.0), w(5, 0)));
    }
}

//! Single-producer/single-consumer descriptor rings in shared memory: the host TX and
//! RX SQs (pod ↔ DPU) and the DPU sidecar TX and RX SQs (DMA manager ↔ proxy).
//!
//! Each entry is one 64-byte descriptor stored as eight atomic words. The producer
//! writes words 0–6, then word 7 (whose high half is the descriptor's `valid`) with
//! release ordering; `valid` carries a tag of the entry's lap (`lap << 1 | 1`), so a
//! consumer that loads word 7 with acquire and finds the tag it expects has the whole
//! descriptor, and a stale entry from the previous lap never looks fresh. The consumer
//! publishes its position after reading; the producer never writes an entry the
//! consumer has not passed, so a full ring is reported to the caller, never
//! overwritten.
//!
//! Two wake modes, as FreeFlow has: [`WakeMode::Poll`] spins (lowest latency, a core
//! per consumer) and [`WakeMode::Event`] spins adaptively and then sleeps on a futex
//! in the ring's shared header, which the producer wakes only when the consumer said
//! it is asleep (a store–fence–load handshake on both sides, so no wake-up is lost).
//! Futexes on `MAP_SHARED` memory work across processes without passing descriptors.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering, fence};
use std::time::{Duration, Instant};

use crate::bell::Bell;
use crate::descriptor::{DESCRIPTOR_SIZE, Descriptor, DescriptorError, RawDescriptor};
use crate::shm::{SharedRegion, ShmError};

const MAGIC: u32 = u32::from_le_bytes(*b"DPRG");
const VERSION: u32 = 1;
/// Header lines: [magic/version/capacity], [tail], [head], [waiting, wake].
pub(crate) const LINE: u64 = 64;
pub(crate) const TAIL: u64 = LINE;
pub(crate) const HEAD: u64 = 2 * LINE;
pub(crate) const WAKE: u64 = 3 * LINE;
const ENTRIES: u64 = 4 * LINE;

/// How a consumer waits for entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WakeMode {
    /// Busy-poll: never sleeps.
    Poll,
    /// Spin for about `spin` (then yield a little), then sleep until woken.
    Event {
        /// How long to spin before sleeping.
        spin: Duration,
    },
}

impl WakeMode {
    /// Event mode with a short spin (a few microseconds), FreeFlow's low-CPU path.
    pub const LOW_CPU: WakeMode = WakeMode::Event {
        spin: Duration::from_micros(20),
    };
}

/// Why a ring operation failed.
#[derive(Debug, thiserror::Error)]
pub enum RingError {
    /// The region is not usable.
    #[error(transparent)]
    Shm(#[from] ShmError),
    /// The region holds no ring of this version.
    #[error(
        "region {region} holds no descriptor ring (magic {magic:#x}, version {version}; expected version {VERSION})"
    )]
    NotARing {
        /// The region's name.
        region: String,
        /// The magic found.
        magic: u32,
        /// The version found.
        version: u32,
    },
    /// Capacity must be a power of two between 2 and 2^24.
    #[error("ring capacity {0} must be a power of two between 2 and 16777216")]
    Capacity(u32),
    /// The ring is full: back-pressure for the caller; nothing was written.
    #[error("ring {region} is full ({capacity} descriptors in flight)")]
    Full {
        /// The region's name.
        region: String,
        capacity: u32,
    },
    /// An entry that does not decode. It was consumed (so the ring keeps moving) and
    /// its reason is reported.
    #[error("ring {region} entry {position}: {source}")]
    BadDescriptor {
        /// The region's name.
        region: String,
        /// The entry's position.
        position: u64,
        #[source]
        source: DescriptorError,
    },
}

/// A ring's shared memory and layout; both ends are built on one.
#[derive(Debug, Clone)]
pub struct Ring {
    region: Arc<SharedRegion>,
    capacity: u32,
    mask: u64,
    shift: u32,
}

/// Bytes of shared memory a ring of `capacity` entries needs.
pub fn ring_len(capacity: u32) -> usize {
    (ENTRIES + capacity as u64 * DESCRIPTOR_SIZE as u64) as usize
}

fn lap_tag(position: u64, shift: u32) -> u32 {
    (((position >> shift) as u32) << 1) | 1
}

impl Ring {
    /// Lays a ring of `capacity` entries (a power of two) over a fresh region.
    pub fn create(region: Arc<SharedRegion>, capacity: u32) -> Result<Self, RingError> {
        if !capacity.is_power_of_two() || !(2..=1 << 24).contains(&capacity) {
            return Err(RingError::Capacity(capacity));
        }
        if region.len() < ring_len(capacity) {
            return Err(RingError::Shm(ShmError::OutOfBounds {
                name: region.name().to_owned(),
                offset: 0,
                len: ring_len(capacity) as u64,
                size: region.len(),
            }));
        }
        region.atomic_u64s(8, 1)?[0].store(capacity as u64, Ordering::Relaxed);
        // The magic goes last: a process that attaches sees a whole header or none.
        region.atomic_u64s(0, 1)?[0]
            .store(MAGIC as u64 | (VERSION as u64) << 32, Ordering::Release);
        Self::attach(region)
    }

    /// Creates a region for a ring and lays the ring over it.
    pub fn create_in_shm(prefix: &str, capacity: u32) -> Result<Self, RingError> {
        if !capacity.is_power_of_two() || !(2..=1 << 24).contains(&capacity) {
            return Err(RingError::Capacity(capacity));
        }
        let region = SharedRegion::create_unique(prefix, ring_len(capacity))?;
        Self::create(Arc::new(region), capacity)
    }

    /// Creates a sealed region for a ring (shared by its descriptor, see
    /// [`SharedRegion::create_sealed`]) and lays the ring over it.
    pub fn create_sealed(name: &str, capacity: u32) -> Result<Self, RingError> {
        if !capacity.is_power_of_two() || !(2..=1 << 24).contains(&capacity) {
            return Err(RingError::Capacity(capacity));
        }
        let region = SharedRegion::create_sealed(name, ring_len(capacity))?;
        Self::create(Arc::new(region), capacity)
    }

    /// Attaches to a ring another process created.
    pub fn attach(region: Arc<SharedRegion>) -> Result<Self, RingError> {
        let head = region.atomic_u64s(0, 1)?[0].load(Ordering::Acquire);
        let (magic, version) = (head as u32, (head >> 32) as u32);
        if magic != MAGIC || version != VERSION {
            return Err(RingError::NotARing {
                region: region.name().to_owned(),
                magic,
                version,
            });
        }
        let capacity = region.atomic_u64s(8, 1)?[0].load(Ordering::Relaxed) as u32;
        if !capacity.is_power_of_two() || !(2..=1 << 24).contains(&capacity) {
            return Err(RingError::Capacity(capacity));
        }
        if region.len() < ring_len(capacity) {
            return Err(RingError::Shm(ShmError::OutOfBounds {
                name: region.name().to_owned(),
                offset: 0,
                len: ring_len(capacity) as u64,
                size: region.len(),
            }));
        }
        Ok(Self {
            region,
            capacity,
            mask: capacity as u64 - 1,
            shift: capacity.trailing_zeros(),
        })
    }

    /// The shared region.
    pub fn region(&self) -> &Arc<SharedRegion> {
        &self.region
    }

    /// Entries the ring holds.
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    fn word(&self, offset: u64) -> &AtomicU64 {
        &self
            .region
            .atomic_u64s(offset, 1)
            .expect("checked at attach")[0]
    }

    fn entry(&self, position: u64) -> &[AtomicU64] {
        let offset = ENTRIES + (position & self.mask) * DESCRIPTOR_SIZE as u64;
        self.region
            .atomic_u64s(offset, 8)
            .expect("checked at attach")
    }

    /// The byte ranges (offset, length) of `count` entries from `position` on, in
    /// order: one range, or two where they wrap.
    pub(crate) fn entry_ranges(&self, position: u64, count: u32) -> [(u64, u64); 2] {
        let count = u64::from(count.min(self.capacity));
        let first = position & self.mask;
        let before_wrap = count.min(self.capacity as u64 - first);
        let size = DESCRIPTOR_SIZE as u64;
        [
            (ENTRIES + first * size, before_wrap * size),
            (ENTRIES, (count - before_wrap) * size),
        ]
    }

    /// Whether the consumer said it sleeps (its `waiting` word).
    pub(crate) fn consumer_waits(&self) -> bool {
        self.waiting().load(Ordering::Acquire) != 0
    }

    fn waiting(&self) -> &AtomicU32 {
        &self.region.atomic_u32s(WAKE, 2).expect("checked at attach")[0]
    }

    fn wake_seq(&self) -> &AtomicU32 {
        &self.region.atomic_u32s(WAKE, 2).expect("checked at attach")[1]
    }

    /// How many descriptors the consumer has taken so far (its read position): one
    /// that does not move while the ring holds descriptors is a consumer not reading.
    pub fn consumed(&self) -> u64 {
        self.word(HEAD).load(Ordering::Acquire)
    }

    /// Descriptors published and not yet consumed (a snapshot; for metrics).
    pub fn depth(&self) -> u32 {
        let tail = self.word(TAIL).load(Ordering::Acquire);
        let head = self.word(HEAD).load(Ordering::Acquire);
        tail.wrapping_sub(head).min(self.capacity as u64) as u32
    }

    /// The producing end. Exactly one process may hold it.
    pub fn producer(&self) -> Producer {
        let tail = self.word(TAIL).load(Ordering::Acquire);
        let head = self.word(HEAD).load(Ordering::Acquire);
        Producer {
            ring: self.clone(),
            tail,
            head_cache: head,
            bell: None,
            notify: None,
            wake: None,
        }
    }

    /// The consuming end. Exactly one process may hold it.
    pub fn consumer(&self) -> Consumer {
        let head = self.word(HEAD).load(Ordering::Acquire);
        Consumer {
            ring: self.clone(),
            head,
            interrupted: Arc::new(AtomicBool::new(false)),
        }
    }
}

/// The producing end of a ring.
#[derive(Debug)]
pub struct Producer {
    ring: Ring,
    tail: u64,
    head_cache: u64,
    bell: Option<Bell>,
    notify: Option<crate::bell::Interrupter>,
    /// The ring whose wake words a sleeping consumer waits on, if not this one's (a
    /// pod's RX lanes all wake through the first lane's words: the pod sleeps on one
    /// futex for all of them).
    wake: Option<Ring>,
}

impl Producer {
    /// Wakes the consumer through `ring`'s wake words instead of this ring's: for a
    /// consumer that waits on several rings with [`Consumer::wait_any`] on `ring`'s.
    pub fn wakes_through(mut self, ring: Ring) -> Self {
        self.wake = Some(ring);
        self
    }

    /// Also calls `notify` after each publish (for a consumer that sleeps on something
    /// else, e.g. a proxy sleeping on its fabric completion queue).
    pub fn with_notify(mut self, notify: crate::bell::Interrupter) -> Self {
        self.notify = Some(notify);
        self
    }

    /// Also rings `bell` after each publish (for a consumer that watches many rings
    /// and sleeps on its bell: a shard of a node's proxy).
    pub fn with_bell(mut self, bell: Bell) -> Self {
        self.bell = Some(bell);
        self
    }

    pub fn ring(&self) -> &Ring {
        &self.ring
    }

    /// How many descriptors it has published so far (its write position).
    pub(crate) fn position(&self) -> u64 {
        self.tail
    }

    /// Room for more descriptors right now (none if the consumer's position is not
    /// believable: another process writes it).
    pub fn free(&mut self) -> u32 {
        self.head_cache = self.ring.word(HEAD).load(Ordering::Acquire);
        let used = self.tail.wrapping_sub(self.head_cache);
        (self.ring.capacity as u64).saturating_sub(used) as u32
    }

    /// Publishes a descriptor and wakes a sleeping consumer. A full ring is reported
    /// and nothing is written.
    pub fn push(&mut self, descriptor: &Descriptor) -> Result<(), RingError> {
        self.push_raw(&descriptor.to_raw())
    }

    /// Publishes raw bytes as they are (tests use it to put garbage in a ring).
    pub fn push_raw(&mut self, raw: &RawDescriptor) -> Result<(), RingError> {
        self.write(raw)?;
        self.notify();
        Ok(())
    }

    /// Publishes a descriptor without waking the consumer: the caller batches wake-ups
    /// and calls [`Producer::wake`] once for everything it published (a consumer that
    /// polls sees the entry at once either way). A full ring is reported.
    pub fn push_quietly(&mut self, descriptor: &Descriptor) -> Result<(), RingError> {
        self.write(&descriptor.to_raw())
    }

    /// Wakes the consumer if it sleeps (after [`Producer::push_quietly`]).
    pub fn wake(&self) {
        self.notify();
    }

    /// Publishes several descriptors, then wakes the consumer once. Stops at the first
    /// that does not fit; returns how many were published.
    pub fn push_batch(&mut self, descriptors: &[Descriptor]) -> usize {
        let mut done = 0;
        for d in descriptors {
            if self.write(&d.to_raw()).is_err() {
                break;
            }
            done += 1;
        }
        if done > 0 {
            self.notify();
        }
        done
    }

    fn write(&mut self, raw: &RawDescriptor) -> Result<(), RingError> {
        let capacity = self.ring.capacity as u64;
        // Wrapping: a consumer in another process may have written anything into its
        // position; a head past our tail counts as full, never as room.
        if self.tail.wrapping_sub(self.head_cache) >= capacity {
            self.head_cache = self.ring.word(HEAD).load(Ordering::Acquire);
            if self.tail.wrapping_sub(self.head_cache) >= capacity {
                return Err(RingError::Full {
                    region: self.ring.region.name().to_owned(),
                    capacity: self.ring.capacity,
                });
            }
        }
        let mut raw = *raw;
        raw.valid = lap_tag(self.tail, self.ring.shift);
        let words = raw.to_words();
        let entry = self.ring.entry(self.tail);
        for i in 0..7 {
            entry[i].store(words[i], Ordering::Relaxed);
        }
        // The last word carries `valid`: publishing it releases the other seven.
        entry[7].store(words[7], Ordering::Release);
        self.tail += 1;
        self.ring.word(TAIL).store(self.tail, Ordering::Release);
        Ok(())
    }

    fn notify(&self) {
        if let Some(bell) = &self.bell {
            bell.ring();
        }
        if let Some(notify) = &self.notify {
            notify.interrupt();
        }
        // Pairs with the consumer's fence between raising `waiting` and re-checking
        // the ring: either it sees our entry, or we see it waiting.
        fence(Ordering::SeqCst);
        let ring = self.wake.as_ref().unwrap_or(&self.ring);
        if ring.waiting().load(Ordering::Relaxed) != 0 {
            ring.wake_seq().fetch_add(1, Ordering::Release);
            let _ = rustix::thread::futex::wake(
                ring.wake_seq(),
                rustix::thread::futex::Flags::empty(),
                1,
            );
        }
    }
}

/// The consuming end of a ring.
#[derive(Debug)]
pub struct Consumer {
    ring: Ring,
    head: u64,
    /// Set by [`Consumer::interrupter`]s: the current or next wait returns.
    interrupted: Arc<AtomicBool>,
}

impl Consumer {
    /// A handle that makes this consumer's [`Consumer::wait`] return early (from any
    /// thread of this process), e.g. when other work for the waiting thread came up.
    pub fn interrupter(&self) -> crate::bell::Interrupter {
        let ring = self.ring.clone();
        let flag = self.interrupted.clone();
        crate::bell::Interrupter::new(move || {
            flag.store(true, Ordering::SeqCst);
            // Pairs with the waiter's fence between raising `waiting` and its last look
            // at the flag: either it sees the flag, or we see it waiting. A consumer
            // that is awake costs an interrupt no system call.
            fence(Ordering::SeqCst);
            if ring.waiting().load(Ordering::Relaxed) != 0 {
                ring.wake_seq().fetch_add(1, Ordering::Release);
                let _ = rustix::thread::futex::wake(
                    ring.wake_seq(),
                    rustix::thread::futex::Flags::empty(),
                    i32::MAX as u32,
                );
            }
        })
    }

    /// Whether an interrupter fired since the last look (consuming it); also for a
    /// consumer that sleeps elsewhere than [`Consumer::wait`] (a reactor, on a bell).
    pub fn take_interrupted(&self) -> bool {
        self.interrupted.load(Ordering::Relaxed) && self.interrupted.swap(false, Ordering::SeqCst)
    }

    pub fn ring(&self) -> &Ring {
        &self.ring
    }

    /// How many descriptors it has taken so far (its read position).
    pub(crate) fn position(&self) -> u64 {
        self.head
    }

    /// Whether a descriptor is published and waiting (without taking it).
    pub fn has_next(&self) -> bool {
        self.ready()
    }

    fn ready(&self) -> bool {
        let tag = lap_tag(self.head, self.ring.shift);
        let last = self.ring.entry(self.head)[7].load(Ordering::Acquire);
        (last >> 32) as u32 == tag
    }

    /// Takes the next descriptor if one is published. A descriptor that does not
    /// decode is consumed and reported.
    pub fn try_pop(&mut self) -> Result<Option<Descriptor>, RingError> {
        match self.try_pop_raw() {
            None => Ok(None),
            Some((position, raw)) => {
                Descriptor::from_raw(&raw)
                    .map(Some)
                    .map_err(|source| RingError::BadDescriptor {
                        region: self.ring.region.name().to_owned(),
                        position,
                        source,
                    })
            }
        }
    }

    /// Takes the next entry as raw bytes, with its position.
    pub fn try_pop_raw(&mut self) -> Option<(u64, RawDescriptor)> {
        let tag = lap_tag(self.head, self.ring.shift);
        let entry = self.ring.entry(self.head);
        let last = entry[7].load(Ordering::Acquire);
        if (last >> 32) as u32 != tag {
            return None;
        }
        let mut words = [0u64; 8];
        for i in 0..7 {
            words[i] = entry[i].load(Ordering::Relaxed);
        }
        words[7] = last;
        let position = self.head;
        self.head += 1;
        // Release: our reads of the entry happen before the producer may reuse it.
        self.ring.word(HEAD).store(self.head, Ordering::Release);
        Some((position, RawDescriptor::from_words(&words)))
    }

    /// Waits up to `timeout` for a descriptor, as `mode` says.
    pub fn pop_wait(
        &mut self,
        mode: WakeMode,
        timeout: Duration,
    ) -> Result<Option<Descriptor>, RingError> {
        if self.wait(mode, timeout) {
            self.try_pop()
        } else {
            Ok(None)
        }
    }

    /// Waits up to `timeout` until a descriptor is ready (without taking it); true if
    /// one is.
    pub fn wait(&self, mode: WakeMode, timeout: Duration) -> bool {
        self.wait_until(|| self.ready(), mode, timeout)
    }

    /// Waits up to `timeout` until this ring or one of `others` has a descriptor ready;
    /// true if one has. The others' producers must wake through this ring
    /// ([`Producer::wakes_through`]): one futex covers them all.
    pub fn wait_any(&self, others: &[Consumer], mode: WakeMode, timeout: Duration) -> bool {
        self.wait_until(
            || self.ready() || others.iter().any(Consumer::ready),
            mode,
            timeout,
        )
    }

    fn wait_until(&self, ready: impl Fn() -> bool, mode: WakeMode, timeout: Duration) -> bool {
        if ready() {
            return true;
        }
        let started = Instant::now();
        let spin = match mode {
            WakeMode::Poll => timeout,
            WakeMode::Event { spin } => spin.min(timeout),
        };
        // Spin, checking the clock only every 64 rounds.
        let mut rounds = 0u32;
        loop {
            for _ in 0..64 {
                if ready() {
                    return true;
                }
                std::hint::spin_loop();
            }
            if self.take_interrupted() {
                return ready();
            }
            rounds += 1;
            if started.elapsed() >= spin {
                break;
            }
            // On few cores the producer may need ours: yield now and then.
            if rounds.is_multiple_of(16) {
                std::thread::yield_now();
            }
        }
        if matches!(mode, WakeMode::Poll) {
            return ready();
        }
        loop {
            let remaining = match timeout.checked_sub(started.elapsed()) {
                Some(r) if !r.is_zero() => r,
                _ => return ready(),
            };
            let seen = self.ring.wake_seq().load(Ordering::Acquire);
            self.ring.waiting().store(1, Ordering::Relaxed);
            fence(Ordering::SeqCst);
            if ready() {
                self.ring.waiting().store(0, Ordering::Relaxed);
                return true;
            }
            if self.take_interrupted() {
                self.ring.waiting().store(0, Ordering::Relaxed);
                return ready();
            }
            let ts = rustix::fs::Timespec {
                tv_sec: remaining.as_secs() as i64,
                tv_nsec: remaining.subsec_nanos() as i64,
            };
            // EAGAIN (the producer woke us between our load and the wait), EINTR and
            // timeouts all lead back to the check above.
            let _ = rustix::thread::futex::wait(
                self.ring.wake_seq(),
                rustix::thread::futex::Flags::empty(),
                seen,
                Some(&ts),
            );
            self.ring.waiting().store(0, Ordering::Relaxed);
            if ready() {
                return true;
            }
        }
    }
}

#[cfg(test)]
mod tests;

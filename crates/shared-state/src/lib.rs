//! Node-wide shared state for filters.
//!
//! Every worker thread of a proxy runs its own filter instances, but a rate limit or a
//! circuit breaker must see node-wide truth. This crate is the store behind the
//! `shared-state` WIT import: integers with time-to-live, compare-and-swap, and an
//! atomic token-bucket take, in a sharded [`DashMap`] so workers rarely contend.
//!
//! Each operation is atomic for its key (it runs under the key's shard lock), and the
//! decisions are made whole inside one call, so guests never loop on compare-and-swap.
//! Keys are namespaced: a [`Namespace`] (one per filter) can only reach its own keys.
//! Expired entries are removed lazily on access and by [`SharedState::sweep_expired`].
//! A full store makes room for a new key by evicting an entry with a time-to-live that
//! was not used lately (CLOCK over the keys in the order they came: an entry used
//! since the hand last passed gets a second chance), the way HAProxy's stick tables
//! drop their oldest entries: a flood of new keys (rate-limit subjects) costs the
//! idle ones their state, not the limit its effect. Entries without a time-to-live
//! and byte values are never evicted: past them the store refuses new keys rather
//! than growing without bound.

#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use dashmap::DashMap;
use dashmap::mapref::entry::Entry as MapEntry;
use dpumesh_clock::SharedClock;

/// A full store sweeps at most this often (see [`SharedState::sweep_expired`]'s
/// callers): a sweep of a million entries takes milliseconds.
pub const FULL_SWEEP_GAP_MS: u64 = 250;

/// Keys the eviction hand looks at for one new key, at most: past that the key is
/// refused this time (every entry the hand passed lost its second chance, so the next
/// new key finds one to evict).
const EVICTION_LOOKS: usize = 64;

/// Longest key a filter may use, in bytes.
pub const MAX_KEY_LEN: usize = 256;

/// Why a shared-state operation failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum StateError {
    /// The key is empty or longer than [`MAX_KEY_LEN`].
    #[error("shared-state key must be 1..={MAX_KEY_LEN} bytes")]
    InvalidKey,
    /// The key holds a value of the other kind (integer vs token bucket).
    #[error("shared-state key holds a value of another kind")]
    WrongType,
    /// The store is at capacity even after sweeping expired entries.
    #[error("shared-state store is full")]
    Full,
}

/// Limits of the store.
#[derive(Debug, Clone, Copy)]
pub struct StateLimits {
    /// Most live entries across all namespaces.
    pub max_entries: usize,
}

impl Default for StateLimits {
    fn default() -> Self {
        // ~100 bytes an entry: 1M entries is ~100 MiB on an Arm core's node, the most a
        // DPU should spend on policy state.
        Self {
            max_entries: 1_000_000,
        }
    }
}

/// The result of [`Namespace::token_bucket_take`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketResult {
    /// Whether the tokens were taken.
    pub allowed: bool,
    /// Tokens left after the call.
    pub remaining: u64,
    /// Milliseconds until the next refill.
    pub reset_after_ms: u64,
}

/// Parameters of a token bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketSpec {
    /// Most tokens the bucket holds; it starts full.
    pub capacity: u64,
    /// Tokens added per whole interval.
    pub refill_tokens: u64,
    /// Length of an interval in milliseconds (0 is treated as 1).
    pub refill_interval_ms: u64,
}

#[derive(Debug, Clone, Copy)]
enum Value {
    Int(i64),
    Bucket { tokens: u64, last_refill_ms: u64 },
}

#[derive(Debug, Clone, Copy)]
struct Slot {
    value: Value,
    /// Monotonic milliseconds at which the entry expires; 0 = never.
    expires_at_ms: u64,
    /// Used since the eviction hand last passed it.
    used: bool,
}

impl Slot {
    fn live(&self, now_ms: u64) -> bool {
        self.expires_at_ms == 0 || now_ms < self.expires_at_ms
    }
}

type Key = (u32, Box<str>);

/// A byte value and its version (never 0).
pub type Versioned = (Arc<[u8]>, u32);

/// The node-wide store. Cheap to share: wrap it in an [`Arc`].
#[derive(Debug)]
pub struct SharedState {
    entries: DashMap<Key, Slot>,
    /// Byte values with a version (proxy-wasm's shared data), beside the typed ones.
    bytes: DashMap<Key, Versioned>,
    /// The next version handed out; never 0 (0 means "no version" to proxy-wasm).
    next_cas: AtomicU32,
    live: AtomicUsize,
    /// When a full store may sweep again (monotonic ms): no sooner than the earliest
    /// expiry the last sweep kept, and [`FULL_SWEEP_GAP_MS`] after it.
    next_sweep: AtomicU64,
    /// Sweeps done so far.
    sweeps: AtomicU64,
    /// The eviction hand's queue: typed keys in the order they came (a key may be
    /// there twice, or gone from the store: the hand skips those).
    clock_hand: Mutex<VecDeque<Key>>,
    /// Entries evicted so far.
    evictions: AtomicU64,
    namespaces: DashMap<Box<str>, u32>,
    next_namespace: AtomicU32,
    clock: SharedClock,
    limits: StateLimits,
}

impl SharedState {
    /// An empty store reading time from `clock`.
    pub fn new(clock: SharedClock, limits: StateLimits) -> Arc<Self> {
        Arc::new(Self {
            entries: DashMap::new(),
            bytes: DashMap::new(),
            next_cas: AtomicU32::new(1),
            live: AtomicUsize::new(0),
            next_sweep: AtomicU64::new(0),
            sweeps: AtomicU64::new(0),
            clock_hand: Mutex::new(VecDeque::new()),
            evictions: AtomicU64::new(0),
            namespaces: DashMap::new(),
            next_namespace: AtomicU32::new(0),
            clock,
            limits,
        })
    }

    /// The namespace `name` (a filter's name). The same name always reaches the same keys.
    pub fn namespace(self: &Arc<Self>, name: &str) -> Namespace {
        let id = *self
            .namespaces
            .entry(name.into())
            .or_insert_with(|| self.next_namespace.fetch_add(1, Ordering::Relaxed));
        Namespace {
            state: Arc::clone(self),
            id,
        }
    }

    /// Number of entries held (live or expired but not yet swept).
    pub fn len(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }

    /// Whether the store holds no entries.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Removes every expired entry; returns how many were removed.
    pub fn sweep_expired(&self) -> usize {
        let now = self.clock.monotonic_ms();
        let mut removed = 0;
        let mut earliest = u64::MAX;
        self.entries.retain(|_, slot| {
            let keep = slot.live(now);
            if !keep {
                removed += 1;
            } else if slot.expires_at_ms != 0 {
                earliest = earliest.min(slot.expires_at_ms);
            }
            keep
        });
        self.live.fetch_sub(removed, Ordering::Relaxed);
        self.sweeps.fetch_add(1, Ordering::Relaxed);
        self.next_sweep.store(
            earliest.max(now.saturating_add(FULL_SWEEP_GAP_MS)),
            Ordering::Relaxed,
        );
        removed
    }

    /// Sweeps done so far (by [`SharedState::sweep_expired`], whoever called it).
    pub fn sweeps(&self) -> u64 {
        self.sweeps.load(Ordering::Relaxed)
    }

    /// Entries evicted so far to make room for new keys.
    pub fn evictions(&self) -> u64 {
        self.evictions.load(Ordering::Relaxed)
    }

    /// Evicts one entry with a time-to-live not used since the hand last passed it;
    /// whether one was. Runs before the new key's shard is locked (it locks others).
    fn evict_one(&self) -> bool {
        let now = self.now_ms();
        let mut hand = self.clock_hand.lock().unwrap_or_else(|e| e.into_inner());
        for _ in 0..EVICTION_LOOKS.min(hand.len()) {
            let Some(key) = hand.pop_front() else { break };
            let mut keep = false;
            let removed = self
                .entries
                .remove_if_mut(&key, |_, slot| {
                    if slot.expires_at_ms == 0 {
                        // Never evicted: off the queue (a new insert puts it back).
                        return false;
                    }
                    // An expired entry goes at once; a used one has its chance.
                    keep = slot.used && slot.live(now);
                    slot.used = false;
                    !keep
                })
                .is_some();
            if removed {
                self.live.fetch_sub(1, Ordering::AcqRel);
                self.evictions.fetch_add(1, Ordering::Relaxed);
                return true;
            }
            if keep {
                hand.push_back(key);
            }
        }
        false
    }

    /// Puts a new typed key on the eviction hand's queue (bounded: a queue twice the
    /// store's size has lost its oldest keys to re-inserts and removals already). One
    /// lock a new key, not a request: a subject seen again finds its entry.
    fn queue(&self, key: Key) {
        let mut hand = self.clock_hand.lock().unwrap_or_else(|e| e.into_inner());
        if hand.len() >= self.limits.max_entries.saturating_mul(2).max(16) {
            hand.pop_front();
        }
        hand.push_back(key);
    }

    /// A full store's sweep, if one is due: a sweep visits every entry, and a store
    /// full of live entries would otherwise be swept by every request for a new key
    /// (a million entries, milliseconds a request). Until the next is due, a new key
    /// is refused at once.
    fn sweep_if_due(&self) {
        let due = self.next_sweep.load(Ordering::Relaxed);
        let now = self.now_ms();
        if now >= due
            && self
                .next_sweep
                .compare_exchange(due, u64::MAX, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        {
            // One caller sweeps; the others refuse meanwhile.
            self.sweep_expired();
        }
    }

    fn now_ms(&self) -> u64 {
        self.clock.monotonic_ms()
    }

    /// Reserves room for one new entry, sweeping once if the store looks full.
    fn reserve(&self) -> Result<(), StateError> {
        if self.live.fetch_add(1, Ordering::AcqRel) < self.limits.max_entries {
            return Ok(());
        }
        self.live.fetch_sub(1, Ordering::AcqRel);
        Err(StateError::Full)
    }
}

fn check_key(key: &str) -> Result<(), StateError> {
    if key.is_empty() || key.len() > MAX_KEY_LEN {
        return Err(StateError::InvalidKey);
    }
    Ok(())
}

fn expiry(now_ms: u64, ttl_ms: u64) -> u64 {
    if ttl_ms == 0 {
        0
    } else {
        now_ms.saturating_add(ttl_ms)
    }
}

/// One filter's view of the store.
#[derive(Debug, Clone)]
pub struct Namespace {
    state: Arc<SharedState>,
    id: u32,
}

impl Namespace {
    fn key(&self, key: &str) -> Result<Key, StateError> {
        check_key(key)?;
        Ok((self.id, key.into()))
    }

    /// Runs `f` on the entry for `key` under its shard lock. `f` sees the live slot (an
    /// expired one is presented as absent) and returns the new slot (`None` removes it)
    /// and a result. New entries are counted against the capacity.
    fn update<R>(
        &self,
        key: &str,
        f: impl FnOnce(Option<Slot>, u64) -> Result<(Option<Slot>, R), StateError>,
    ) -> Result<R, StateError> {
        let key = self.key(key)?;
        let state = &*self.state;
        if state.len() >= state.limits.max_entries && !state.entries.contains_key(&key) {
            // Sweep (or evict) before taking a shard lock: both visit other shards.
            state.sweep_if_due();
            if state.len() >= state.limits.max_entries {
                state.evict_one();
            }
        }
        let now = state.now_ms();
        // A new key with a time-to-live goes on the eviction hand's queue once its
        // shard is unlocked: the hand locks shards while it holds the queue.
        let (result, new_key) = match state.entries.entry(key) {
            MapEntry::Occupied(mut occupied) => {
                let current = Some(*occupied.get()).filter(|slot| slot.live(now));
                let renewed = current.is_none();
                let (next, result) = f(current, now)?;
                match next {
                    Some(mut slot) => {
                        // An expired entry made anew is a new key to the hand.
                        slot.used = !renewed;
                        let new_key =
                            (renewed && slot.expires_at_ms != 0).then(|| occupied.key().clone());
                        occupied.insert(slot);
                        (result, new_key)
                    }
                    None => {
                        occupied.remove();
                        state.live.fetch_sub(1, Ordering::AcqRel);
                        (result, None)
                    }
                }
            }
            MapEntry::Vacant(vacant) => {
                let (next, result) = f(None, now)?;
                match next {
                    Some(slot) => {
                        state.reserve()?;
                        let new_key = (slot.expires_at_ms != 0).then(|| vacant.key().clone());
                        vacant.insert(slot);
                        (result, new_key)
                    }
                    None => (result, None),
                }
            }
        };
        if let Some(key) = new_key {
            state.queue(key);
        }
        Ok(result)
    }

    /// Adds `delta` to the integer at `key` and returns the new value. A missing or
    /// expired key starts at 0 with `ttl_ms` from now (0 = never expires); an existing
    /// key keeps its expiry, which makes this a fixed-window counter.
    pub fn increment(&self, key: &str, delta: i64, ttl_ms: u64) -> Result<i64, StateError> {
        self.update(key, |current, now| match current {
            Some(Slot {
                value: Value::Int(v),
                expires_at_ms,
                ..
            }) => {
                let next = v.saturating_add(delta);
                Ok((
                    Some(Slot {
                        value: Value::Int(next),
                        expires_at_ms,
                        used: false,
                    }),
                    next,
                ))
            }
            Some(_) => Err(StateError::WrongType),
            None => Ok((
                Some(Slot {
                    value: Value::Int(delta),
                    expires_at_ms: expiry(now, ttl_ms),
                    used: false,
                }),
                delta,
            )),
        })
    }

    /// The integer at `key`, if present and live.
    pub fn get(&self, key: &str) -> Result<Option<i64>, StateError> {
        let key = self.key(key)?;
        let now = self.state.now_ms();
        match self.state.entries.get(&key).map(|slot| *slot) {
            Some(slot) if slot.live(now) => match slot.value {
                Value::Int(v) => Ok(Some(v)),
                Value::Bucket { .. } => Err(StateError::WrongType),
            },
            _ => Ok(None),
        }
    }

    /// Sets `key` to `desired` (with `ttl_ms` from now) if it currently holds
    /// `expected` (`None` = absent or expired). On a mismatch returns `Err(current)`.
    pub fn compare_and_swap(
        &self,
        key: &str,
        expected: Option<i64>,
        desired: i64,
        ttl_ms: u64,
    ) -> Result<Result<(), Option<i64>>, StateError> {
        self.update(key, |current, now| {
            let current_value = match current {
                Some(Slot {
                    value: Value::Int(v),
                    ..
                }) => Some(v),
                Some(_) => return Err(StateError::WrongType),
                None => None,
            };
            if current_value == expected {
                let slot = Slot {
                    value: Value::Int(desired),
                    expires_at_ms: expiry(now, ttl_ms),
                    used: false,
                };
                Ok((Some(slot), Ok(())))
            } else {
                Ok((current, Err(current_value)))
            }
        })
    }

    /// The bytes at `key` and their version, if set (proxy-wasm's
    /// `get_shared_data`). Byte values live beside the typed ones: the same key may
    /// hold one of each.
    pub fn get_bytes(&self, key: &str) -> Result<Option<Versioned>, StateError> {
        let key = self.key(key)?;
        Ok(self.state.bytes.get(&key).map(|e| e.value().clone()))
    }

    /// Sets the bytes at `key` if `cas` is 0 or the current version (a missing key
    /// takes any `cas`); each write gets a new non-zero version. `Ok(false)` on a
    /// version mismatch. Byte values do not expire.
    pub fn set_bytes(&self, key: &str, value: &[u8], cas: u32) -> Result<bool, StateError> {
        let key = self.key(key)?;
        let state = &*self.state;
        let version = || loop {
            let v = state.next_cas.fetch_add(1, Ordering::Relaxed);
            if v != 0 {
                return v;
            }
        };
        match state.bytes.entry(key) {
            MapEntry::Occupied(mut occupied) => {
                if cas != 0 && occupied.get().1 != cas {
                    return Ok(false);
                }
                occupied.insert((Arc::from(value), version()));
            }
            MapEntry::Vacant(vacant) => {
                state.reserve()?;
                vacant.insert((Arc::from(value), version()));
            }
        }
        Ok(true)
    }

    /// Removes `key`; returns whether a live entry was there.
    pub fn delete(&self, key: &str) -> Result<bool, StateError> {
        let key = self.key(key)?;
        let now = self.state.now_ms();
        match self.state.entries.remove(&key) {
            Some((_, slot)) => {
                self.state.live.fetch_sub(1, Ordering::AcqRel);
                Ok(slot.live(now))
            }
            None => Ok(false),
        }
    }

    /// Takes `cost` tokens from the bucket at `key` if it holds that many.
    ///
    /// The bucket starts full and gains `refill_tokens` per whole interval (Envoy's
    /// local rate limit semantics). It expires when it would be full again, so an idle
    /// bucket costs no memory and a recreated one behaves exactly as the old would have.
    pub fn token_bucket_take(
        &self,
        key: &str,
        spec: BucketSpec,
        cost: u64,
    ) -> Result<BucketResult, StateError> {
        let interval = spec.refill_interval_ms.max(1);
        let capacity = spec.capacity;
        self.update(key, |current, now| {
            let (mut tokens, mut last_refill) = match current {
                Some(Slot {
                    value:
                        Value::Bucket {
                            tokens,
                            last_refill_ms,
                        },
                    ..
                }) => (tokens.min(capacity), last_refill_ms),
                Some(_) => return Err(StateError::WrongType),
                None => (capacity, now),
            };
            let elapsed_intervals = now.saturating_sub(last_refill) / interval;
            if elapsed_intervals > 0 {
                tokens = tokens
                    .saturating_add(elapsed_intervals.saturating_mul(spec.refill_tokens))
                    .min(capacity);
                last_refill = last_refill.saturating_add(elapsed_intervals * interval);
            }
            let allowed = tokens >= cost;
            if allowed {
                tokens -= cost;
            }
            let reset_after_ms = interval - now.saturating_sub(last_refill).min(interval - 1);
            let missing = capacity - tokens;
            let expires_at_ms = if missing == 0 || spec.refill_tokens == 0 {
                // A full bucket is indistinguishable from a new one; keep it one interval
                // so repeated takes reuse the slot. A bucket that never refills must
                // never expire, or it would come back full.
                if spec.refill_tokens == 0 {
                    0
                } else {
                    last_refill + interval
                }
            } else {
                let intervals_to_full = missing.div_ceil(spec.refill_tokens);
                last_refill.saturating_add(intervals_to_full.saturating_mul(interval))
            };
            let slot = Slot {
                value: Value::Bucket {
                    tokens,
                    last_refill_ms: last_refill,
                },
                expires_at_ms,
                used: false,
            };
            Ok((
                Some(slot),
                BucketResult {
                    allowed,
                    remaining: tokens,
                    reset_after_ms,
                },
            ))
        })
    }
}

#[cfg(test)]
mod tests;

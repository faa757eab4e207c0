//! A bounded memo of verified tokens, keyed by the token itself (SipHash with a
//! per-instance random key, so crafted tokens cannot collide into one bucket), so a
//! repeated token skips parsing and signature checks. Entries remember the key-set
//! version they were verified with and their validity window; time is re-checked on
//! every hit.

use std::hash::BuildHasher;
use std::rc::Rc;

use hashbrown::HashTable;

use crate::verifier::Window;

/// What a hit gives back.
#[derive(Debug, Clone)]
pub struct Verified {
    /// Provider index.
    pub provider: usize,
    /// Key-set version the signature was checked with.
    pub key_version: u64,
    /// Validity window.
    pub window: Window,
    /// The payload JSON.
    pub payload: String,
    /// Top-level claims as metadata entries: `jwt.claim.<name>` (formatted once, when
    /// the token is verified) and the value (strings raw, others JSON).
    pub claims: Vec<(String, String)>,
    /// The provider's `claim_to_headers` values, in its order, rendered once when the
    /// token is verified (`None`: absent or null, so the header is removed).
    pub claim_headers: Vec<Option<String>>,
}

/// The entries: by token, with a seeded fast hash (tokens are inserted only once
/// verified, so nobody can choose colliding keys to fill it). Entries are shared, so a
/// hit is a reference count, not a copy, and one lookup.
#[derive(Debug)]
pub struct VerifiedTokens {
    max: usize,
    entries: HashTable<(Box<str>, Rc<Verified>)>,
    hasher: foldhash::fast::RandomState,
    /// When a full cache next looks for expired entries (seconds, the filter's
    /// clock): no sooner than the earliest expiry the last look kept, and
    /// [`SWEEP_GAP`] after it. Looking visits every entry; a full cache under a
    /// stream of new tokens looked on every insert (a thousand entries per miss).
    next_sweep: f64,
}

/// Seconds between two looks of a full cache for expired entries.
const SWEEP_GAP: f64 = 1.0;

impl VerifiedTokens {
    /// A cache of at most `max` entries (0 disables it).
    pub fn new(max: usize) -> Self {
        Self {
            max,
            entries: HashTable::new(),
            hasher: foldhash::fast::RandomState::default(),
            next_sweep: f64::NEG_INFINITY,
        }
    }

    /// A cached verification still valid at `now` for `provider` with `key_version`.
    pub fn get(
        &mut self,
        token: &str,
        provider: usize,
        key_version: u64,
        now: f64,
    ) -> Option<Rc<Verified>> {
        let hash = self.hasher.hash_one(token);
        let entry = self
            .entries
            .find_entry(hash, |(k, _)| same(k, token))
            .ok()?;
        let hit = &entry.get().1;
        if hit.provider == provider
            && hit.key_version == key_version
            && now < hit.window.1
            && now >= hit.window.0
        {
            return Some(hit.clone());
        }
        entry.remove();
        None
    }

    pub fn insert(&mut self, token: &str, verified: Verified, now: f64) {
        if self.max == 0 {
            return;
        }
        if self.entries.len() >= self.max && now >= self.next_sweep {
            let mut earliest = f64::INFINITY;
            self.entries.retain(|(_, v)| {
                let live = now < v.window.1;
                if live {
                    earliest = earliest.min(v.window.1);
                }
                live
            });
            self.next_sweep = earliest.max(now + SWEEP_GAP);
        }
        while self.entries.len() >= self.max {
            let Some(victim) = self.entries.iter().next().map(|(k, _)| k.clone()) else {
                break;
            };
            let hash = self.hasher.hash_one(&*victim);
            if let Ok(entry) = self.entries.find_entry(hash, |(k, _)| same(k, &victim)) {
                entry.remove();
            }
        }
        let hash = self.hasher.hash_one(token);
        let value = (Box::from(token), Rc::new(verified));
        match self.entries.find_entry(hash, |(k, _)| same(k, token)) {
            Ok(mut entry) => *entry.get_mut() = value,
            Err(_) => {
                let hasher = &self.hasher;
                self.entries
                    .insert_unique(hash, value, |(k, _)| hasher.hash_one(&**k));
            }
        }
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// Token equality a word at a time: a hit compares the whole token (hundreds of
/// bytes) on every request, and the guest's libc `memcmp` goes byte by byte.
fn same(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let (aw, bw) = (a.chunks_exact(8), b.chunks_exact(8));
    let tails_equal = aw.remainder() == bw.remainder();
    tails_equal && aw.zip(bw).all(|(x, y)| word(x) == word(y))
}

fn word(bytes: &[u8]) -> u64 {
    u64::from_ne_bytes(bytes.try_into().unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn verified(provider: usize) -> Verified {
        Verified {
            provider,
            key_version: 1,
            window: (0.0, 100.0),
            payload: "{}".to_owned(),
            claims: Vec::new(),
            claim_headers: Vec::new(),
        }
    }

    #[test]
    fn word_compare_is_equality() {
        for (a, b) in [
            ("", ""),
            ("abc", "abc"),
            ("abcdefgh", "abcdefgh"),
            ("abcdefghij", "abcdefghij"),
            ("abcdefghij", "abcdefghik"),
            ("abcdefghij", "bbcdefghij"),
            ("abcdefgh", "abcdefgi"),
            ("abc", "abcd"),
        ] {
            assert_eq!(same(a, b), a == b, "{a:?} {b:?}");
        }
    }

    #[test]
    fn hits_need_the_same_token_provider_and_key_version_in_the_window() {
        let mut cache = VerifiedTokens::new(2);
        cache.insert("token-a.payload.sig", verified(0), 1.0);
        assert!(cache.get("token-a.payload.sig", 0, 1, 1.0).is_some());
        assert!(cache.get("token-a.payload.sih", 0, 1, 1.0).is_none());
        assert!(cache.get("token-a.payload.sig", 0, 2, 1.0).is_none());
        assert!(cache.is_empty(), "a stale entry is dropped");
        cache.insert("token-a.payload.sig", verified(0), 1.0);
        assert!(
            cache.get("token-a.payload.sig", 0, 1, 100.0).is_none(),
            "expired"
        );
    }

    /// A full cache under new tokens evicts one entry a miss; it looks for expired
    /// ones again only once its earliest entry can have expired.
    #[test]
    fn a_full_cache_looks_for_expired_entries_only_when_one_can_be() {
        let mut cache = VerifiedTokens::new(3);
        let until = |end: f64| Verified {
            window: (0.0, end),
            ..verified(0)
        };
        cache.insert("a", until(10.0), 1.0);
        cache.insert("b", until(50.0), 1.0);
        cache.insert("c", until(50.0), 1.0);
        cache.insert("d", until(50.0), 2.0);
        assert_eq!(cache.len(), 3, "one evicted for d");
        assert_eq!(cache.next_sweep, 10.0, "nothing can expire before a's end");
        let a_left = cache.get("a", 0, 1, 2.0).is_some();
        let kept: Vec<&str> = ["b", "c", "d"]
            .into_iter()
            .filter(|t| cache.get(t, 0, 1, 2.0).is_some())
            .collect();
        // At 11 s `a` (if it is still there) has expired: the look drops it, and no
        // live entry is evicted for `e`.
        cache.insert("e", until(50.0), 11.0);
        assert_eq!(cache.len(), 3);
        assert!(cache.get("e", 0, 1, 11.0).is_some());
        if a_left {
            for t in kept {
                assert!(cache.get(t, 0, 1, 11.0).is_some(), "{t} was live: kept");
            }
        }
        assert_eq!(cache.next_sweep, 50.0);
    }

    #[test]
    fn the_cache_stays_bounded_and_reinserting_replaces() {
        let mut cache = VerifiedTokens::new(2);
        cache.insert("a", verified(0), 1.0);
        cache.insert("a", verified(1), 1.0);
        assert_eq!(cache.len(), 1);
        assert!(cache.get("a", 1, 1, 1.0).is_some());
        cache.insert("b", verified(0), 1.0);
        cache.insert("c", verified(0), 1.0);
        assert_eq!(cache.len(), 2);
        assert!(cache.get("c", 0, 1, 1.0).is_some(), "the newest stays");
    }
}

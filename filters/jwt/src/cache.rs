//! A bounded cache of verified tokens, keyed by the token itself (SipHash with a
//! per-instance random key, so crafted tokens cannot collide into one bucket), so a
//! repeated token skips parsing and signature checks. Entries remember the key-set
//! version they were verified with and their validity window; time is re-checked on
//! every hit.

use std::collections::HashMap;
use std::rc::Rc;

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

#[derive(Debug)]
pub struct TokenCache {
    max: usize,
    /// By token, with a seeded fast hash (tokens are inserted only once verified, so
    /// nobody can choose colliding keys to fill it). Entries are shared, so a hit is a
    /// reference count, not a copy, and one lookup.
    entries: HashMap<Box<str>, Rc<Verified>, foldhash::fast::RandomState>,
}

impl TokenCache {
    /// A cache of at most `max` entries (0 disables it).
    pub fn new(max: usize) -> Self {
        Self {
            max,
            entries: HashMap::default(),
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
        let hit = self.entries.get(token)?;
        if hit.provider == provider
            && hit.key_version == key_version
            && now < hit.window.1
            && now >= hit.window.0
        {
            return Some(hit.clone());
        }
        self.entries.remove(token);
        None
    }

    pub fn insert(&mut self, token: &str, verified: Verified, now: f64) {
        if self.max == 0 {
            return;
        }
        if self.entries.len() >= self.max {
            self.entries.retain(|_, v| now < v.window.1);
        }
        while self.entries.len() >= self.max {
            let Some(victim) = self.entries.keys().next().cloned() else {
                break;
            };
            self.entries.remove(&victim);
        }
        self.entries.insert(token.into(), Rc::new(verified));
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

//! A bounded cache of verified tokens, keyed by the token itself (SipHash with a
//! per-instance random key, so crafted tokens cannot collide into one bucket), so a
//! repeated token skips parsing and signature checks. Entries remember the key-set
//! version they were verified with and their validity window; time is re-checked on
//! every hit.

use std::collections::HashMap;

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
    /// Top-level claims as metadata values (strings raw, others JSON).
    pub claims: Vec<(String, String)>,
}

#[derive(Debug)]
pub struct TokenCache {
    max: usize,
    entries: HashMap<Box<str>, Verified>,
}

impl TokenCache {
    /// A cache of at most `max` entries (0 disables it).
    pub fn new(max: usize) -> Self {
        Self {
            max,
            entries: HashMap::new(),
        }
    }

    /// A cached verification still valid at `now` for `provider` with `key_version`.
    pub fn get(
        &mut self,
        token: &str,
        provider: usize,
        key_version: u64,
        now: f64,
    ) -> Option<&Verified> {
        let fresh = self.entries.get(token).is_some_and(|v| {
            v.provider == provider
                && v.key_version == key_version
                && now < v.window.1
                && now >= v.window.0
        });
        if !fresh {
            self.entries.remove(token);
            return None;
        }
        self.entries.get(token)
    }

    /// Remembers a verification, evicting expired entries (then arbitrary ones) when full.
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
        self.entries.insert(token.into(), verified);
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

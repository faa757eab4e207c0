//! The stored responses: by primary key (authority, path and query), each with its
//! variants (one per set of values of the headers its `Vary` names). Bodies live
//! elsewhere (the node's BlueCache store), named by [`Entry::body_key`]; this is the
//! metadata and the decisions. Time is passed in, so the logic tests on a fake clock.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use http::{HeaderMap, HeaderName, HeaderValue, header};

use crate::{directives, policy};

/// One stored response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub status: u16,
    /// Its headers as stored (no hop-by-hop fields, no `Age`).
    pub headers: HeaderMap,
    /// Where its body is in the store.
    pub body_key: String,
    pub body_len: u64,
    /// The headers its `Vary` names, and the request's values for them.
    pub vary: Vec<(HeaderName, Option<String>)>,
    /// When it was received.
    pub response_time: SystemTime,
    /// Its age then.
    pub initial_age: Duration,
    /// How long it stays fresh.
    pub lifetime: Duration,
}

impl Entry {
    /// Its age at `now` (§4.2.3).
    pub fn age(&self, now: SystemTime) -> Duration {
        self.initial_age + now.duration_since(self.response_time).unwrap_or_default()
    }

    /// Whether it may be served without asking the origin, for `request`.
    fn fresh_for(&self, request: &HeaderMap, now: SystemTime) -> bool {
        let age = self.age(now);
        let req = directives::parse(request);
        let stored = directives::parse(&self.headers);
        if req.no_cache || stored.no_cache {
            return false;
        }
        if req.max_age.is_some_and(|m| age > Duration::from_secs(m)) {
            return false;
        }
        let lifetime = match req.min_fresh {
            Some(m) => self.lifetime.saturating_sub(Duration::from_secs(m)),
            None => self.lifetime,
        };
        if age < lifetime {
            return true;
        }
        // Stale. A client may accept staleness, unless the response forbids it.
        if stored.must_revalidate || stored.proxy_revalidate || stored.s_maxage.is_some() {
            return false;
        }
        match req.max_stale {
            Some(None) => true,
            Some(Some(s)) => age < self.lifetime + Duration::from_secs(s),
            None => false,
        }
    }

    /// The headers it is served with: stored, plus `Age` (whole seconds, §5.1).
    pub fn served_headers(&self, now: SystemTime) -> HeaderMap {
        let mut h = self.headers.clone();
        h.insert(header::AGE, HeaderValue::from(self.age(now).as_secs()));
        h
    }

    /// A response received for `request` between `request_time` and
    /// `response_time`, stored with a lifetime from [`policy::storable`].
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        status: u16,
        response: &HeaderMap,
        request: &HeaderMap,
        body_key: String,
        body_len: u64,
        lifetime: Duration,
        request_time: SystemTime,
        response_time: SystemTime,
    ) -> Self {
        let names = policy::vary_names(response).unwrap_or_default();
        let values = policy::vary_values(request, &names);
        Self {
            status,
            headers: policy::storable_headers(response),
            body_key,
            body_len,
            vary: names.into_iter().zip(values).collect(),
            response_time,
            initial_age: policy::initial_age(response, request_time, response_time),
            lifetime,
        }
    }

    /// This response confirmed by the origin's `304` (RFC 9111 §4.3.4): its headers
    /// updated by the 304's, its age and lifetime started again.
    pub fn refreshed(
        &self,
        rule: &policy::Rule,
        not_modified: &HeaderMap,
        request_time: SystemTime,
        response_time: SystemTime,
    ) -> Self {
        let headers = policy::refreshed_headers(&self.headers, not_modified);
        let lifetime = policy::lifetime(rule, self.status, &headers).unwrap_or(Duration::ZERO);
        Self {
            status: self.status,
            initial_age: policy::initial_age(not_modified, request_time, response_time),
            headers,
            body_key: self.body_key.clone(),
            body_len: self.body_len,
            vary: self.vary.clone(),
            response_time,
            lifetime,
        }
    }

    fn matches(&self, request: &HeaderMap) -> bool {
        let names: Vec<HeaderName> = self.vary.iter().map(|(n, _)| n.clone()).collect();
        let values = policy::vary_values(request, &names);
        self.vary
            .iter()
            .zip(values)
            .all(|((_, want), got)| *want == got)
    }
}

/// What a lookup found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    Miss,
    /// Servable as is.
    Fresh(Arc<Entry>),
    /// Stored, but the origin must confirm it first (conditional request).
    Stale(Arc<Entry>),
}

/// The key of a request's responses: scheme-less authority (lower-case, port kept),
/// path and query.
pub fn primary_key(authority: &str, path: &str, query: Option<&str>) -> String {
    match query {
        Some(q) => format!("{}{path}?{q}", authority.to_ascii_lowercase()),
        None => format!("{}{path}", authority.to_ascii_lowercase()),
    }
}

/// The index.
#[derive(Debug, Default)]
pub struct Index {
    entries: BTreeMap<String, Vec<Arc<Entry>>>,
    bytes: u64,
}

impl Index {
    pub fn new() -> Self {
        Self::default()
    }

    /// Responses stored.
    pub fn len(&self) -> usize {
        self.entries.values().map(Vec::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Body bytes they hold.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The stored response for a request, if any, and whether it is fresh for it.
    pub fn lookup(&self, primary: &str, request: &HeaderMap, now: SystemTime) -> Lookup {
        let Some(variants) = self.entries.get(primary) else {
            return Lookup::Miss;
        };
        match variants.iter().find(|e| e.matches(request)) {
            None => Lookup::Miss,
            Some(e) if e.fresh_for(request, now) => Lookup::Fresh(e.clone()),
            Some(e) => Lookup::Stale(e.clone()),
        }
    }

    /// Stores `entry` under `primary`, replacing the variant with the same `Vary`
    /// values; returns what it replaced (whose body may go).
    pub fn insert(&mut self, primary: &str, entry: Entry) -> Option<Arc<Entry>> {
        let variants = self.entries.entry(primary.to_owned()).or_default();
        self.bytes += entry.body_len;
        let entry = Arc::new(entry);
        let replaced = match variants.iter().position(|e| e.vary == entry.vary) {
            Some(i) => Some(std::mem::replace(&mut variants[i], entry)),
            None => {
                variants.push(entry);
                None
            }
        };
        if let Some(old) = &replaced {
            self.bytes -= old.body_len;
        }
        replaced
    }

    /// Forgets one stored response (its body went missing, or it was found corrupt).
    pub fn forget(&mut self, primary: &str, body_key: &str) -> bool {
        let Some(variants) = self.entries.get_mut(primary) else {
            return false;
        };
        let before = variants.len();
        variants.retain(|e| {
            let keep = e.body_key != body_key;
            if !keep {
                self.bytes -= e.body_len;
            }
            keep
        });
        let removed = variants.len() < before;
        if variants.is_empty() {
            self.entries.remove(primary);
        }
        removed
    }

    /// Removes every response under `primary` (an unsafe method succeeded on it,
    /// RFC 9111 §4.4, or an operator purged it); returns them.
    pub fn invalidate(&mut self, primary: &str) -> Vec<Arc<Entry>> {
        let gone = self.entries.remove(primary).unwrap_or_default();
        self.bytes -= gone.iter().map(|e| e.body_len).sum::<u64>();
        gone
    }

    /// Removes every response whose primary key starts with `prefix`; returns them.
    pub fn purge_prefix(&mut self, prefix: &str) -> Vec<Arc<Entry>> {
        let keys: Vec<String> = self
            .entries
            .range(prefix.to_owned()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, _)| k.clone())
            .collect();
        keys.iter().flat_map(|k| self.invalidate(k)).collect()
    }
}

#[cfg(test)]
mod tests;

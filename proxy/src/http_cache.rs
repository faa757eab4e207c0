//! The node's HTTP response cache: the RFC 9111 policy of `dpumesh-http-cache` over the
//! node's BlueCache store. The index (what is stored, for how long, its variants) is
//! in DPU memory, shared by the node's shards; the bodies are objects in the store
//! (`http-cache/N`), written by the store's workers off the shards' threads.
//!
//! On a miss the shard copies the body out of the pod's TX buffer (the DMA engine's
//! work, inline as the rest of the DMA manager's) as the response goes back, and the
//! store writes it; on a hit the shard answers from the store and the request never
//! reaches the host. A body the store evicted (or found corrupt) turns its entry into
//! a miss.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use dpumesh_http_cache::{Entry, Index, Lookup};
use dpumesh_store::Agent;
use http::HeaderMap;
use parking_lot::Mutex;

/// Where bodies go in the store: the node's own namespace, which no service's store
/// client can name (`dpumesh_store::namespace`), so no pod can read, overwrite or
/// delete a body the node serves to clients.
pub const BODY_PREFIX: &str = ".node/http-cache/";

/// Counters.
#[derive(Debug, Default)]
pub struct CacheStats {
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    /// Stale entries the origin confirmed with a 304.
    pub revalidated: AtomicU64,
    pub stored: AtomicU64,
    pub not_stored: AtomicU64,
    /// Body bytes served from the cache.
    pub hit_bytes: AtomicU64,
}

/// The cache.
pub struct HttpCache {
    store: Arc<Agent>,
    index: Mutex<Index>,
    next: AtomicU64,
    pub stats: CacheStats,
}

impl std::fmt::Debug for HttpCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpCache")
            .field("entries", &self.index.lock().len())
            .finish_non_exhaustive()
    }
}

impl HttpCache {
    /// A cache over `store`. Bodies a previous run left are removed: the index that
    /// named them is gone with that run.
    pub fn new(store: Arc<Agent>) -> Self {
        let stale = store.purge_prefix(BODY_PREFIX);
        if stale > 0 {
            tracing::info!(stale, "removed the HTTP cache bodies of a previous run");
        }
        Self {
            store,
            index: Mutex::new(Index::new()),
            next: AtomicU64::new(1),
            stats: CacheStats::default(),
        }
    }

    pub fn lookup(&self, primary: &str, request: &HeaderMap, now: SystemTime) -> Lookup {
        self.index.lock().lookup(primary, request, now)
    }

    /// A stored response's body; `None` (and the entry forgotten) when the store no
    /// longer has it.
    pub fn body(&self, primary: &str, entry: &Entry) -> Option<Vec<u8>> {
        match self.store.get_bytes(&entry.body_key) {
            Ok(Some(bytes)) if bytes.len() as u64 == entry.body_len => Some(bytes),
            other => {
                if let Err(e) = other {
                    tracing::warn!(key = entry.body_key, error = %e, "a cached body cannot be read: dropped");
                }
                self.index.lock().forget(primary, &entry.body_key);
                None
            }
        }
    }

    /// Stores a response: its body goes to the store on a worker; the entry is
    /// indexed once the body is in (until then, requests miss).
    pub fn store(self: &Arc<Self>, primary: String, mut entry: Entry, body: Vec<u8>) {
        let key = format!("{BODY_PREFIX}{}", self.next.fetch_add(1, Ordering::Relaxed));
        entry.body_key = key.clone();
        let cache = self.clone();
        self.store.put_bytes(
            key,
            body,
            Box::new(move |stored| match stored {
                Ok(_) => {
                    cache.stats.stored.fetch_add(1, Ordering::Relaxed);
                    metrics::counter!("dpumesh_http_cache_stored_total").increment(1);
                    let replaced = cache.index.lock().insert(&primary, entry);
                    if let Some(old) = replaced {
                        cache.store.purge_key(&old.body_key);
                    }
                }
                Err(why) => {
                    tracing::warn!(primary, error = %why, "a response could not be cached");
                    cache.stats.not_stored.fetch_add(1, Ordering::Relaxed);
                }
            }),
        );
    }

    /// Replaces an entry whose body stays (a 304 refreshed it).
    pub fn refresh(&self, primary: &str, entry: Entry) {
        self.index.lock().insert(primary, entry);
    }

    /// Removes every response under `primary` and their bodies; how many.
    pub fn invalidate(&self, primary: &str) -> usize {
        let gone = self.index.lock().invalidate(primary);
        for e in &gone {
            self.store.purge_key(&e.body_key);
        }
        gone.len()
    }

    /// Removes every response whose key (`host/path?query`) starts with `prefix`.
    pub fn purge_prefix(&self, prefix: &str) -> usize {
        let gone = self.index.lock().purge_prefix(prefix);
        for e in &gone {
            self.store.purge_key(&e.body_key);
        }
        gone.len()
    }

    /// Responses stored, and their body bytes.
    pub fn size(&self) -> (usize, u64) {
        let index = self.index.lock();
        (index.len(), index.bytes())
    }

    /// The store under it.
    pub fn store_agent(&self) -> &Arc<Agent> {
        &self.store
    }
}

//! Small objects kept in DPU memory in front of storage: what the node reads itself
//! (the HTTP cache's bodies) is served from here without a system call while it
//! fits. Bounded in bytes, oldest out first; every change of an object in the
//! catalog drops its copy here, so it never serves an object the store no longer
//! holds (or an older version of it).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use parking_lot::Mutex;

/// The largest object kept.
pub(crate) const MAX_OBJECT: usize = 64 << 10;

#[derive(Default)]
struct Inner {
    map: HashMap<String, (Arc<Vec<u8>>, u64)>,
    order: BTreeMap<u64, String>,
    bytes: u64,
    next: u64,
}

pub(crate) struct Hot {
    budget: u64,
    inner: Mutex<Inner>,
}

impl Hot {
    pub fn new(budget: u64) -> Self {
        Self {
            budget,
            inner: Mutex::new(Inner::default()),
        }
    }

    pub fn get(&self, key: &str) -> Option<Arc<Vec<u8>>> {
        let mut inner = self.inner.lock();
        let next = inner.next;
        let (bytes, used) = inner.map.get_mut(key)?;
        let bytes = bytes.clone();
        let old = std::mem::replace(used, next);
        inner.next += 1;
        inner.order.remove(&old);
        inner.order.insert(next, key.to_owned());
        Some(bytes)
    }

    pub fn put(&self, key: &str, bytes: Arc<Vec<u8>>) {
        if bytes.len() > MAX_OBJECT || bytes.len() as u64 > self.budget {
            return;
        }
        let mut inner = self.inner.lock();
        remove(&mut inner, key);
        while inner.bytes + bytes.len() as u64 > self.budget {
            let Some((_, oldest)) = inner.order.pop_first() else {
                break;
            };
            if let Some((b, _)) = inner.map.remove(&oldest) {
                inner.bytes -= b.len() as u64;
            }
        }
        let used = inner.next;
        inner.next += 1;
        inner.bytes += bytes.len() as u64;
        inner.order.insert(used, key.to_owned());
        inner.map.insert(key.to_owned(), (bytes, used));
    }

    pub fn remove(&self, key: &str) {
        remove(&mut self.inner.lock(), key);
    }

    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.inner.lock().bytes
    }
}

fn remove(inner: &mut Inner, key: &str) {
    if let Some((b, used)) = inner.map.remove(key) {
        inner.bytes -= b.len() as u64;
        inner.order.remove(&used);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oldest_out_first_within_the_budget() {
        let hot = Hot::new(10);
        hot.put("a", Arc::new(vec![1; 4]));
        hot.put("b", Arc::new(vec![2; 4]));
        assert!(hot.get("a").is_some());
        hot.put("c", Arc::new(vec![3; 4]));
        assert!(hot.get("b").is_none(), "b was the oldest use");
        assert_eq!(hot.bytes(), 8);
        hot.remove("a");
        assert!(hot.get("a").is_none());
        hot.put("big", Arc::new(vec![0; 11]));
        assert!(hot.get("big").is_none());
        assert_eq!(hot.bytes(), 4);
    }
}

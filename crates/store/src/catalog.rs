//! Which objects the store holds, their sizes, and their order of last use: the
//! capacity limit evicts the least recently used first. Pure bookkeeping (no I/O):
//! the agent applies what it decides.

use std::collections::{BTreeMap, HashMap};

use crate::backend::ObjectMeta;

/// Why an object cannot be admitted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("an object of {size} bytes exceeds the store's capacity of {capacity} bytes")]
pub struct TooLarge {
    pub size: u64,
    pub capacity: u64,
}

#[derive(Debug)]
struct Entry {
    meta: ObjectMeta,
    /// Its place in the use order.
    used: u64,
}

/// The objects, with a capacity in bytes.
#[derive(Debug)]
pub struct Catalog {
    capacity: u64,
    bytes: u64,
    entries: HashMap<String, Entry>,
    /// Use order → key (oldest first).
    order: BTreeMap<u64, String>,
    clock: u64,
}

impl Catalog {
    pub fn new(capacity: u64) -> Self {
        Self {
            capacity,
            bytes: 0,
            entries: HashMap::new(),
            order: BTreeMap::new(),
            clock: 0,
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Objects held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Whether an object of `size` bytes could ever fit.
    pub fn check_size(&self, size: u64) -> Result<(), TooLarge> {
        if size > self.capacity {
            return Err(TooLarge {
                size,
                capacity: self.capacity,
            });
        }
        Ok(())
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Adds (or replaces) an object as the most recently used; returns the keys
    /// evicted to make room, oldest first.
    pub fn admit(&mut self, meta: ObjectMeta) -> Result<Vec<String>, TooLarge> {
        self.check_size(meta.size)?;
        self.remove(&meta.key);
        let mut evicted = Vec::new();
        while self.bytes + meta.size > self.capacity {
            let Some((_, oldest)) = self.order.pop_first() else {
                break;
            };
            if let Some(entry) = self.entries.remove(&oldest) {
                self.bytes -= entry.meta.size;
            }
            evicted.push(oldest);
        }
        let used = self.tick();
        self.bytes += meta.size;
        self.order.insert(used, meta.key.clone());
        self.entries.insert(meta.key.clone(), Entry { meta, used });
        Ok(evicted)
    }

    /// An object's metadata, marking it used.
    pub fn touch(&mut self, key: &str) -> Option<ObjectMeta> {
        let used = self.tick();
        let entry = self.entries.get_mut(key)?;
        self.order.remove(&entry.used);
        entry.used = used;
        self.order.insert(used, key.to_owned());
        Some(entry.meta.clone())
    }

    /// An object's metadata, without marking it used.
    pub fn get(&self, key: &str) -> Option<&ObjectMeta> {
        self.entries.get(key).map(|e| &e.meta)
    }

    /// Forgets an object; whether it was there.
    pub fn remove(&mut self, key: &str) -> bool {
        match self.entries.remove(key) {
            Some(entry) => {
                self.order.remove(&entry.used);
                self.bytes -= entry.meta.size;
                true
            }
            None => false,
        }
    }

    /// Up to `limit` objects whose keys start with `prefix`, after `after`, in key
    /// order; and whether more follow.
    pub fn list(&self, prefix: &str, after: Option<&str>, limit: usize) -> (Vec<ObjectMeta>, bool) {
        let mut keys: Vec<&String> = self
            .entries
            .keys()
            .filter(|k| k.starts_with(prefix) && after.is_none_or(|a| k.as_str() > a))
            .collect();
        keys.sort();
        let more = keys.len() > limit;
        let objects = keys
            .into_iter()
            .take(limit)
            .map(|k| self.entries[k].meta.clone())
            .collect();
        (objects, more)
    }

    /// Keys starting with `prefix`.
    pub fn keys_with_prefix(&self, prefix: &str) -> Vec<String> {
        self.entries
            .keys()
            .filter(|k| k.starts_with(prefix))
            .cloned()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(key: &str, size: u64) -> ObjectMeta {
        ObjectMeta {
            key: key.into(),
            size,
            crc32: 0,
        }
    }

    #[test]
    fn the_least_recently_used_go_first() {
        let mut c = Catalog::new(100);
        for k in ["a", "b", "c"] {
            assert!(c.admit(meta(k, 30)).unwrap().is_empty());
        }
        // `a` is read: `b` is now the oldest.
        assert!(c.touch("a").is_some());
        assert_eq!(c.admit(meta("d", 30)).unwrap(), ["b"]);
        // Room for 50 takes the next two oldest: c, then a.
        assert_eq!(c.admit(meta("e", 50)).unwrap(), ["c", "a"]);
        assert_eq!(c.bytes(), 80);
        let (all, more) = c.list("", None, 10);
        let keys: Vec<_> = all.iter().map(|m| m.key.as_str()).collect();
        assert_eq!((keys, more), (vec!["d", "e"], false));
    }

    #[test]
    fn replacing_an_object_counts_its_new_size_once() {
        let mut c = Catalog::new(100);
        c.admit(meta("a", 60)).unwrap();
        assert!(c.admit(meta("a", 90)).unwrap().is_empty());
        assert_eq!((c.bytes(), c.len()), (90, 1));
        assert_eq!(
            c.admit(meta("big", 101)).unwrap_err(),
            TooLarge {
                size: 101,
                capacity: 100
            }
        );
        assert!(c.remove("a"));
        assert!(!c.remove("a"));
        assert_eq!(c.bytes(), 0);
    }

    #[test]
    fn listing_pages_by_prefix() {
        let mut c = Catalog::new(1000);
        for k in ["x/1", "x/2", "x/3", "y/1"] {
            c.admit(meta(k, 1)).unwrap();
        }
        let (page, more) = c.list("x/", None, 2);
        assert!(more);
        assert_eq!(page.last().unwrap().key, "x/2");
        let (page, more) = c.list("x/", Some("x/2"), 2);
        assert!(!more);
        assert_eq!(page.len(), 1);
        assert_eq!(c.keys_with_prefix("y/"), ["y/1"]);
    }
}

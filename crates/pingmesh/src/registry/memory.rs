//! The registry in memory: a map by GID with indexes by ToR and by IP.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;

use parking_lot::RwLock;

use super::{Gid, Rnic, RnicStore, StoreError};

#[derive(Debug, Default)]
struct Tables {
    by_gid: BTreeMap<Gid, Rnic>,
    by_tor: HashMap<String, BTreeSet<Gid>>,
    by_ip: HashMap<IpAddr, Gid>,
}

impl Tables {
    fn unindex(&mut self, old: &Rnic) {
        if let Some(set) = self.by_tor.get_mut(&old.tor_id) {
            set.remove(&old.gid);
            if set.is_empty() {
                self.by_tor.remove(&old.tor_id);
            }
        }
        if self.by_ip.get(&old.rnic_ip) == Some(&old.gid) {
            self.by_ip.remove(&old.rnic_ip);
        }
    }
}

/// An in-memory [`RnicStore`].
#[derive(Debug, Default)]
pub struct MemoryStore {
    tables: RwLock<Tables>,
}

impl MemoryStore {
    pub fn new() -> Self {
        Self::default()
    }
}

impl RnicStore for MemoryStore {
    fn upsert(&self, rnic: &Rnic) -> Result<(), StoreError> {
        let mut t = self.tables.write();
        if let Some(old) = t.by_gid.remove(&rnic.gid) {
            t.unindex(&old);
        }
        t.by_tor
            .entry(rnic.tor_id.clone())
            .or_default()
            .insert(rnic.gid);
        t.by_ip.insert(rnic.rnic_ip, rnic.gid);
        t.by_gid.insert(rnic.gid, rnic.clone());
        Ok(())
    }

    fn get(&self, gid: &Gid) -> Result<Option<Rnic>, StoreError> {
        Ok(self.tables.read().by_gid.get(gid).cloned())
    }

    fn by_ip(&self, ip: IpAddr) -> Result<Option<Rnic>, StoreError> {
        let t = self.tables.read();
        Ok(t.by_ip.get(&ip).and_then(|g| t.by_gid.get(g)).cloned())
    }

    fn by_tor(&self, tor: &str) -> Result<Vec<Rnic>, StoreError> {
        let t = self.tables.read();
        Ok(t.by_tor
            .get(tor)
            .map(|set| {
                set.iter()
                    .filter_map(|g| t.by_gid.get(g).cloned())
                    .collect()
            })
            .unwrap_or_default())
    }

    fn all(&self) -> Result<Vec<Rnic>, StoreError> {
        Ok(self.tables.read().by_gid.values().cloned().collect())
    }

    fn expire(&self, cutoff_ms: u64) -> Result<usize, StoreError> {
        let mut t = self.tables.write();
        let old: Vec<Rnic> = t
            .by_gid
            .values()
            .filter(|r| r.last_updated_ms < cutoff_ms)
            .cloned()
            .collect();
        for r in &old {
            t.by_gid.remove(&r.gid);
            t.unindex(r);
        }
        Ok(old.len())
    }

    fn len(&self) -> Result<usize, StoreError> {
        Ok(self.tables.read().by_gid.len())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn keeps_the_contract() {
        super::super::contract::check(&super::MemoryStore::new());
    }
}

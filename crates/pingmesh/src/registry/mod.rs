//! The controller's RNIC registry: one entry per RNIC, keyed by GID,
//! found by ToR and by IP, expired when its agent stops re-registering.
//!
//! [`RnicStore`] is the seam: [`sqlite::SqliteStore`] (the default, a file that
//! survives restarts) and [`memory::MemoryStore`] (tests, benches).

pub mod memory;
pub mod sqlite;

use std::net::IpAddr;

use dpumesh_dpa::fabric::ud::Gid;

/// One RNIC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rnic {
    pub gid: Gid,
    /// The responder's UD queue pair.
    pub qpn: u32,
    pub qkey: u32,
    pub agent_id: String,
    /// The agent's management address.
    pub agent_ip: String,
    pub rnic_ip: IpAddr,
    pub tor_id: String,
    /// Software fabric: the responder's UDP port.
    pub udp_port: u16,
    /// When it was last registered (Unix milliseconds).
    pub last_updated_ms: u64,
}

/// Why the registry failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("RNIC registry database: {0}")]
    Db(#[from] rusqlite::Error),
    #[error("RNIC registry entry {gid}: {detail}")]
    Corrupt { gid: String, detail: String },
}

/// Where RNICs are kept.
pub trait RnicStore: Send + Sync {
    /// Adds or replaces the entry of `rnic.gid`.
    fn upsert(&self, rnic: &Rnic) -> Result<(), StoreError>;
    fn get(&self, gid: &Gid) -> Result<Option<Rnic>, StoreError>;
    /// The entry whose RNIC IP is `ip`.
    fn by_ip(&self, ip: IpAddr) -> Result<Option<Rnic>, StoreError>;
    /// Every entry under ToR `tor`.
    fn by_tor(&self, tor: &str) -> Result<Vec<Rnic>, StoreError>;
    /// Every entry, ordered by GID.
    fn all(&self) -> Result<Vec<Rnic>, StoreError>;
    /// Removes the entries last updated before `cutoff_ms`; how many.
    fn expire(&self, cutoff_ms: u64) -> Result<usize, StoreError>;
    fn len(&self) -> Result<usize, StoreError>;
    fn is_empty(&self) -> Result<bool, StoreError> {
        Ok(self.len()? == 0)
    }
}

#[cfg(test)]
pub(crate) mod contract {
    //! What every store must do, run against each.
    use super::*;

    pub fn rnic(n: u8, tor: &str, at: u64) -> Rnic {
        let ip: IpAddr = format!("10.0.0.{n}").parse().unwrap();
        Rnic {
            gid: Gid::from_ip(ip),
            qpn: 100 + u32::from(n),
            qkey: 0x1111,
            agent_id: format!("node-{n}"),
            agent_ip: format!("192.168.0.{n}"),
            rnic_ip: ip,
            tor_id: tor.to_owned(),
            udp_port: 4791,
            last_updated_ms: at,
        }
    }

    pub fn check(store: &dyn RnicStore) {
        for (n, tor) in [(1, "tor-a"), (2, "tor-a"), (3, "tor-b")] {
            store.upsert(&rnic(n, tor, 1_000)).unwrap();
        }
        assert_eq!(store.len().unwrap(), 3);
        let two = rnic(2, "tor-a", 1_000);
        assert_eq!(store.get(&two.gid).unwrap(), Some(two.clone()));
        assert_eq!(store.by_ip(two.rnic_ip).unwrap(), Some(two.clone()));
        assert_eq!(store.by_ip("10.9.9.9".parse().unwrap()).unwrap(), None);
        let tor_a: Vec<_> = store
            .by_tor("tor-a")
            .unwrap()
            .into_iter()
            .map(|r| r.qpn)
            .collect();
        assert_eq!(tor_a, vec![101, 102]);
        assert!(store.by_tor("tor-z").unwrap().is_empty());

        // A restarted agent re-registers with a new QPN: the entry is replaced.
        let mut moved = rnic(2, "tor-a", 2_000);
        moved.qpn = 999;
        store.upsert(&moved).unwrap();
        assert_eq!(store.get(&moved.gid).unwrap().unwrap().qpn, 999);
        assert_eq!(store.len().unwrap(), 3);

        // Entries not refreshed since the cutoff go.
        assert_eq!(store.expire(1_500).unwrap(), 2);
        let left: Vec<_> = store.all().unwrap().into_iter().map(|r| r.qpn).collect();
        assert_eq!(left, vec![999]);
    }
}

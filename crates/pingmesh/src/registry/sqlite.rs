//! The registry in SQLite: `rnics` keyed by GID, with indexes
//! on ToR, RNIC IP and agent.

use std::net::IpAddr;
use std::path::Path;

use parking_lot::Mutex;
use rusqlite::{Connection, OptionalExtension, Row, params};

use super::{Gid, Rnic, RnicStore, StoreError};

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS rnics (
    rnic_gid     TEXT PRIMARY KEY,
    qpn          INTEGER NOT NULL,
    qkey         INTEGER NOT NULL,
    agent_id     TEXT NOT NULL,
    agent_ip     TEXT NOT NULL,
    rnic_ip      TEXT NOT NULL,
    tor_id       TEXT NOT NULL,
    udp_port     INTEGER NOT NULL,
    last_updated INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS rnics_tor ON rnics (tor_id);
CREATE INDEX IF NOT EXISTS rnics_ip ON rnics (rnic_ip);
CREATE INDEX IF NOT EXISTS rnics_agent ON rnics (agent_id);
CREATE INDEX IF NOT EXISTS rnics_updated ON rnics (last_updated);
";

const COLUMNS: &str =
    "rnic_gid, qpn, qkey, agent_id, agent_ip, rnic_ip, tor_id, udp_port, last_updated";

/// A [`RnicStore`] in an SQLite database file.
#[derive(Debug)]
pub struct SqliteStore {
    conn: Mutex<Connection>,
}

impl SqliteStore {
    /// Opens (or creates) the database at `path`.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        Self::with(Connection::open(path)?)
    }

    /// A database in memory (gone with the store).
    pub fn in_memory() -> Result<Self, StoreError> {
        Self::with(Connection::open_in_memory()?)
    }

    fn with(conn: Connection) -> Result<Self, StoreError> {
        // WAL: readers (pinglist generation) do not wait for the writer (registration).
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.execute_batch(SCHEMA)?;
        Ok(Self {
            conn: Mutex::new(conn),
        })
    }

    fn query(&self, sql: &str, arg: Option<&str>) -> Result<Vec<Rnic>, StoreError> {
        let conn = self.conn.lock();
        let mut stmt = conn.prepare_cached(sql)?;
        let rows = match arg {
            Some(a) => stmt.query_map([a], raw)?.collect::<Result<Vec<_>, _>>()?,
            None => stmt.query_map([], raw)?.collect::<Result<Vec<_>, _>>()?,
        };
        rows.into_iter().map(Raw::into_rnic).collect()
    }
}

/// A row as stored, before its text is checked.
struct Raw {
    gid: String,
    qpn: i64,
    qkey: i64,
    agent_id: String,
    agent_ip: String,
    rnic_ip: String,
    tor_id: String,
    udp_port: i64,
    last_updated: i64,
}

fn raw(row: &Row<'_>) -> rusqlite::Result<Raw> {
    Ok(Raw {
        gid: row.get(0)?,
        qpn: row.get(1)?,
        qkey: row.get(2)?,
        agent_id: row.get(3)?,
        agent_ip: row.get(4)?,
        rnic_ip: row.get(5)?,
        tor_id: row.get(6)?,
        udp_port: row.get(7)?,
        last_updated: row.get(8)?,
    })
}

impl Raw {
    fn into_rnic(self) -> Result<Rnic, StoreError> {
        let corrupt = |detail: String| StoreError::Corrupt {
            gid: self.gid.clone(),
            detail,
        };
        let num = |v: i64, what: &str| {
            u32::try_from(v).map_err(|_| corrupt(format!("{what} {v} out of range")))
        };
        Ok(Rnic {
            gid: self.gid.parse().map_err(|e| corrupt(format!("{e}")))?,
            qpn: num(self.qpn, "qpn")?,
            qkey: num(self.qkey, "qkey")?,
            rnic_ip: self
                .rnic_ip
                .parse()
                .map_err(|_| corrupt(format!("rnic_ip {:?}", self.rnic_ip)))?,
            udp_port: u16::try_from(self.udp_port)
                .map_err(|_| corrupt(format!("udp_port {}", self.udp_port)))?,
            last_updated_ms: u64::try_from(self.last_updated)
                .map_err(|_| corrupt(format!("last_updated {}", self.last_updated)))?,
            agent_id: self.agent_id,
            agent_ip: self.agent_ip,
            tor_id: self.tor_id,
        })
    }
}

impl RnicStore for SqliteStore {
    fn upsert(&self, r: &Rnic) -> Result<(), StoreError> {
        let conn = self.conn.lock();
        conn.prepare_cached(&format!(
            "INSERT OR REPLACE INTO rnics ({COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)"
        ))?
        .execute(params![
            r.gid.to_string(),
            r.qpn,
            r.qkey,
            r.agent_id,
            r.agent_ip,
            r.rnic_ip.to_string(),
            r.tor_id,
            r.udp_port,
            r.last_updated_ms as i64,
        ])?;
        Ok(())
    }

    fn get(&self, gid: &Gid) -> Result<Option<Rnic>, StoreError> {
        let conn = self.conn.lock();
        let row = conn
            .prepare_cached(&format!("SELECT {COLUMNS} FROM rnics WHERE rnic_gid = ?1"))?
            .query_row([gid.to_string()], raw)
            .optional()?;
        row.map(Raw::into_rnic).transpose()
    }

    fn by_ip(&self, ip: IpAddr) -> Result<Option<Rnic>, StoreError> {
        Ok(self
            .query(
                &format!("SELECT {COLUMNS} FROM rnics WHERE rnic_ip = ?1 LIMIT 1"),
                Some(&ip.to_string()),
            )?
            .pop())
    }

    fn by_tor(&self, tor: &str) -> Result<Vec<Rnic>, StoreError> {
        self.query(
            &format!("SELECT {COLUMNS} FROM rnics WHERE tor_id = ?1 ORDER BY rnic_gid"),
            Some(tor),
        )
    }

    fn all(&self) -> Result<Vec<Rnic>, StoreError> {
        self.query(
            &format!("SELECT {COLUMNS} FROM rnics ORDER BY rnic_gid"),
            None,
        )
    }

    fn expire(&self, cutoff_ms: u64) -> Result<usize, StoreError> {
        let conn = self.conn.lock();
        Ok(conn
            .prepare_cached("DELETE FROM rnics WHERE last_updated < ?1")?
            .execute([cutoff_ms as i64])?)
    }

    fn len(&self) -> Result<usize, StoreError> {
        let conn = self.conn.lock();
        let n: i64 = conn.query_row("SELECT COUNT(*) FROM rnics", [], |r| r.get(0))?;
        Ok(n as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_contract() {
        super::super::contract::check(&SqliteStore::in_memory().unwrap());
    }

    #[test]
    fn entries_survive_a_restart_in_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("registry.db");
        let r = super::super::contract::rnic(4, "tor-a", 10);
        SqliteStore::open(&path).unwrap().upsert(&r).unwrap();
        let again = SqliteStore::open(&path).unwrap();
        assert_eq!(again.get(&r.gid).unwrap(), Some(r));
    }

    #[test]
    fn a_damaged_row_is_an_error_that_names_it() {
        let store = SqliteStore::in_memory().unwrap();
        store
            .conn
            .lock()
            .execute(
                &format!("INSERT INTO rnics ({COLUMNS}) VALUES ('junk', 1, 1, 'a', 'b', 'not-an-ip', 't', 1, 1)"),
                [],
            )
            .unwrap();
        let err = store.all().unwrap_err().to_string();
        assert!(err.contains("junk"), "{err}");
    }
}

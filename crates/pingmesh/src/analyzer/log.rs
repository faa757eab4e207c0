//! The analyzer's results on disk: the window's probe results in SQLite (the
//! registry's database file, table `results`), so a restarted analyzer judges the
//! same window it had instead of starting blind. Prometheus' `/metrics` is the way to
//! a real time-series database; this keeps the window only.

use std::path::Path;

use dpumesh_dpa::fabric::ud::Gid;
use parking_lot::Mutex;
use rusqlite::{Connection, params};

use super::record::{Kind, Outcome, Record};

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS results (
    at_ms              INTEGER NOT NULL,
    prober             TEXT NOT NULL,
    target_agent       TEXT NOT NULL,
    src_gid            TEXT NOT NULL,
    dst_gid            TEXT NOT NULL,
    src_qpn            INTEGER NOT NULL,
    dst_qpn            INTEGER NOT NULL,
    flow_label         INTEGER NOT NULL,
    src_port           INTEGER NOT NULL,
    kind               INTEGER NOT NULL,
    outcome            INTEGER NOT NULL,
    rtt_ns             INTEGER NOT NULL,
    prober_delay_ns    INTEGER NOT NULL,
    responder_delay_ns INTEGER NOT NULL,
    services           TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS results_at ON results (at_ms);
";

/// Why the results could not be read or written.
#[derive(Debug, thiserror::Error)]
#[error("analyzer results database: {0}")]
pub struct LogError(#[from] rusqlite::Error);

/// The window's results in an SQLite database.
#[derive(Debug)]
pub struct ResultLog {
    conn: Mutex<Connection>,
}

fn kind_code(k: Kind) -> i64 {
    match k {
        Kind::TorMesh => 0,
        Kind::InterTor => 1,
        Kind::Service => 2,
    }
}

fn outcome_code(o: Outcome) -> i64 {
    match o {
        Outcome::Ok => 0,
        Outcome::Timeout => 1,
        Outcome::SendFailed => 2,
    }
}

impl ResultLog {
    /// Opens (or creates) the table in the database at `path`.
    pub fn open(path: &Path) -> Result<Self, LogError> {
        Self::with(Connection::open(path)?)
    }

    /// A database in memory (for tests).
    pub fn in_memory() -> Result<Self, LogError> {
        Self::with(Connection::open_in_memory()?)
    }

    fn with(conn: Connection) -> Result<Self, LogError> {
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.execute_batch(SCHEMA)?;
        Ok(Self {
            conn: Mutex::new(conn),
        })
    }

    /// Appends one upload's results in one transaction.
    pub fn append(&self, records: &[Record]) -> Result<(), LogError> {
        if records.is_empty() {
            return Ok(());
        }
        let mut conn = self.conn.lock();
        let tx = conn.transaction()?;
        {
            let mut insert = tx.prepare_cached(
                "INSERT INTO results VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15)",
            )?;
            for r in records {
                let services = serde_json::to_string(&r.services).unwrap_or_else(|_| "[]".into());
                insert.execute(params![
                    r.at_ms as i64,
                    r.prober,
                    r.target_agent,
                    r.src.to_string(),
                    r.dst.to_string(),
                    r.src_qpn,
                    r.dst_qpn,
                    r.flow_label,
                    r.src_port,
                    kind_code(r.kind),
                    outcome_code(r.outcome),
                    r.rtt_ns,
                    r.prober_delay_ns,
                    r.responder_delay_ns,
                    services,
                ])?;
            }
        }
        tx.commit()?;
        Ok(())
    }

    /// Removes results received before `cutoff_ms`; how many.
    pub fn prune(&self, cutoff_ms: u64) -> Result<usize, LogError> {
        Ok(self
            .conn
            .lock()
            .execute("DELETE FROM results WHERE at_ms < ?1", [cutoff_ms as i64])?)
    }

    /// The results received since `since_ms`, oldest first, and how many rows did not
    /// read as a result (skipped: a damaged row costs its probe, not the window).
    pub fn load(&self, since_ms: u64) -> Result<(Vec<Record>, usize), LogError> {
        let conn = self.conn.lock();
        let mut query = conn.prepare(
            "SELECT at_ms, prober, target_agent, src_gid, dst_gid, src_qpn, dst_qpn, flow_label, \
             src_port, kind, outcome, rtt_ns, prober_delay_ns, responder_delay_ns, services \
             FROM results WHERE at_ms >= ?1 ORDER BY at_ms, rowid",
        )?;
        let mut rows = query.query([since_ms as i64])?;
        let (mut out, mut damaged) = (Vec::new(), 0);
        while let Some(row) = rows.next()? {
            match decode(row) {
                Some(r) => out.push(r),
                None => damaged += 1,
            }
        }
        Ok((out, damaged))
    }
}

fn decode(row: &rusqlite::Row<'_>) -> Option<Record> {
    let gid = |i: usize| row.get::<_, String>(i).ok()?.parse::<Gid>().ok();
    let kind = match row.get::<_, i64>(9).ok()? {
        0 => Kind::TorMesh,
        1 => Kind::InterTor,
        2 => Kind::Service,
        _ => return None,
    };
    let outcome = match row.get::<_, i64>(10).ok()? {
        0 => Outcome::Ok,
        1 => Outcome::Timeout,
        2 => Outcome::SendFailed,
        _ => return None,
    };
    Some(Record {
        at_ms: u64::try_from(row.get::<_, i64>(0).ok()?).ok()?,
        prober: row.get(1).ok()?,
        target_agent: row.get(2).ok()?,
        src: gid(3)?,
        dst: gid(4)?,
        src_qpn: row.get(5).ok()?,
        dst_qpn: row.get(6).ok()?,
        flow_label: row.get(7).ok()?,
        src_port: row.get(8).ok()?,
        kind,
        outcome,
        rtt_ns: row.get(11).ok()?,
        prober_delay_ns: row.get(12).ok()?,
        responder_delay_ns: row.get(13).ok()?,
        services: serde_json::from_str(&row.get::<_, String>(14).ok()?).ok()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(at_ms: u64, prober: &str, outcome: Outcome) -> Record {
        Record {
            at_ms,
            prober: prober.into(),
            target_agent: "b".into(),
            src: Gid::from_ip("10.0.0.1".parse().unwrap()),
            dst: Gid::from_ip("10.0.0.2".parse().unwrap()),
            src_qpn: 7,
            dst_qpn: 9,
            flow_label: 0xABCDE,
            src_port: 49_152,
            kind: Kind::InterTor,
            outcome,
            rtt_ns: 12_345,
            prober_delay_ns: 2_000,
            responder_delay_ns: 900,
            services: vec!["reservation".into()],
        }
    }

    #[test]
    fn results_come_back_as_written_and_old_ones_go() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pm.db");
        let written = vec![
            record(1_000, "a", Outcome::Ok),
            record(2_000, "a", Outcome::Timeout),
            record(3_000, "c", Outcome::SendFailed),
        ];
        ResultLog::open(&path).unwrap().append(&written).unwrap();
        // Another process opening the same file (a restarted analyzer) reads them.
        let log = ResultLog::open(&path).unwrap();
        assert_eq!(log.load(0).unwrap(), (written.clone(), 0));
        assert_eq!(log.load(1_500).unwrap().0, written[1..]);
        assert_eq!(log.prune(2_500).unwrap(), 2);
        assert_eq!(log.load(0).unwrap().0, written[2..]);
    }

    #[test]
    fn a_damaged_row_is_skipped_and_counted() {
        let log = ResultLog::in_memory().unwrap();
        log.append(&[record(1_000, "a", Outcome::Ok)]).unwrap();
        log.conn
            .lock()
            .execute("UPDATE results SET src_gid = 'not a gid'", [])
            .unwrap();
        log.append(&[record(2_000, "a", Outcome::Ok)]).unwrap();
        let (records, damaged) = log.load(0).unwrap();
        assert_eq!((records.len(), damaged), (1, 1));
        assert_eq!(records[0].at_ms, 2_000);
    }
}

//! What the node shows of each exchange beyond its counters: a [`Record`] per request
//! for the live tap ([`tap`]) and the access log ([`access_log`]). Records are built
//! only when one of them wants the request (a tap open and matching, the access log's
//! sample): with neither, a response costs two relaxed loads here.

pub mod access_log;
pub mod record;
pub mod redact;
pub mod tap;

use std::sync::Arc;

pub use record::{Probe, Record};

/// The node's taps and access log, shared by its shards and its admin API.
#[derive(Debug)]
pub struct Observer {
    /// The node's name, in every record.
    pub node: Arc<str>,
    pub taps: tap::Taps,
    pub access_log: access_log::AccessLogs,
    /// The span exporter, when OpenTelemetry's environment names a collector.
    pub traces: Option<dpumesh_traces::Exporter>,
    /// Filters' per-request times are taken while spans are exported (their events).
    _timing: Option<dpumesh_runtime::timing::TimingGuard>,
}

/// Who wants a request's record.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Wanted {
    pub tap: bool,
    pub log: bool,
}

impl Wanted {
    pub fn any(self) -> bool {
        self.tap || self.log
    }
}

impl Default for Observer {
    fn default() -> Self {
        Self::new("")
    }
}

impl Observer {
    pub fn new(node: &str) -> Self {
        Self {
            node: Arc::from(node),
            taps: tap::Taps::default(),
            access_log: access_log::AccessLogs::default(),
            traces: None,
            _timing: None,
        }
    }

    /// Exports spans with `traces`.
    pub fn with_traces(mut self, traces: Option<dpumesh_traces::Exporter>) -> Self {
        self._timing = traces.as_ref().map(|_| dpumesh_runtime::timing::want());
        self.traces = traces;
        self
    }

    /// Whether anything may want records at all (one load each; the fast way out).
    #[inline]
    pub fn watching(&self) -> bool {
        self.taps.open() || self.access_log.on()
    }

    /// Who wants the request `probe` describes (sampling decided here).
    pub fn wanted(&self, probe: &Probe<'_>) -> Wanted {
        Wanted {
            tap: self.taps.open() && self.taps.wants(probe),
            log: self.access_log.on() && self.access_log.samples(),
        }
    }

    /// Hands `record` to those that wanted it.
    pub fn emit(&self, record: Record, wanted: Wanted) {
        let record = Arc::new(record);
        if wanted.log {
            self.access_log.write(&record);
        }
        if wanted.tap {
            self.taps.offer(&record);
        }
    }
}

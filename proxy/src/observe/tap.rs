//! Live tap: streams of the requests matching a query, as Linkerd's `tap` gives.
//!
//! Nothing is built for a tap until one is open: [`Taps::open`] is one relaxed load
//! per response. An open tap costs the match of the requests it sees and, for those
//! that match, a record per request up to its rate (by default [`DEFAULT_RATE`] a
//! second; past it requests are skipped, as a sample). A reader slower than its
//! stream loses records (counted in `dpumesh_tap_dropped_total`) rather than holding
//! the data path: records are offered with `try_send` into a bounded queue.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use parking_lot::RwLock;
use tokio::sync::mpsc;

use super::record::{Probe, Record};

/// Records a second one tap gets at most, unless it asks for another rate.
pub const DEFAULT_RATE: u32 = 100;
/// The highest rate a tap may ask for.
pub const MAX_RATE: u32 = 10_000;
/// Taps one node serves at once.
pub const MAX_TAPS: usize = 16;
/// Records queued for one tap's reader.
const QUEUE: usize = 1024;

/// A tap's query was not understood.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TapError {
    #[error("tap parameter {name}: {why}")]
    Parameter { name: String, why: String },
    #[error("{MAX_TAPS} taps are open on this node already")]
    TooMany,
}

/// Which statuses a tap wants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatusMatch {
    /// One status (`503`).
    Exact(u16),
    /// A class (`5xx`).
    Class(u16),
}

impl StatusMatch {
    fn parse(text: &str) -> Option<Self> {
        let lower = text.to_ascii_lowercase();
        if let Some(digit) = lower.strip_suffix("xx") {
            let class: u16 = digit.parse().ok()?;
            return (1..=5).contains(&class).then_some(Self::Class(class));
        }
        let status: u16 = lower.parse().ok()?;
        (100..=599).contains(&status).then_some(Self::Exact(status))
    }

    fn matches(self, status: u16) -> bool {
        match self {
            Self::Exact(s) => s == status,
            Self::Class(c) => status / 100 == c,
        }
    }
}

/// What a tap wants to see: every field given must match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TapQuery {
    pub service: Option<String>,
    pub route: Option<String>,
    pub source: Option<String>,
    pub method: Option<String>,
    /// A path prefix.
    pub path: Option<String>,
    pub status: Option<StatusMatch>,
    /// Records a second at most.
    pub rate: u32,
}

impl Default for TapQuery {
    fn default() -> Self {
        Self {
            service: None,
            route: None,
            source: None,
            method: None,
            path: None,
            status: None,
            rate: DEFAULT_RATE,
        }
    }
}

impl TapQuery {
    /// A query from decoded URL parameters: `service`, `route`, `source`, `method`,
    /// `path` (a prefix), `status` (`503` or `5xx`), `rate` (records a second).
    pub fn from_params<'a>(
        params: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<Self, TapError> {
        let bad = |name: &str, why: &str| TapError::Parameter {
            name: name.to_owned(),
            why: why.to_owned(),
        };
        let mut q = Self::default();
        for (name, value) in params {
            if value.is_empty() {
                continue;
            }
            if value.len() > 1024 {
                return Err(bad(name, "longer than 1024 bytes"));
            }
            match name {
                "service" => q.service = Some(value.to_owned()),
                "route" => q.route = Some(value.to_owned()),
                "source" => q.source = Some(value.to_owned()),
                "method" => q.method = Some(value.to_ascii_uppercase()),
                "path" => {
                    if !value.starts_with('/') {
                        return Err(bad(name, "a path prefix starts with /"));
                    }
                    q.path = Some(value.to_owned());
                }
                "status" => {
                    q.status = Some(
                        StatusMatch::parse(value)
                            .ok_or_else(|| bad(name, "a status (100-599) or a class (1xx-5xx)"))?,
                    )
                }
                "rate" => {
                    q.rate = value
                        .parse()
                        .ok()
                        .filter(|r| (1..=MAX_RATE).contains(r))
                        .ok_or_else(|| bad(name, &format!("records a second, 1 to {MAX_RATE}")))?
                }
                other => {
                    return Err(bad(
                        other,
                        "unknown (service, route, source, method, path, status, rate)",
                    ));
                }
            }
        }
        Ok(q)
    }

    /// Whether a request like `probe` is one this tap wants.
    pub fn matches(&self, probe: &Probe<'_>) -> bool {
        self.service.as_deref().is_none_or(|s| s == probe.service)
            && self.route.as_deref().is_none_or(|r| r == probe.route)
            && self.source.as_deref().is_none_or(|s| s == probe.source)
            && self.method.as_deref().is_none_or(|m| m == probe.method)
            && self
                .path
                .as_deref()
                .is_none_or(|p| probe.path.starts_with(p))
            && self.status.is_none_or(|s| s.matches(probe.status))
    }
}

struct Subscriber {
    id: u64,
    query: TapQuery,
    tx: mpsc::Sender<Arc<Record>>,
    /// The second (Unix time) `sent` counts.
    second: AtomicU64,
    sent: AtomicU32,
}

impl Subscriber {
    /// Takes one record of this second's budget; `false` when spent.
    fn take_budget(&self, now: u64) -> bool {
        if self.second.load(Ordering::Relaxed) != now {
            // A new second: whoever swaps it first resets the count (a race loses a
            // few records of budget, never grants many more).
            if self.second.swap(now, Ordering::Relaxed) != now {
                self.sent.store(0, Ordering::Relaxed);
            }
        }
        self.sent.fetch_add(1, Ordering::Relaxed) < self.query.rate
    }

    fn has_budget(&self, now: u64) -> bool {
        self.second.load(Ordering::Relaxed) != now
            || self.sent.load(Ordering::Relaxed) < self.query.rate
    }
}

#[derive(Default)]
struct Inner {
    open: AtomicUsize,
    next_id: AtomicU64,
    subscribers: RwLock<Vec<Arc<Subscriber>>>,
}

/// The node's open taps.
#[derive(Default, Clone)]
pub struct Taps {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Taps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Taps")
            .field("open", &self.inner.open.load(Ordering::Relaxed))
            .finish()
    }
}

fn unix_second() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl Taps {
    /// Whether any tap is open.
    #[inline]
    pub fn open(&self) -> bool {
        self.inner.open.load(Ordering::Relaxed) != 0
    }

    /// Opens a tap: its stream of records until it is dropped.
    pub fn subscribe(&self, query: TapQuery) -> Result<TapStream, TapError> {
        let mut subscribers = self.inner.subscribers.write();
        if subscribers.len() >= MAX_TAPS {
            return Err(TapError::TooMany);
        }
        let (tx, rx) = mpsc::channel(QUEUE);
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        subscribers.push(Arc::new(Subscriber {
            id,
            query,
            tx,
            second: AtomicU64::new(0),
            sent: AtomicU32::new(0),
        }));
        self.inner.open.store(subscribers.len(), Ordering::Relaxed);
        metrics::gauge!("dpumesh_taps_open").set(subscribers.len() as f64);
        Ok(TapStream {
            rx,
            id,
            taps: self.clone(),
            _timing: dpumesh_runtime::timing::want(),
        })
    }

    /// Whether some open tap wants a request like `probe` and has budget for it.
    pub fn wants(&self, probe: &Probe<'_>) -> bool {
        let now = unix_second();
        self.inner
            .subscribers
            .read()
            .iter()
            .any(|s| s.query.matches(probe) && s.has_budget(now))
    }

    /// Queues `record` for every tap that wants it.
    pub fn offer(&self, record: &Arc<Record>) {
        let probe = Probe {
            service: &record.service,
            route: &record.route,
            source: &record.source,
            method: &record.method,
            path: &record.path,
            status: record.status,
        };
        let now = unix_second();
        for s in self.inner.subscribers.read().iter() {
            if s.query.matches(&probe)
                && s.take_budget(now)
                && s.tx.try_send(record.clone()).is_err()
            {
                metrics::counter!("dpumesh_tap_dropped_total").increment(1);
            }
        }
    }

    fn close(&self, id: u64) {
        let mut subscribers = self.inner.subscribers.write();
        subscribers.retain(|s| s.id != id);
        self.inner.open.store(subscribers.len(), Ordering::Relaxed);
        metrics::gauge!("dpumesh_taps_open").set(subscribers.len() as f64);
    }
}

/// One open tap's records; the tap closes when this is dropped.
pub struct TapStream {
    rx: mpsc::Receiver<Arc<Record>>,
    id: u64,
    taps: Taps,
    /// Filters' per-request times are taken while a tap is open.
    _timing: dpumesh_runtime::timing::TimingGuard,
}

impl TapStream {
    /// The next record, polled.
    pub fn poll_next(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Arc<Record>>> {
        self.rx.poll_recv(cx)
    }

    /// A record already queued, without waiting.
    pub fn try_next(&mut self) -> Option<Arc<Record>> {
        self.rx.try_recv().ok()
    }
}

impl Drop for TapStream {
    fn drop(&mut self) {
        self.taps.close(self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probe(service: &'static str, path: &'static str, status: u16) -> Probe<'static> {
        Probe {
            service,
            route: "*/",
            source: "ingress",
            method: "GET",
            path,
            status,
        }
    }

    fn record(service: &str, path: &str, status: u16) -> Arc<Record> {
        Arc::new(Record {
            start_ms: 0,
            node: Arc::from("n"),
            method: "GET".into(),
            authority: "h".into(),
            path: path.into(),
            status,
            grpc_status: None,
            source: "ingress".into(),
            service: service.into(),
            route: Arc::from("*/"),
            duration_us: 1.0,
            verdict: super::super::record::Verdict::Allowed,
            denied_by: None,
            failure: "none",
            attempts: 1,
            upstream: None,
            filters: Vec::new(),
            request_id: None,
            trace_id: None,
            user_agent: None,
            headers: Vec::new(),
        })
    }

    #[test]
    fn queries_parse_and_bad_ones_are_named() {
        let q = TapQuery::from_params([("service", "hotel"), ("status", "5xx"), ("path", "/h")])
            .unwrap();
        assert!(q.matches(&probe("hotel", "/hotels", 503)));
        assert!(!q.matches(&probe("hotel", "/hotels", 200)));
        assert!(!q.matches(&probe("user", "/hotels", 503)));
        assert!(!q.matches(&probe("hotel", "/x", 503)));
        for (name, value) in [
            ("status", "6xx"),
            ("status", "99"),
            ("rate", "0"),
            ("rate", "100001"),
            ("path", "nope"),
            ("colour", "red"),
        ] {
            let e = TapQuery::from_params([(name, value)]).unwrap_err();
            assert!(e.to_string().contains(name), "{e}");
        }
    }

    #[test]
    fn a_tap_gets_what_matches_up_to_its_rate_and_closing_it_stops_the_cost() {
        let taps = Taps::default();
        assert!(!taps.open());
        let mut tap = taps
            .subscribe(TapQuery {
                status: Some(StatusMatch::Class(5)),
                rate: 3,
                ..TapQuery::default()
            })
            .unwrap();
        assert!(taps.open());
        assert!(dpumesh_runtime::timing::wanted());
        assert!(!taps.wants(&probe("hotel", "/", 200)));
        assert!(taps.wants(&probe("hotel", "/", 500)));
        for _ in 0..10 {
            taps.offer(&record("hotel", "/", 500));
            taps.offer(&record("hotel", "/", 200));
        }
        let mut got = Vec::new();
        while let Some(r) = tap.try_next() {
            got.push(r.status);
        }
        // At most its rate (a second boundary in the loop may give one more batch).
        assert!((3..=6).contains(&got.len()), "{got:?}");
        assert!(got.iter().all(|s| *s == 500));
        drop(tap);
        assert!(!taps.open());
    }

    #[test]
    fn taps_are_bounded() {
        let taps = Taps::default();
        let open: Vec<_> = (0..MAX_TAPS)
            .map(|_| taps.subscribe(TapQuery::default()).unwrap())
            .collect();
        assert_eq!(
            taps.subscribe(TapQuery::default()).err(),
            Some(TapError::TooMany)
        );
        drop(open);
        assert!(!taps.open());
    }
}

//! The access log: a JSON line per sampled request, its fields the config's templates
//! of Envoy-style operators ([`dpumesh_config::access_log`]), written by a thread of
//! its own. The shard hands it the record (one `try_send`); formatting and the
//! `write` happen off the data path, a batch of lines per `write`. A log that cannot
//! keep up loses lines (`dpumesh_access_log_dropped_total`) rather than slowing
//! requests.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use arc_swap::ArcSwapOption;
use crossbeam_channel::{Receiver, Sender, TrySendError};
use dpumesh_config::access_log::{Operator, Piece, Template};
use dpumesh_config::{AccessLogConfig, LoadedConfig};
use serde_json::{Map, Value};

use super::record::Record;
use super::redact;

/// Lines queued for the writer.
const QUEUE: usize = 16 * 1024;
/// Bytes gathered before a write (a write also happens when the queue is empty).
const BATCH: usize = 64 * 1024;
/// How long the writer sleeps between looks at its queue.
const LINGER: Duration = Duration::from_millis(100);

/// The node's access log, replaced when a reload changes its settings.
#[derive(Debug, Default)]
pub struct AccessLogs {
    current: ArcSwapOption<AccessLog>,
}

/// One configured access log.
#[derive(Debug)]
pub struct AccessLog {
    config: AccessLogConfig,
    target: String,
    /// Requests seen, for the sample.
    seen: AtomicU64,
    tx: Sender<Arc<Record>>,
}

impl AccessLogs {
    /// Whether an access log is configured.
    #[inline]
    pub fn on(&self) -> bool {
        self.current.load().is_some()
    }

    /// Whether this request is in the sample: every request at 1, one in N at 1/N
    /// (exact over time: the count of logged requests tracks seen × sample).
    pub fn samples(&self) -> bool {
        let current = self.current.load();
        let Some(log) = current.as_ref() else {
            return false;
        };
        let n = log.seen.fetch_add(1, Ordering::Relaxed);
        let s = log.config.sample;
        s >= 1.0 || ((n + 1) as f64 * s).floor() > (n as f64 * s).floor()
    }

    /// Queues `record`'s line.
    pub fn write(&self, record: &Arc<Record>) {
        if let Some(log) = self.current.load().as_ref()
            && let Err(TrySendError::Full(_)) = log.tx.try_send(record.clone())
        {
            metrics::counter!("dpumesh_access_log_dropped_total").increment(1);
        }
    }

    /// Applies `config`'s `access_log` (a checked config): starts a writer for a new
    /// or changed one, stops the old one (it writes what it was given first).
    pub fn configure(&self, config: &LoadedConfig, node: &str) -> std::io::Result<()> {
        let wanted = config.config.access_log.as_ref();
        let target = wanted.map(|c| target(config, c, node));
        let current = self.current.load();
        let same = match (current.as_ref(), wanted) {
            (Some(log), Some(c)) => log.config == *c && Some(&log.target) == target.as_ref(),
            (None, None) => true,
            _ => false,
        };
        if same {
            return Ok(());
        }
        let (Some(c), Some(target)) = (wanted, target) else {
            self.current.store(None);
            return Ok(());
        };
        let fields = c
            .fields()
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        let sink: Box<dyn Write + Send> = if target == "-" {
            Box::new(std::io::stdout())
        } else {
            let path = PathBuf::from(&target);
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir)?;
            }
            Box::new(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&path)?,
            )
        };
        let (tx, rx) = crossbeam_channel::bounded(QUEUE);
        let node: Arc<str> = Arc::from(node);
        std::thread::Builder::new()
            .name("dpumesh-access-log".to_owned())
            .spawn(move || write_lines(rx, sink, fields, node))?;
        tracing::info!(target = %target, sample = c.sample, "access log on");
        self.current.store(Some(Arc::new(AccessLog {
            config: c.clone(),
            target,
            seen: AtomicU64::new(0),
            tx,
        })));
        Ok(())
    }
}

/// Where `c`'s lines go: `-`, or its path (`{node}` replaced) beside the config.
fn target(config: &LoadedConfig, c: &AccessLogConfig, node: &str) -> String {
    if c.path == "-" {
        return "-".to_owned();
    }
    let path = c.path.replace("{node}", node);
    config
        .resolve(std::path::Path::new(&path))
        .display()
        .to_string()
}

/// The writer thread: lines in batches until every sender is gone.
fn write_lines(
    rx: Receiver<Arc<Record>>,
    mut sink: Box<dyn Write + Send>,
    fields: Vec<(String, Template)>,
    node: Arc<str>,
) {
    let mut batch = Vec::with_capacity(BATCH);
    loop {
        // Asleep, not waiting on the queue: a shard's `try_send` never wakes this
        // thread (a wake-up per request would double the node's context switches);
        // a line waits at most `LINGER` for its write.
        std::thread::sleep(LINGER);
        loop {
            let (drained, gone) = match rx.try_recv() {
                Ok(record) => {
                    let line = Value::Object(line(&fields, &record, &node));
                    if serde_json::to_writer(&mut batch, &line).is_ok() {
                        batch.push(b'\n');
                    }
                    if batch.len() < BATCH {
                        continue;
                    }
                    (false, false)
                }
                Err(crossbeam_channel::TryRecvError::Empty) => (true, false),
                Err(crossbeam_channel::TryRecvError::Disconnected) => (true, true),
            };
            // Whole lines per write: with O_APPEND, writers of one file (two
            // generations for a moment) never interleave within a line.
            if !batch.is_empty() {
                if let Err(e) = sink.write_all(&batch).and_then(|()| sink.flush()) {
                    tracing::warn!(error = %e, "access log write failed; lines lost");
                    metrics::counter!("dpumesh_access_log_dropped_total").increment(1);
                }
                batch.clear();
            }
            if gone {
                return;
            }
            if drained {
                break;
            }
        }
    }
}

/// The JSON object of one request.
pub fn line(fields: &[(String, Template)], r: &Record, node: &str) -> Map<String, Value> {
    fields
        .iter()
        .map(|(name, template)| (name.clone(), value(template, r, node)))
        .collect()
}

fn value(template: &Template, r: &Record, node: &str) -> Value {
    match template.0.as_slice() {
        [Piece::Op(op)] => typed(op, r, node),
        pieces => {
            let mut text = String::new();
            for piece in pieces {
                match piece {
                    Piece::Text(t) => text.push_str(t),
                    Piece::Op(op) => match typed(op, r, node) {
                        Value::String(s) => text.push_str(&s),
                        Value::Null => text.push('-'),
                        other => text.push_str(&other.to_string()),
                    },
                }
            }
            Value::String(text)
        }
    }
}

fn typed(op: &Operator, r: &Record, node: &str) -> Value {
    let text = |s: &str| Value::String(s.to_owned());
    let maybe = |s: Option<&str>| s.map_or(Value::Null, text);
    match op {
        Operator::StartTime => Value::String(rfc3339_ms(r.start_ms)),
        Operator::Method => text(&r.method),
        Operator::Path => text(&r.path),
        Operator::Authority => text(&r.authority),
        Operator::Header(name) => maybe(
            r.headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(n, v)| redact::header_value(n, v)),
        ),
        Operator::ResponseCode => Value::from(r.status),
        Operator::GrpcStatus => r.grpc_status.map_or(Value::Null, Value::from),
        Operator::Duration => Value::from((r.duration_us / 1e3 * 1e3).round() / 1e3),
        Operator::ResponseFlags => text(r.failure),
        Operator::UpstreamHost => maybe(r.upstream.as_deref()),
        Operator::UpstreamCluster => text(&r.service),
        Operator::RouteName => text(&r.route),
        Operator::Source => text(&r.source),
        Operator::Attempts => Value::from(r.attempts),
        Operator::Hostname => text(node),
        Operator::TraceId => maybe(r.trace_id.as_deref()),
        Operator::Verdict => serde_json::to_value(r.verdict).unwrap_or(Value::Null),
        Operator::DeniedBy => maybe(r.denied_by.as_deref()),
        Operator::FilterDurations => Value::String(
            r.filters
                .iter()
                .map(|f| format!("{}={:.1}", f.filter, f.us))
                .collect::<Vec<_>>()
                .join(","),
        ),
    }
}

/// `ms` since the Unix epoch as `YYYY-MM-DDTHH:MM:SS.mmmZ`.
pub fn rfc3339_ms(ms: u64) -> String {
    let secs = ms / 1000;
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        ms % 1000
    )
}

#[cfg(test)]
mod tests {
    use super::super::record::{FilterTime, Verdict};
    use super::*;

    fn record() -> Record {
        Record {
            start_ms: 1_764_417_600_123,
            node: Arc::from("node-a"),
            method: "GET".into(),
            authority: "hotel.local".into(),
            path: "/hotels?access_token=[redacted]".into(),
            status: 401,
            grpc_status: None,
            source: "ingress".into(),
            service: "frontend".into(),
            route: Arc::from("*/"),
            duration_us: 1234.5,
            verdict: Verdict::Denied,
            denied_by: Some(Arc::from("jwt")),
            failure: "local_reply",
            attempts: 0,
            upstream: None,
            filters: vec![FilterTime {
                filter: Arc::from("jwt"),
                us: 12.5,
            }],
            request_id: None,
            trace_id: None,
            user_agent: None,
            headers: vec![
                ("x-request-id".into(), "r-1".into()),
                ("authorization".into(), "Bearer secret".into()),
            ],
        }
    }

    #[test]
    fn the_default_line_has_envoys_fields_typed_and_no_secret() {
        let c: AccessLogConfig = serde_norway::from_str("{}").unwrap();
        let fields = c.fields().unwrap();
        let line = Value::Object(line(&fields, &record(), "node-a"));
        assert_eq!(line["start_time"], "2025-11-29T12:00:00.123Z");
        assert_eq!(line["response_code"], 401);
        assert_eq!(line["duration"], 1.235);
        assert_eq!(line["verdict"], "denied");
        assert_eq!(line["denied_by"], "jwt");
        assert_eq!(line["x_request_id"], "r-1");
        assert_eq!(line["grpc_status"], Value::Null);
        assert_eq!(line["node"], "node-a");
        assert!(!line.to_string().contains("secret"), "{line}");
    }

    #[test]
    fn configured_templates_mix_text_and_redact_credentials() {
        let c: AccessLogConfig = serde_norway::from_str(
            "{fields: {req: '%REQ(:METHOD)% %REQ(:PATH)% %RESPONSE_CODE%', auth: '%REQ(AUTHORIZATION)%', f: '%FILTER_DURATIONS%', none: '%REQ(X-NOPE)%'}}",
        )
        .unwrap();
        let line = Value::Object(line(&c.fields().unwrap(), &record(), "n"));
        assert_eq!(line["req"], "GET /hotels?access_token=[redacted] 401");
        assert_eq!(line["auth"], redact::REDACTED);
        assert_eq!(line["f"], "jwt=12.5");
        assert_eq!(line["none"], Value::Null);
    }

    #[test]
    fn sampling_logs_the_configured_share_exactly() {
        let dir = std::env::temp_dir().join(format!("dpumesh-al-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("p.yaml");
        let text = "access_log: {path: 'log-{node}.jsonl', sample: 0.25}\n";
        std::fs::write(&file, text).unwrap();
        let config = LoadedConfig::parse(&file, text.to_owned()).unwrap();
        let logs = AccessLogs::default();
        assert!(!logs.on());
        logs.configure(&config, "n1").unwrap();
        assert!(logs.on());
        let logged = (0..1000).filter(|_| logs.samples()).count();
        assert_eq!(logged, 250);
        for _ in 0..3 {
            logs.write(&Arc::new(record()));
        }
        // Turning it off lets the writer finish what it was given.
        let off = LoadedConfig::parse(&file, String::new()).unwrap();
        logs.configure(&off, "n1").unwrap();
        assert!(!logs.on());
        let path = dir.join("log-n1.jsonl");
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let lines = loop {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            if text.lines().count() >= 3 || std::time::Instant::now() > deadline {
                break text;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        assert_eq!(lines.lines().count(), 3, "{lines}");
        for l in lines.lines() {
            let v: Value = serde_json::from_str(l).unwrap();
            assert_eq!(v["response_code"], 401);
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

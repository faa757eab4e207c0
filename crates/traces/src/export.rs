//! The exporter: spans written by the hops, already in protobuf, into one batch, and
//! posted to the collector as OTLP/HTTP by a thread of their own.
//!
//! Settings are OpenTelemetry's environment variables, so a collector set up for any
//! OpenTelemetry SDK is set up for the mesh:
//!
//! | variable | meaning |
//! | --- | --- |
//! | `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` | the full URL (`http://HOST:PORT/v1/traces`) |
//! | `OTEL_EXPORTER_OTLP_ENDPOINT` | the base URL (`/v1/traces` appended) |
//! | `OTEL_EXPORTER_OTLP_PROTOCOL` | `http/protobuf` (the one spoken; `grpc` is refused with a reason) |
//! | `OTEL_TRACES_SAMPLER_ARG` | the ratio of new traces sampled (default 1) |
//! | `OTEL_SERVICE_NAME` | the resource's `service.name` |
//! | `OTEL_SDK_DISABLED` | `true`: no spans |

use std::cell::RefCell;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::common::v1::{AnyValue, InstrumentationScope, KeyValue, any_value};
use opentelemetry_proto::tonic::resource::v1::Resource;
use parking_lot::Mutex;
use prost::Message;

use crate::span::{SpanHead, SpanWriter, field_len, put_len};

/// How long a span may wait for its batch.
const LINGER: Duration = Duration::from_millis(500);

/// Why the environment's settings were refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SettingsError {
    #[error("{var}={value:?}: {why}")]
    Bad {
        var: &'static str,
        value: String,
        why: String,
    },
}

/// Where spans go and which are sampled.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// `host:port` of the collector.
    pub authority: String,
    /// The request path (`/v1/traces`).
    pub path: String,
    /// Sampling ratio of new traces.
    pub ratio: f64,
    pub service: String,
}

impl Settings {
    /// From OpenTelemetry's variables (`lookup` reads one); `None` when no endpoint is
    /// set or the SDK is disabled.
    pub fn from_lookup(
        lookup: impl Fn(&str) -> Option<String>,
        service: &str,
    ) -> Result<Option<Self>, SettingsError> {
        let bad = |var: &'static str, value: &str, why: &str| SettingsError::Bad {
            var,
            value: value.to_owned(),
            why: why.to_owned(),
        };
        if lookup("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
            return Ok(None);
        }
        let (var, url, append) = match (
            lookup("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
            lookup("OTEL_EXPORTER_OTLP_ENDPOINT"),
        ) {
            (Some(url), _) if !url.is_empty() => ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", url, false),
            (_, Some(url)) if !url.is_empty() => ("OTEL_EXPORTER_OTLP_ENDPOINT", url, true),
            _ => return Ok(None),
        };
        for var in [
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
            "OTEL_EXPORTER_OTLP_PROTOCOL",
        ] {
            if let Some(p) = lookup(var)
                && p != "http/protobuf"
            {
                return Err(bad(
                    var,
                    &p,
                    "the mesh exports OTLP over HTTP with protobuf bodies only (http/protobuf)",
                ));
            }
        }
        let rest = url.strip_prefix("http://").ok_or_else(|| {
            bad(
                var,
                &url,
                "an http:// URL (run a collector beside the node; https is not spoken)",
            )
        })?;
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        if authority.is_empty() {
            return Err(bad(var, &url, "no host"));
        }
        let path = match (append, path.trim_end_matches('/')) {
            (true, base) => format!("{base}/v1/traces"),
            (false, "") => "/v1/traces".to_owned(),
            (false, p) => p.to_owned(),
        };
        let ratio = match lookup("OTEL_TRACES_SAMPLER_ARG") {
            Some(r) => r
                .parse::<f64>()
                .ok()
                .filter(|r| (0.0..=1.0).contains(r))
                .ok_or_else(|| bad("OTEL_TRACES_SAMPLER_ARG", &r, "a ratio from 0 to 1"))?,
            None => 1.0,
        };
        let service = lookup("OTEL_SERVICE_NAME")
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| service.to_owned());
        Ok(Some(Self {
            authority: authority.to_owned(),
            path,
            ratio,
            service,
        }))
    }

    /// From the process's environment.
    pub fn from_env(service: &str) -> Result<Option<Self>, SettingsError> {
        Self::from_lookup(|v| std::env::var(v).ok(), service)
    }
}

/// Bytes of encoded spans waiting at most (past it, new spans are dropped and counted).
const QUEUE_BYTES: usize = 8 << 20;
/// Bytes of encoded spans that wake the exporter before its `LINGER` is up.
const POST_BYTES: usize = 1 << 20;

/// Spans written and not yet posted: each one a `spans` field of `ScopeSpans`, ready
/// to follow the request's prefix.
#[derive(Default)]
struct Pending {
    bytes: Vec<u8>,
    spans: u64,
}

/// What the hops and the exporting thread share.
#[derive(Default)]
struct Shared {
    pending: Mutex<Pending>,
    closed: AtomicBool,
}

thread_local! {
    /// A hop thread's span being written, and text being formatted for it.
    static SCRATCH: RefCell<(Vec<u8>, String)> = const { RefCell::new((Vec::new(), String::new())) };
}

/// The process's exporter.
pub struct Exporter {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    ratio: f64,
    service: String,
}

impl std::fmt::Debug for Exporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Exporter")
            .field("ratio", &self.ratio)
            .field("service", &self.service)
            .finish_non_exhaustive()
    }
}

impl Exporter {
    /// Starts the exporting thread.
    pub fn start(settings: Settings) -> std::io::Result<Self> {
        let shared = Arc::new(Shared::default());
        let ratio = settings.ratio;
        let service = settings.service.clone();
        let thread = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("dpumesh-otlp".to_owned())
                .spawn(move || post_batches(&shared, &settings))?
        };
        Ok(Self {
            shared,
            thread: Some(thread),
            ratio,
            service,
        })
    }

    /// The exporter the environment asks for, if any (a bad setting is logged and no
    /// spans are exported: tracing never stops the mesh).
    pub fn from_env(service: &str) -> Option<Self> {
        match Settings::from_env(service) {
            Ok(Some(settings)) => {
                tracing::info!(collector = %settings.authority, path = %settings.path, ratio = settings.ratio, "exporting spans over OTLP/HTTP");
                Self::start(settings)
                    .inspect_err(|e| tracing::error!(error = %e, "cannot start the span exporter"))
                    .ok()
            }
            Ok(None) => None,
            Err(e) => {
                tracing::error!(error = %e, "tracing settings refused: no spans are exported");
                None
            }
        }
    }

    /// The sampling ratio of new traces.
    pub fn ratio(&self) -> f64 {
        self.ratio
    }

    /// The `service.name` its spans carry.
    pub fn service(&self) -> &str {
        &self.service
    }

    /// Records a finished span: `head`, then what `body` writes. The span is encoded
    /// on the calling thread into its scratch buffer, then appended to the batch under
    /// a lock held for one copy (dropped and counted when the batch is full). The
    /// exporter is woken only when a batch is worth posting early.
    pub fn record(&self, head: &SpanHead, body: impl FnOnce(&mut SpanWriter<'_>)) {
        SCRATCH.with_borrow_mut(|(buf, text)| {
            let mut writer = SpanWriter::start(head, buf, text);
            body(&mut writer);
            writer.finish();
            let full = {
                let mut pending = self.shared.pending.lock();
                let before = pending.bytes.len();
                if before + buf.len() + 8 > QUEUE_BYTES {
                    drop(pending);
                    metrics::counter!("dpumesh_spans_dropped_total").increment(1);
                    return;
                }
                put_len(SCOPE_SPANS_SPANS, buf.len(), &mut pending.bytes);
                pending.bytes.extend_from_slice(buf);
                pending.spans += 1;
                before < POST_BYTES && pending.bytes.len() >= POST_BYTES
            };
            if full && let Some(thread) = &self.thread {
                thread.thread().unpark();
            }
            // A rare huge span must not pin its size in every hop thread.
            if buf.capacity() > 64 << 10 {
                *buf = Vec::new();
            }
        });
    }
}

impl Drop for Exporter {
    /// Posts what is waiting, then the thread ends.
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            thread.thread().unpark();
            let _ = thread.join();
        }
    }
}

// Field numbers of OTLP's request messages (collector/trace/v1/trace_service.proto,
// trace/v1/trace.proto).
const REQUEST_RESOURCE_SPANS: u32 = 1;
const RESOURCE_SPANS_RESOURCE: u32 = 1;
const RESOURCE_SPANS_SCOPE_SPANS: u32 = 2;
const SCOPE_SPANS_SCOPE: u32 = 1;
const SCOPE_SPANS_SPANS: u32 = 2;

/// An `ExportTraceServiceRequest`'s bytes before its spans: one `ResourceSpans` (the
/// process's resource) holding one `ScopeSpans` (the mesh's scope) whose `spans` are
/// `spans_len` bytes of encoded `spans` fields.
fn request_prefix(resource: &[u8], scope: &[u8], spans_len: usize) -> Vec<u8> {
    let scope_spans = field_len(scope.len()) + spans_len;
    let resource_spans = field_len(resource.len()) + field_len(scope_spans);
    let mut out = Vec::with_capacity(32 + resource.len() + scope.len());
    put_len(REQUEST_RESOURCE_SPANS, resource_spans, &mut out);
    put_len(RESOURCE_SPANS_RESOURCE, resource.len(), &mut out);
    out.extend_from_slice(resource);
    put_len(RESOURCE_SPANS_SCOPE_SPANS, scope_spans, &mut out);
    put_len(SCOPE_SPANS_SCOPE, scope.len(), &mut out);
    out.extend_from_slice(scope);
    out
}

/// The exporting thread: posts what the hops wrote every `LINGER` (or sooner when a
/// batch is full), until the exporter is dropped.
fn post_batches(shared: &Shared, settings: &Settings) {
    let resource = Resource {
        attributes: vec![KeyValue {
            key: "service.name".to_owned(),
            value: Some(AnyValue {
                value: Some(any_value::Value::StringValue(settings.service.clone())),
            }),
        }],
        ..Resource::default()
    }
    .encode_to_vec();
    let scope = InstrumentationScope {
        name: "dpumesh".to_owned(),
        version: env!("CARGO_PKG_VERSION").to_owned(),
        ..InstrumentationScope::default()
    }
    .encode_to_vec();
    let mut batch = Pending::default();
    let mut last_warning: Option<Instant> = None;
    loop {
        // The thread sleeps rather than waiting on each span: a hop never wakes it but
        // for a full batch, and a span waits at most one `LINGER` for its post.
        let closed = shared.closed.load(Ordering::Acquire);
        if !closed {
            std::thread::park_timeout(LINGER);
        }
        std::mem::swap(&mut batch, &mut *shared.pending.lock());
        if batch.spans > 0 {
            let prefix = request_prefix(&resource, &scope, batch.bytes.len());
            match post(settings, &prefix, &batch.bytes) {
                // Counted here, not per span: the handles are looked up once a post.
                Ok(()) => metrics::counter!("dpumesh_spans_exported_total").increment(batch.spans),
                Err(e) => {
                    metrics::counter!("dpumesh_spans_dropped_total").increment(batch.spans);
                    // Once a minute at most: a collector that is down must not flood the log.
                    if last_warning.is_none_or(|at| at.elapsed() > Duration::from_secs(60)) {
                        tracing::warn!(collector = %settings.authority, error = %e, "spans not exported");
                        last_warning = Some(Instant::now());
                    }
                }
            }
        }
        batch.bytes.clear();
        batch.spans = 0;
        if batch.bytes.capacity() > 2 * POST_BYTES {
            batch.bytes = Vec::new();
        }
        if closed {
            return;
        }
    }
}

/// POSTs one protobuf body (`prefix` then `spans`); Ok when the collector answered 2xx.
fn post(settings: &Settings, prefix: &[u8], spans: &[u8]) -> std::io::Result<()> {
    let addr: SocketAddr = settings
        .authority
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| std::io::Error::other("the collector's name has no address"))?;
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.set_write_timeout(Some(Duration::from_secs(5)))?;
    let head = format!(
        "POST {} HTTP/1.1\r\nhost: {}\r\ncontent-type: application/x-protobuf\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        settings.path,
        settings.authority,
        prefix.len() + spans.len()
    );
    s.write_all(head.as_bytes())?;
    s.write_all(prefix)?;
    s.write_all(spans)?;
    let mut reader = BufReader::new(s);
    let mut status = String::new();
    reader.read_line(&mut status)?;
    let code: u16 = status
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("not an HTTP answer: {status:?}")))?;
    if !(200..300).contains(&code) {
        let mut rest = String::new();
        let _ = reader.take(1024).read_to_string(&mut rest);
        return Err(std::io::Error::other(format!(
            "the collector answered {code}: {}",
            rest.split("\r\n\r\n").nth(1).unwrap_or("").trim()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;

    use super::*;

    fn settings(vars: &[(&str, &str)]) -> Result<Option<Settings>, SettingsError> {
        Settings::from_lookup(
            |k| {
                vars.iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| (*v).to_owned())
            },
            "dpumesh-node",
        )
    }

    #[test]
    fn settings_follow_opentelemetrys_variables() {
        assert_eq!(settings(&[]), Ok(None));
        let s = settings(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")])
            .unwrap()
            .unwrap();
        assert_eq!(
            (s.authority.as_str(), s.path.as_str(), s.ratio),
            ("127.0.0.1:4318", "/v1/traces", 1.0)
        );
        assert_eq!(s.service, "dpumesh-node");
        let s = settings(&[
            (
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                "http://collector:4318/custom",
            ),
            ("OTEL_TRACES_SAMPLER_ARG", "0.25"),
            ("OTEL_SERVICE_NAME", "edge"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            (s.path.as_str(), s.ratio, s.service.as_str()),
            ("/custom", 0.25, "edge")
        );
        assert_eq!(
            settings(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
                ("OTEL_SDK_DISABLED", "true")
            ]),
            Ok(None)
        );
        for (vars, named) in [
            (
                vec![("OTEL_EXPORTER_OTLP_ENDPOINT", "https://c:4318")],
                "OTEL_EXPORTER_OTLP_ENDPOINT",
            ),
            (
                vec![
                    ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c"),
                    ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
                ],
                "OTEL_EXPORTER_OTLP_PROTOCOL",
            ),
            (
                vec![
                    ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c"),
                    ("OTEL_TRACES_SAMPLER_ARG", "2"),
                ],
                "OTEL_TRACES_SAMPLER_ARG",
            ),
        ] {
            let e = settings(&vars).unwrap_err();
            assert!(e.to_string().contains(named), "{e}");
        }
    }

    #[test]
    fn spans_reach_a_collector_as_otlp_protobuf() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let exporter = Exporter::start(Settings {
            authority: addr.to_string(),
            path: "/v1/traces".into(),
            ratio: 1.0,
            service: "test".into(),
        })
        .unwrap();
        let now = std::time::SystemTime::now();
        let head = SpanHead {
            trace_id: [1; 16],
            span_id: [2; 8],
            parent: Some([3; 8]),
            kind: crate::SpanKind::Server,
            start: now,
            end: now,
        };
        exporter.record(&head, |w| {
            w.name(format_args!("hop"))
                .attr("http.response.status_code", crate::Value::Int(200));
        });
        exporter.record(
            &SpanHead {
                span_id: [4; 8],
                ..head
            },
            |w| {
                w.name(format_args!("second {}", 2));
            },
        );
        // Dropping the exporter posts what waits.
        let closing = std::thread::spawn(move || drop(exporter));
        let (mut s, _) = listener.accept().unwrap();
        let mut reader = BufReader::new(s.try_clone().unwrap());
        let mut length = 0;
        loop {
            let mut line = String::new();
            reader.read_line(&mut line).unwrap();
            if line == "\r\n" {
                break;
            }
            if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                length = v.trim().parse().unwrap();
            }
            if line.starts_with("POST") {
                assert!(line.contains("/v1/traces"), "{line}");
            }
        }
        let mut body = vec![0; length];
        reader.read_exact(&mut body).unwrap();
        s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            .unwrap();
        closing.join().unwrap();
        let request = ExportTraceServiceRequest::decode(&body[..]).unwrap();
        let resource = &request.resource_spans[0];
        let service = &resource.resource.as_ref().unwrap().attributes[0];
        assert_eq!(service.key, "service.name");
        assert_eq!(
            service.value.as_ref().unwrap().value,
            Some(
                opentelemetry_proto::tonic::common::v1::any_value::Value::StringValue(
                    "test".into()
                )
            )
        );
        let scope = &resource.scope_spans[0];
        assert_eq!(scope.scope.as_ref().unwrap().name, "dpumesh");
        let names: Vec<&str> = scope.spans.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["hop", "second 2"]);
        let span = &scope.spans[0];
        assert_eq!(span.parent_span_id, vec![3; 8]);
        assert_eq!(span.trace_id, vec![1; 16]);
        assert_eq!(scope.spans[1].span_id, vec![4; 8]);
    }
}

//! The exporter: spans queued by the hops (one `try_send` each), batched and posted
//! to the collector as OTLP/HTTP protobuf by a thread of their own.
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

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TrySendError};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::InstrumentationScope;
use opentelemetry_proto::tonic::resource::v1::Resource;
use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, ScopeSpans};
use prost::Message;

use crate::span::{SpanRecord, Value, attributes};

/// Spans queued for the exporter at most (past it, new ones are dropped and counted).
const QUEUE: usize = 8192;
/// Spans per post at most.
const BATCH: usize = 2048;
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

/// The process's exporter.
#[derive(Debug)]
pub struct Exporter {
    tx: Sender<SpanRecord>,
    ratio: f64,
    service: String,
}

impl Exporter {
    /// Starts the exporting thread.
    pub fn start(settings: Settings) -> std::io::Result<Self> {
        let (tx, rx) = crossbeam_channel::bounded(QUEUE);
        let ratio = settings.ratio;
        let service = settings.service.clone();
        std::thread::Builder::new()
            .name("dpumesh-otlp".to_owned())
            .spawn(move || post_batches(rx, settings))?;
        Ok(Self { tx, ratio, service })
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

    /// Queues a finished span (dropped and counted when the queue is full).
    pub fn record(&self, span: SpanRecord) {
        if let Err(TrySendError::Full(_)) = self.tx.try_send(span) {
            metrics::counter!("dpumesh_spans_dropped_total").increment(1);
        }
    }
}

/// The exporting thread: batches until every sender is gone.
fn post_batches(rx: Receiver<SpanRecord>, settings: Settings) {
    let resource = Resource {
        attributes: attributes(vec![(
            "service.name",
            Value::from(settings.service.as_str()),
        )]),
        ..Resource::default()
    };
    let mut batch = Vec::with_capacity(BATCH);
    let mut last_warning: Option<Instant> = None;
    let mut gone = false;
    let mut drained = true;
    loop {
        // The thread sleeps rather than waiting on the queue: a hop's `try_send` then
        // never wakes it (a wake-up per span doubled the mesh's context switches), and
        // a span waits at most one `LINGER` for its post. It sleeps only after it
        // found the queue empty: under load it posts batch after batch.
        if drained {
            if gone {
                return;
            }
            std::thread::sleep(LINGER);
        }
        drained = false;
        while batch.len() < BATCH {
            match rx.try_recv() {
                Ok(span) => batch.push(span.into_proto()),
                Err(crossbeam_channel::TryRecvError::Empty) => {
                    drained = true;
                    break;
                }
                Err(crossbeam_channel::TryRecvError::Disconnected) => {
                    gone = true;
                    drained = true;
                    break;
                }
            }
        }
        if batch.is_empty() {
            continue;
        }
        let request = ExportTraceServiceRequest {
            resource_spans: vec![ResourceSpans {
                resource: Some(resource.clone()),
                scope_spans: vec![ScopeSpans {
                    scope: Some(InstrumentationScope {
                        name: "dpumesh".to_owned(),
                        version: env!("CARGO_PKG_VERSION").to_owned(),
                        ..InstrumentationScope::default()
                    }),
                    spans: std::mem::take(&mut batch),
                    schema_url: String::new(),
                }],
                schema_url: String::new(),
            }],
        };
        let n = request.resource_spans[0].scope_spans[0].spans.len();
        match post(&settings, &request.encode_to_vec()) {
            Ok(()) => metrics::counter!("dpumesh_spans_exported_total").increment(n as u64),
            Err(e) => {
                metrics::counter!("dpumesh_spans_dropped_total").increment(n as u64);
                // Once a minute at most: a collector that is down must not flood the log.
                if last_warning.is_none_or(|at| at.elapsed() > Duration::from_secs(60)) {
                    tracing::warn!(collector = %settings.authority, error = %e, "spans not exported");
                    last_warning = Some(Instant::now());
                }
            }
        }
    }
}

/// POSTs one protobuf body; Ok when the collector answered 2xx.
fn post(settings: &Settings, body: &[u8]) -> std::io::Result<()> {
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
        body.len()
    );
    s.write_all(head.as_bytes())?;
    s.write_all(body)?;
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
        exporter.record(SpanRecord {
            trace_id: [1; 16],
            span_id: [2; 8],
            parent: Some([3; 8]),
            name: "hop".into(),
            kind: crate::SpanKind::Server,
            start: now,
            end: now,
            attributes: vec![("http.response.status_code", Value::Int(200))],
            events: Vec::new(),
            error: None,
        });
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
        let request = ExportTraceServiceRequest::decode(&body[..]).unwrap();
        let span = &request.resource_spans[0].scope_spans[0].spans[0];
        assert_eq!(span.name, "hop");
        assert_eq!(span.parent_span_id, vec![3; 8]);
        assert_eq!(span.trace_id, vec![1; 16]);
    }
}

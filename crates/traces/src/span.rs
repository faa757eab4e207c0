//! A finished span as a hop records it, and its OTLP form.

use std::time::{SystemTime, UNIX_EPOCH};

use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use opentelemetry_proto::tonic::trace::v1::{Span, Status, span, status};

use crate::context::{SpanId, TraceId};

/// An attribute's value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Str(String),
    Int(i64),
    Float(f64),
    Bool(bool),
}

impl From<&str> for Value {
    fn from(s: &str) -> Self {
        Self::Str(s.to_owned())
    }
}

impl From<String> for Value {
    fn from(s: String) -> Self {
        Self::Str(s)
    }
}

impl From<i64> for Value {
    fn from(n: i64) -> Self {
        Self::Int(n)
    }
}

impl From<f64> for Value {
    fn from(n: f64) -> Self {
        Self::Float(n)
    }
}

/// What the span stands for (OTLP's kinds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpanKind {
    Server,
    Client,
    Internal,
}

/// Something that happened within a span.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub name: String,
    pub time: SystemTime,
    pub attributes: Vec<(&'static str, Value)>,
}

/// A finished span.
#[derive(Debug, Clone, PartialEq)]
pub struct SpanRecord {
    pub trace_id: TraceId,
    pub span_id: SpanId,
    pub parent: Option<SpanId>,
    pub name: String,
    pub kind: SpanKind,
    pub start: SystemTime,
    pub end: SystemTime,
    pub attributes: Vec<(&'static str, Value)>,
    pub events: Vec<Event>,
    /// An error (a 5xx, a denial by a fault): the span's status says so.
    pub error: Option<String>,
}

fn nanos(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

fn key_value(key: &str, value: Value) -> KeyValue {
    let value = match value {
        Value::Str(s) => any_value::Value::StringValue(s),
        Value::Int(n) => any_value::Value::IntValue(n),
        Value::Float(n) => any_value::Value::DoubleValue(n),
        Value::Bool(b) => any_value::Value::BoolValue(b),
    };
    KeyValue {
        key: key.to_owned(),
        value: Some(AnyValue { value: Some(value) }),
    }
}

/// `attributes` in OTLP's form.
pub fn attributes(attributes: Vec<(&'static str, Value)>) -> Vec<KeyValue> {
    attributes
        .into_iter()
        .map(|(k, v)| key_value(k, v))
        .collect()
}

impl SpanRecord {
    /// A server span of an HTTP request `ctx` names (a child of `parent`), from
    /// `start` to now, with the request's method, path and answer's status (5xx is an
    /// error), and `more` attributes.
    #[allow(clippy::too_many_arguments)]
    pub fn http_server(
        ctx: &crate::TraceContext,
        parent: Option<&crate::TraceContext>,
        name: String,
        start: SystemTime,
        method: &str,
        path: &str,
        status: u16,
        more: Vec<(&'static str, Value)>,
    ) -> Self {
        let mut attributes = vec![
            ("http.request.method", Value::from(method)),
            ("url.path", Value::from(path)),
            ("http.response.status_code", Value::Int(i64::from(status))),
        ];
        attributes.extend(more);
        Self {
            trace_id: ctx.trace_id,
            span_id: ctx.span_id,
            parent: parent.map(|p| p.span_id),
            name,
            kind: SpanKind::Server,
            start,
            end: SystemTime::now(),
            attributes,
            events: Vec::new(),
            error: (status >= 500).then(|| status.to_string()),
        }
    }

    /// The OTLP span (on the exporter's thread: the strings move, none is copied).
    pub fn into_proto(self) -> Span {
        Span {
            trace_id: self.trace_id.to_vec(),
            span_id: self.span_id.to_vec(),
            parent_span_id: self.parent.map(|p| p.to_vec()).unwrap_or_default(),
            name: self.name,
            kind: match self.kind {
                SpanKind::Server => span::SpanKind::Server,
                SpanKind::Client => span::SpanKind::Client,
                SpanKind::Internal => span::SpanKind::Internal,
            } as i32,
            start_time_unix_nano: nanos(self.start),
            end_time_unix_nano: nanos(self.end),
            attributes: attributes(self.attributes),
            events: self
                .events
                .into_iter()
                .map(|e| span::Event {
                    time_unix_nano: nanos(e.time),
                    name: e.name,
                    attributes: attributes(e.attributes),
                    dropped_attributes_count: 0,
                })
                .collect(),
            status: Some(match self.error {
                Some(message) => Status {
                    message,
                    code: status::StatusCode::Error as i32,
                },
                None => Status {
                    message: String::new(),
                    code: status::StatusCode::Unset as i32,
                },
            }),
            ..Span::default()
        }
    }
}

//! A finished span, written by its hop straight into OTLP's protobuf form.
//!
//! A hop ends a span with [`SpanHead`] (ids, kind, times) and writes the rest through a
//! [`SpanWriter`]: name, attributes, events, error. The writer encodes each field as
//! it comes into a per-thread buffer (no message structs, no strings owned per field):
//! at 100 % sampling the earlier form, a struct of owned strings turned into
//! `opentelemetry-proto`'s messages on the exporter's thread, cost the mesh about a
//! fifth of its req/s, mostly in allocations freed on another thread. The encoding is
//! checked against `opentelemetry-proto`'s decoder in the tests below.

use std::fmt::{self, Write as _};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::context::{SpanId, TraceContext, TraceId};

/// An attribute's value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Value<'a> {
    Str(&'a str),
    Int(i64),
    Float(f64),
    Bool(bool),
}

impl<'a> From<&'a str> for Value<'a> {
    fn from(s: &'a str) -> Self {
        Self::Str(s)
    }
}

impl From<i64> for Value<'_> {
    fn from(n: i64) -> Self {
        Self::Int(n)
    }
}

impl From<f64> for Value<'_> {
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

impl SpanKind {
    /// OTLP's `SpanKind` number.
    fn number(self) -> u64 {
        match self {
            Self::Internal => 1,
            Self::Server => 2,
            Self::Client => 3,
        }
    }
}

/// What every span has: its ids, kind and times.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpanHead {
    pub trace_id: TraceId,
    pub span_id: SpanId,
    pub parent: Option<SpanId>,
    pub kind: SpanKind,
    pub start: SystemTime,
    pub end: SystemTime,
}

impl SpanHead {
    /// A server span of the request `ctx` names (a child of `parent`), from `start` to
    /// now.
    pub fn server(ctx: &TraceContext, parent: Option<&TraceContext>, start: SystemTime) -> Self {
        Self {
            trace_id: ctx.trace_id,
            span_id: ctx.span_id,
            parent: parent.map(|p| p.span_id),
            kind: SpanKind::Server,
            start,
            end: SystemTime::now(),
        }
    }
}

// Field numbers of OTLP's messages (opentelemetry/proto/trace/v1/trace.proto and
// common/v1/common.proto).
const SPAN_TRACE_ID: u32 = 1;
const SPAN_SPAN_ID: u32 = 2;
const SPAN_PARENT_SPAN_ID: u32 = 4;
const SPAN_NAME: u32 = 5;
const SPAN_KIND: u32 = 6;
const SPAN_START: u32 = 7;
const SPAN_END: u32 = 8;
const SPAN_ATTRIBUTES: u32 = 9;
const SPAN_EVENTS: u32 = 11;
const SPAN_STATUS: u32 = 15;
const EVENT_TIME: u32 = 1;
const EVENT_NAME: u32 = 2;
const EVENT_ATTRIBUTES: u32 = 3;
const STATUS_MESSAGE: u32 = 2;
const STATUS_CODE: u32 = 3;
const STATUS_CODE_ERROR: u64 = 2;
const KEY_VALUE_KEY: u32 = 1;
const KEY_VALUE_VALUE: u32 = 2;
const ANY_STRING: u32 = 1;
const ANY_BOOL: u32 = 2;
const ANY_INT: u32 = 3;
const ANY_DOUBLE: u32 = 4;

fn nanos(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// Protobuf's wire types.
const VARINT: u8 = 0;
const FIXED64: u8 = 1;
const LEN: u8 = 2;

/// A field's key (every tag here is below 16: one byte).
#[inline]
fn put_key(tag: u32, wire: u8, buf: &mut Vec<u8>) {
    buf.push(((tag << 3) as u8) | wire);
}

/// A varint (written here rather than with `prost::encoding`, whose generic writer
/// was a third of a span's cost).
#[inline]
fn put_raw_varint(mut n: u64, buf: &mut Vec<u8>) {
    while n >= 0x80 {
        buf.push((n as u8) | 0x80);
        n >>= 7;
    }
    buf.push(n as u8);
}

/// The length of `n` as a varint.
#[inline]
fn varint_len(n: u64) -> usize {
    // 1 byte per 7 bits, at least one.
    (64 - (n | 1).leading_zeros() as usize).div_ceil(7)
}

/// The length of a length-delimited field of `len` bytes, key included.
pub(crate) fn field_len(len: usize) -> usize {
    1 + varint_len(len as u64) + len
}

/// A length-delimited field's key and length (its bytes follow).
#[inline]
pub(crate) fn put_len(tag: u32, len: usize, buf: &mut Vec<u8>) {
    put_key(tag, LEN, buf);
    put_raw_varint(len as u64, buf);
}

fn put_bytes(tag: u32, bytes: &[u8], buf: &mut Vec<u8>) {
    put_len(tag, bytes.len(), buf);
    buf.extend_from_slice(bytes);
}

fn put_fixed64(tag: u32, n: u64, buf: &mut Vec<u8>) {
    put_key(tag, FIXED64, buf);
    buf.extend_from_slice(&n.to_le_bytes());
}

fn put_varint(tag: u32, n: u64, buf: &mut Vec<u8>) {
    put_key(tag, VARINT, buf);
    put_raw_varint(n, buf);
}

/// The encoded length of an `AnyValue` holding `value`.
fn any_value_len(value: &Value<'_>) -> usize {
    match value {
        Value::Str(s) => field_len(s.len()),
        Value::Int(n) => 1 + varint_len(*n as u64),
        Value::Float(_) => 1 + 8,
        Value::Bool(_) => 1 + 1,
    }
}

/// The encoded length of a `KeyValue`.
fn key_value_len(key: &str, value: &Value<'_>) -> usize {
    field_len(key.len()) + field_len(any_value_len(value))
}

/// Writes a `KeyValue` as field `tag` of the message being written.
fn put_key_value(tag: u32, key: &str, value: &Value<'_>, buf: &mut Vec<u8>) {
    put_len(tag, key_value_len(key, value), buf);
    put_bytes(KEY_VALUE_KEY, key.as_bytes(), buf);
    put_len(KEY_VALUE_VALUE, any_value_len(value), buf);
    match value {
        Value::Str(s) => put_bytes(ANY_STRING, s.as_bytes(), buf),
        // int64 as a varint: two's complement in 64 bits, as protobuf has it.
        Value::Int(n) => put_varint(ANY_INT, *n as u64, buf),
        Value::Float(x) => put_fixed64(ANY_DOUBLE, x.to_bits(), buf),
        Value::Bool(b) => put_varint(ANY_BOOL, u64::from(*b), buf),
    }
}

/// One span alone in OTLP's `Span` encoding (what [`crate::Exporter::record`] appends to
/// its batch): for tests and fuzzing, which decode it.
pub fn encoded(head: &SpanHead, body: impl FnOnce(&mut SpanWriter<'_>)) -> Vec<u8> {
    let (mut buf, mut text) = (Vec::new(), String::new());
    let mut writer = SpanWriter::start(head, &mut buf, &mut text);
    body(&mut writer);
    writer.finish();
    buf
}

/// Writes one span's fields after its head; see [`crate::Exporter::record`].
pub struct SpanWriter<'w> {
    buf: &'w mut Vec<u8>,
    /// Where formatted text is made before it is written (its length comes first).
    text: &'w mut String,
    status_written: bool,
    /// The span's start, in nanoseconds since the epoch (events are offsets from it).
    start: u64,
}

impl<'w> SpanWriter<'w> {
    /// Starts a span in `buf` (cleared) with `head`'s fields.
    pub(crate) fn start(head: &SpanHead, buf: &'w mut Vec<u8>, text: &'w mut String) -> Self {
        buf.clear();
        put_bytes(SPAN_TRACE_ID, &head.trace_id, buf);
        put_bytes(SPAN_SPAN_ID, &head.span_id, buf);
        if let Some(parent) = &head.parent {
            put_bytes(SPAN_PARENT_SPAN_ID, parent, buf);
        }
        put_varint(SPAN_KIND, head.kind.number(), buf);
        let start = nanos(head.start);
        put_fixed64(SPAN_START, start, buf);
        put_fixed64(SPAN_END, nanos(head.end), buf);
        Self {
            buf,
            text,
            status_written: false,
            start,
        }
    }

    /// Ends the span: a status of `Unset` unless an error was written.
    pub(crate) fn finish(self) {
        if !self.status_written {
            put_bytes(SPAN_STATUS, &[], self.buf);
        }
    }

    fn format(&mut self, args: fmt::Arguments<'_>) {
        self.text.clear();
        match args.as_str() {
            // A literal needs no formatting machinery.
            Some(s) => self.text.push_str(s),
            // Writing into a String does not fail.
            None => {
                let _ = self.text.write_fmt(args);
            }
        }
    }

    /// The span's name.
    pub fn name(&mut self, name: fmt::Arguments<'_>) -> &mut Self {
        self.format(name);
        put_bytes(SPAN_NAME, self.text.as_bytes(), self.buf);
        self
    }

    /// One attribute.
    pub fn attr(&mut self, key: &str, value: Value<'_>) -> &mut Self {
        put_key_value(SPAN_ATTRIBUTES, key, &value, self.buf);
        self
    }

    /// One attribute whose text is formatted (into the writer's scratch, not a new
    /// string).
    pub fn attr_fmt(&mut self, key: &str, value: fmt::Arguments<'_>) -> &mut Self {
        self.format(value);
        put_key_value(SPAN_ATTRIBUTES, key, &Value::Str(self.text), self.buf);
        self
    }

    /// Something that happened `at` after the span's start.
    pub fn event(
        &mut self,
        name: fmt::Arguments<'_>,
        at: Duration,
        attributes: &[(&str, Value<'_>)],
    ) -> &mut Self {
        self.format(name);
        let len = 1
            + 8
            + field_len(self.text.len())
            + attributes
                .iter()
                .map(|(k, v)| field_len(key_value_len(k, v)))
                .sum::<usize>();
        put_len(SPAN_EVENTS, len, self.buf);
        put_fixed64(EVENT_TIME, self.start + at.as_nanos() as u64, self.buf);
        put_bytes(EVENT_NAME, self.text.as_bytes(), self.buf);
        for (k, v) in attributes {
            put_key_value(EVENT_ATTRIBUTES, k, v, self.buf);
        }
        self
    }

    /// The span failed (a 5xx, a denial by a fault): its status says so with `message`.
    pub fn error(&mut self, message: fmt::Arguments<'_>) -> &mut Self {
        if self.status_written {
            return self;
        }
        self.format(message);
        let len = field_len(self.text.len()) + 1 + varint_len(STATUS_CODE_ERROR);
        put_len(SPAN_STATUS, len, self.buf);
        put_bytes(STATUS_MESSAGE, self.text.as_bytes(), self.buf);
        put_varint(STATUS_CODE, STATUS_CODE_ERROR, self.buf);
        self.status_written = true;
        self
    }

    /// An HTTP server span's attributes: the request's method and path and the answer's
    /// status (a 5xx is an error).
    pub fn http_server(&mut self, method: &str, path: &str, status: u16) -> &mut Self {
        self.attr("http.request.method", Value::Str(method))
            .attr("url.path", Value::Str(path))
            .attr("http.response.status_code", Value::Int(i64::from(status)));
        if status >= 500 {
            self.error(format_args!("{status}"));
        }
        self
    }
}

#[cfg(test)]
mod tests {
    use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
    use opentelemetry_proto::tonic::trace::v1::{Span, Status, span, status};
    use prost::Message;

    use super::*;

    fn written(head: &SpanHead, body: impl FnOnce(&mut SpanWriter<'_>)) -> Span {
        Span::decode(&encoded(head, body)[..]).expect("the span decodes")
    }

    fn kv(key: &str, value: any_value::Value) -> KeyValue {
        KeyValue {
            key: key.into(),
            value: Some(AnyValue { value: Some(value) }),
        }
    }

    #[test]
    fn a_written_span_is_what_opentelemetry_proto_decodes() {
        let start = UNIX_EPOCH + Duration::from_nanos(1_700_000_000_123_456_789);
        let head = SpanHead {
            trace_id: [7; 16],
            span_id: [8; 8],
            parent: Some([9; 8]),
            kind: SpanKind::Server,
            start,
            end: start + Duration::from_micros(250),
        };
        let long = "x".repeat(300);
        let span = written(&head, |w| {
            w.name(format_args!("dpumesh.proxy {} {}", "hotels", "*/hotels"))
                .http_server("GET", "/hotels", 503)
                .attr("dpumesh.attempts", Value::Int(-3))
                .attr("long", Value::Str(&long))
                .attr("ok", Value::Bool(true))
                .attr_fmt(
                    "client.address",
                    format_args!("{}", std::net::Ipv4Addr::LOCALHOST),
                )
                .event(
                    format_args!("filter {}", "jwt"),
                    Duration::from_micros(3),
                    &[("dpumesh.filter.duration_us", Value::Float(2.5))],
                )
                .event(format_args!("bare"), Duration::ZERO, &[])
                .error(format_args!("not written twice"));
        });
        let expected = Span {
            trace_id: vec![7; 16],
            span_id: vec![8; 8],
            parent_span_id: vec![9; 8],
            name: "dpumesh.proxy hotels */hotels".into(),
            kind: span::SpanKind::Server as i32,
            start_time_unix_nano: 1_700_000_000_123_456_789,
            end_time_unix_nano: 1_700_000_000_123_706_789,
            attributes: vec![
                kv(
                    "http.request.method",
                    any_value::Value::StringValue("GET".into()),
                ),
                kv("url.path", any_value::Value::StringValue("/hotels".into())),
                kv("http.response.status_code", any_value::Value::IntValue(503)),
                kv("dpumesh.attempts", any_value::Value::IntValue(-3)),
                kv("long", any_value::Value::StringValue(long.clone())),
                kv("ok", any_value::Value::BoolValue(true)),
                kv(
                    "client.address",
                    any_value::Value::StringValue("127.0.0.1".into()),
                ),
            ],
            events: vec![
                span::Event {
                    time_unix_nano: 1_700_000_000_123_459_789,
                    name: "filter jwt".into(),
                    attributes: vec![kv(
                        "dpumesh.filter.duration_us",
                        any_value::Value::DoubleValue(2.5),
                    )],
                    dropped_attributes_count: 0,
                },
                span::Event {
                    time_unix_nano: 1_700_000_000_123_456_789,
                    name: "bare".into(),
                    attributes: Vec::new(),
                    dropped_attributes_count: 0,
                },
            ],
            status: Some(Status {
                message: "503".into(),
                code: status::StatusCode::Error as i32,
            }),
            ..Span::default()
        };
        assert_eq!(span, expected);
    }

    #[test]
    fn varints_are_protobufs() {
        for n in [
            0,
            1,
            127,
            128,
            300,
            16_383,
            16_384,
            u64::from(u32::MAX),
            u64::MAX,
        ] {
            let mut ours = Vec::new();
            put_raw_varint(n, &mut ours);
            let mut theirs = Vec::new();
            prost::encoding::encode_varint(n, &mut theirs);
            assert_eq!(ours, theirs, "{n}");
            assert_eq!(varint_len(n), theirs.len(), "{n}");
        }
    }

    #[test]
    fn a_span_without_error_or_parent_has_an_unset_status_and_no_parent() {
        let now = SystemTime::now();
        let ctx = crate::context::start(None, 1.0);
        let span = written(&SpanHead::server(&ctx, None, now), |w| {
            w.name(format_args!("GET /")).http_server("GET", "/", 200);
        });
        assert_eq!(span.trace_id, ctx.trace_id.to_vec());
        assert!(span.parent_span_id.is_empty());
        assert_eq!(span.kind, span::SpanKind::Server as i32);
        assert_eq!(
            span.status,
            Some(Status {
                message: String::new(),
                code: status::StatusCode::Unset as i32
            })
        );
        let internal = written(
            &SpanHead {
                kind: SpanKind::Internal,
                ..SpanHead::server(&ctx, Some(&ctx), now)
            },
            |_| {},
        );
        assert_eq!(internal.kind, span::SpanKind::Internal as i32);
        assert_eq!(internal.parent_span_id, ctx.span_id.to_vec());
        let client = written(
            &SpanHead {
                kind: SpanKind::Client,
                ..SpanHead::server(&ctx, None, now)
            },
            |_| {},
        );
        assert_eq!(client.kind, span::SpanKind::Client as i32);
    }
}

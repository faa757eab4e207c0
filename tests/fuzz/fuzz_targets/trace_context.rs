//! A client's `traceparent` (any bytes) and the span a hop writes from what a request
//! carried: parsing never panics; a context that parses prints back to a value that
//! parses to the same context; a span written with arbitrary text (names, values,
//! errors of any length) decodes with `opentelemetry-proto`'s decoder to that text.
#![no_main]

use dpumesh_traces::context::TraceContext;
use dpumesh_traces::span::encoded;
use dpumesh_traces::{SpanHead, SpanKind, Value};
use libfuzzer_sys::fuzz_target;
use opentelemetry_proto::tonic::common::v1::any_value;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use std::time::{Duration, UNIX_EPOCH};

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    if let Some(ctx) = TraceContext::parse(&text) {
        let printed = ctx.traceparent();
        assert_eq!(TraceContext::parse(&printed), Some(ctx), "{printed}");
    }
    // Three pieces of text from the input: a name, an attribute's value, an error.
    let mut parts = text.splitn(3, '\u{1}');
    let (name, value, error) = (
        parts.next().unwrap_or(""),
        parts.next().unwrap_or(""),
        parts.next(),
    );
    let n = data.iter().fold(0i64, |n, &b| n.wrapping_mul(31).wrapping_add(i64::from(b)));
    let head = SpanHead {
        trace_id: [1; 16],
        span_id: [2; 8],
        parent: (n & 1 == 1).then_some([3; 8]),
        kind: SpanKind::Client,
        start: UNIX_EPOCH + Duration::from_nanos(n.unsigned_abs() >> 2),
        end: UNIX_EPOCH,
    };
    let bytes = encoded(&head, |w| {
        if let Some(e) = error {
            w.error(format_args!("{e}"));
        }
        w.name(format_args!("{name}"))
            .attr("v", Value::Str(value))
            .attr("n", Value::Int(n))
            .event(format_args!("{value}"), Duration::from_nanos(7), &[("n", Value::Int(n))]);
    });
    let span = Span::decode(&bytes[..]).expect("a written span decodes");
    assert_eq!(span.name, name);
    assert_eq!(
        span.attributes[0].value.as_ref().and_then(|v| v.value.clone()),
        Some(any_value::Value::StringValue(value.to_owned()))
    );
    assert_eq!(
        span.attributes[1].value.as_ref().and_then(|v| v.value.clone()),
        Some(any_value::Value::IntValue(n))
    );
    assert_eq!(span.events[0].name, value);
    assert_eq!(span.status.map(|s| s.message), Some(error.unwrap_or("").to_owned()));
});

//! What a shard tells the node's observers of each exchange it ends: the golden
//! metrics (always, for exchanges whose chain ran here), and a record for an open
//! tap or the access log when they want this request.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::exchange::Exchange;
use super::*;
use crate::observe::record::{FilterTime, Record, Verdict};
use crate::observe::{Probe, redact};

impl<F: Fabric> Reactor<F> {
    /// Observes `exchange` ending with `status` after `latency`.
    pub(super) fn observe(
        &mut self,
        exchange: &Exchange,
        status: u16,
        failure: FailureKind,
        upstream: Option<&str>,
        latency: Duration,
    ) {
        // Another node ran its chain and observes it (counted there once).
        let Some(route) = exchange.seen.route.as_ref() else {
            return;
        };
        let identity = exchange
            .head
            .as_ref()
            .and_then(|h| h.source.identity.as_deref());
        let source = match identity {
            // A service of the mesh goes by its name, as the graph draws it.
            Some(id) => id
                .strip_prefix(&self.topology.workload_prefix)
                .unwrap_or(id),
            None => match exchange.origin {
                Origin::Link { .. } => "ingress",
                Origin::Pod { .. } => "unknown",
            },
        };
        self.meter.response_metrics.record_edge(
            source,
            &exchange.service,
            route,
            status,
            latency.as_secs_f64(),
        );
        let observer = &self.topology.observer;
        if let Some(traces) = &observer.traces {
            span(traces, exchange, source, route, status, failure, latency);
        }
        if !observer.watching() {
            return;
        }
        let Some(head) = exchange.head.as_ref() else {
            return;
        };
        let probe = Probe {
            service: &exchange.service,
            route,
            source,
            method: &head.method,
            path: &head.path,
            status,
        };
        let wanted = observer.wanted(&probe);
        if !wanted.any() {
            return;
        }
        let verdict = match (&exchange.seen.denied_by, failure) {
            (Some(_), _) => Verdict::Denied,
            (None, FailureKind::None) => Verdict::Allowed,
            _ => Verdict::Failed,
        };
        let now = SystemTime::now();
        let start_ms = now
            .checked_sub(latency)
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_millis() as u64);
        let target = match &head.query {
            Some(q) => redact::path(&format!("{}?{q}", head.path)),
            None => head.path.clone(),
        };
        let header = |name: &str| head.header(name);
        let record = Record {
            start_ms,
            node: observer.node.clone(),
            method: head.method.clone(),
            authority: head.authority.clone(),
            path: target,
            status,
            grpc_status: exchange.seen.grpc_status,
            source: source.to_owned(),
            service: exchange.service.clone(),
            route: route.clone(),
            duration_us: latency.as_secs_f64() * 1e6,
            verdict,
            denied_by: exchange.seen.denied_by.clone(),
            failure: failure_name(failure),
            attempts: exchange.attempt,
            upstream: upstream.map(str::to_owned),
            filters: exchange
                .seen
                .filters
                .iter()
                .map(|t| FilterTime {
                    filter: t.filter.clone(),
                    us: t.ns as f64 / 1e3,
                })
                .collect(),
            request_id: header("x-request-id"),
            trace_id: header("traceparent").and_then(|t| Record::trace_id_of(&t)),
            user_agent: header("user-agent"),
            headers: head
                .headers()
                .iter()
                .map(|(n, v)| {
                    let value = String::from_utf8_lossy(v.as_bytes());
                    (
                        n.as_str().to_owned(),
                        redact::header_value(n.as_str(), &value).to_owned(),
                    )
                })
                .collect(),
        };
        observer.emit(record, wanted);
    }
}

/// Exports this hop's span when its trace is sampled: a child of the caller's span,
/// named by the id the chain's `trace` filter gave this hop (the one the service sees
/// as its parent), with each filter's time as an event.
fn span(
    traces: &dpumesh_traces::Exporter,
    exchange: &Exchange,
    source: &str,
    route: &str,
    status: u16,
    failure: FailureKind,
    latency: Duration,
) {
    use dpumesh_traces::{SpanHead, SpanKind, TraceContext, Value};
    let Some(head) = exchange.head.as_ref() else {
        return;
    };
    let parent = exchange.seen.trace_parent;
    let out = head
        .headers()
        .get(&TRACEPARENT)
        .and_then(|v| v.to_str().ok())
        .and_then(TraceContext::parse);
    let ctx = match (out, parent) {
        // The chain gave this hop a span id (the `trace` filter).
        (Some(out), Some(p)) if out.span_id != p.span_id => out,
        // A trace the chain started (no caller's context): sampled at the ratio.
        (Some(out), None) => TraceContext {
            sampled: dpumesh_traces::context::ratio_samples(&out.trace_id, traces.ratio()),
            ..out
        },
        // No filter made this hop a span: a span id of its own, not propagated.
        (Some(_), Some(p)) => p.child(),
        (None, Some(p)) => p.child(),
        (None, None) => dpumesh_traces::context::start(None, traces.ratio()),
    };
    if !ctx.sampled {
        return;
    }
    let end = SystemTime::now();
    let start = end.checked_sub(latency).unwrap_or(end);
    let head_of_span = SpanHead {
        trace_id: ctx.trace_id,
        span_id: ctx.span_id,
        parent: parent.map(|p| p.span_id),
        kind: SpanKind::Server,
        start,
        end,
    };
    traces.record(&head_of_span, |w| {
        if status >= 500 {
            // Before `http_server`'s bare status: a span's first error is the one kept.
            w.error(format_args!("{status} ({})", failure_name(failure)));
        }
        w.name(format_args!("dpumesh.proxy {} {}", exchange.service, route))
            .http_server(&head.method, &head.path, status)
            .attr("http.route", Value::Str(route))
            .attr("dpumesh.source", Value::Str(source))
            .attr("dpumesh.service", Value::Str(&exchange.service))
            .attr("dpumesh.failure", Value::Str(failure_name(failure)))
            .attr("dpumesh.attempts", Value::Int(i64::from(exchange.attempt)));
        if let Some(filter) = &exchange.seen.denied_by {
            w.attr("dpumesh.denied_by", Value::Str(filter));
        }
        if let Some(code) = exchange.seen.grpc_status {
            w.attr("rpc.grpc.status_code", Value::Int(i64::from(code)));
        }
        let mut at = Duration::ZERO;
        for t in &exchange.seen.filters {
            at += Duration::from_nanos(t.ns);
            w.event(
                format_args!("filter {}", t.filter),
                at,
                &[(
                    "dpumesh.filter.duration_us",
                    Value::Float(t.ns as f64 / 1e3),
                )],
            );
        }
    });
}

/// Envoy's response flags, in words.
fn failure_name(failure: FailureKind) -> &'static str {
    match failure {
        FailureKind::None => "none",
        FailureKind::ConnectFailure => "connect_failure",
        FailureKind::UpstreamReset => "upstream_reset",
        FailureKind::Timeout => "timeout",
        FailureKind::LocalReply => "local_reply",
        FailureKind::Internal => "internal",
    }
}

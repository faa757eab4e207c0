//! A service's spans (OpenTelemetry, exported over OTLP when the environment names a
//! collector; see `dpumesh_traces`): one for each request it serves, a child of the
//! mesh hop that brought it, with a client span per egress call and an internal span
//! per internal step beneath it. Each egress call carries its own span's context in
//! `traceparent`, so the calls' mesh hops are children of this service's spans and a
//! request's whole tree is one trace. With no collector, nothing here runs.

use std::time::SystemTime;

use dpumesh_traces::context::{self, TraceContext};
use dpumesh_traces::{Exporter, SpanHead, SpanKind, Value};
use http::{HeaderName, HeaderValue};

// Named once: a name given as text is parsed and hashed anew at every lookup.
static TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");

use crate::http::{HttpRequest, HttpResponse};

/// An egress call on the wire.
struct Call {
    node: usize,
    part: usize,
    ctx: TraceContext,
    start: SystemTime,
    method: String,
    url: String,
}

/// One served request's spans while it runs.
pub(crate) struct RequestTrace {
    server: TraceContext,
    parent: Option<TraceContext>,
    start: SystemTime,
    method: String,
    path: String,
    calls: Vec<Call>,
    steps: Vec<(usize, SystemTime)>,
}

impl RequestTrace {
    /// The span of serving `request` (a child of its `traceparent`, or a new trace
    /// sampled at the exporter's ratio).
    pub(crate) fn begin(exporter: &Exporter, request: &HttpRequest) -> Self {
        let parent = request
            .headers
            .get(&TRACEPARENT)
            .and_then(|v| v.to_str().ok())
            .and_then(TraceContext::parse);
        let server = context::start(parent.as_ref(), exporter.ratio());
        // What only the span needs is copied only for a sampled trace.
        let (method, path) = if server.sampled {
            (
                request.method.as_str().to_owned(),
                request.url.split('?').next().unwrap_or("").to_owned(),
            )
        } else {
            (String::new(), String::new())
        };
        Self {
            server,
            parent,
            start: SystemTime::now(),
            method,
            path,
            calls: Vec::new(),
            steps: Vec::new(),
        }
    }

    /// An egress call leaves: it carries its own span's context.
    pub(crate) fn on_send(&mut self, node: usize, part: usize, request: &mut HttpRequest) {
        let ctx = self.server.child();
        if let Ok(value) = HeaderValue::from_bytes(&ctx.traceparent_bytes()) {
            request.headers.insert(TRACEPARENT.clone(), value);
        }
        if !self.server.sampled {
            return;
        }
        self.calls.push(Call {
            node,
            part,
            ctx,
            start: SystemTime::now(),
            method: request.method.as_str().to_owned(),
            url: request.url.clone(),
        });
    }

    /// An egress call's answer (or failure): its client span.
    pub(crate) fn on_answer(
        &mut self,
        exporter: &Exporter,
        node: usize,
        part: usize,
        step: Option<&str>,
        outcome: &Result<HttpResponse, String>,
    ) {
        let Some(i) = self
            .calls
            .iter()
            .position(|c| c.node == node && c.part == part)
        else {
            return;
        };
        let call = self.calls.swap_remove(i);
        let head = SpanHead {
            trace_id: call.ctx.trace_id,
            span_id: call.ctx.span_id,
            parent: Some(self.server.span_id),
            kind: SpanKind::Client,
            start: call.start,
            end: SystemTime::now(),
        };
        exporter.record(&head, |w| {
            match outcome {
                Ok(r) if r.status >= 500 => {
                    w.error(format_args!("{}", r.status));
                }
                Ok(_) => {}
                Err(e) => {
                    w.error(format_args!("{e}"));
                }
            }
            w.name(format_args!("egress {}", step.unwrap_or("call")))
                .attr("http.request.method", Value::Str(&call.method))
                .attr("url.full", Value::Str(&call.url));
            if let Ok(r) = outcome {
                w.attr("http.response.status_code", Value::Int(i64::from(r.status)));
            }
        });
    }

    /// An internal step starts.
    pub(crate) fn on_step(&mut self, node: usize) {
        if self.server.sampled {
            self.steps.push((node, SystemTime::now()));
        }
    }

    /// An internal step ended: its span.
    pub(crate) fn on_step_done(&mut self, exporter: &Exporter, node: usize, step: Option<&str>) {
        let Some(i) = self.steps.iter().position(|(n, _)| *n == node) else {
            return;
        };
        let (_, start) = self.steps.swap_remove(i);
        let head = SpanHead {
            trace_id: self.server.trace_id,
            span_id: context::new_span_id(),
            parent: Some(self.server.span_id),
            kind: SpanKind::Internal,
            start,
            end: SystemTime::now(),
        };
        exporter.record(&head, |w| {
            w.name(format_args!("internal {}", step.unwrap_or("step")));
        });
    }

    /// The request was answered with `status`: the server span.
    pub(crate) fn end(self, exporter: &Exporter, status: u16) {
        if !self.server.sampled {
            return;
        }
        exporter.record(
            &SpanHead::server(&self.server, self.parent.as_ref(), self.start),
            |w| {
                w.name(format_args!("{} {}", self.method, self.path))
                    .http_server(&self.method, &self.path, status);
            },
        );
    }
}

/// The exporter a service's loop uses: OpenTelemetry's environment, named for the
/// service (`DPUMESH_SERVICE`, which `dpumesh up` and the chart set).
pub(crate) fn exporter() -> Option<Exporter> {
    let service = std::env::var("DPUMESH_SERVICE").unwrap_or_else(|_| "dpumesh-service".to_owned());
    Exporter::from_env(&service)
}

//! A service's spans (OpenTelemetry, exported over OTLP when the environment names a
//! collector; see `dpumesh_traces`): one for each request it serves, a child of the
//! mesh hop that brought it, with a client span per egress call and an internal span
//! per internal step beneath it. Each egress call carries its own span's context in
//! `traceparent`, so the calls' mesh hops are children of this service's spans and a
//! request's whole tree is one trace. With no collector, nothing here runs.

use std::time::SystemTime;

use dpumesh_traces::context::{self, TraceContext};
use dpumesh_traces::{Exporter, SpanKind, SpanRecord, Value};
use http::HeaderValue;

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
            .get("traceparent")
            .and_then(|v| v.to_str().ok())
            .and_then(TraceContext::parse);
        Self {
            server: context::start(parent.as_ref(), exporter.ratio()),
            parent,
            start: SystemTime::now(),
            method: request.method.as_str().to_owned(),
            path: request.url.split('?').next().unwrap_or("").to_owned(),
            calls: Vec::new(),
            steps: Vec::new(),
        }
    }

    /// An egress call leaves: it carries its own span's context.
    pub(crate) fn on_send(&mut self, node: usize, part: usize, request: &mut HttpRequest) {
        let ctx = self.server.child();
        if let Ok(value) = HeaderValue::from_str(&ctx.traceparent()) {
            request.headers.insert("traceparent", value);
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
        let mut attributes = vec![
            ("http.request.method", Value::from(call.method.as_str())),
            ("url.full", Value::from(call.url.as_str())),
        ];
        let error = match outcome {
            Ok(r) => {
                attributes.push(("http.response.status_code", Value::Int(i64::from(r.status))));
                (r.status >= 500).then(|| r.status.to_string())
            }
            Err(e) => Some(e.clone()),
        };
        exporter.record(SpanRecord {
            trace_id: call.ctx.trace_id,
            span_id: call.ctx.span_id,
            parent: Some(self.server.span_id),
            name: format!("egress {}", step.unwrap_or("call")),
            kind: SpanKind::Client,
            start: call.start,
            end: SystemTime::now(),
            attributes,
            events: Vec::new(),
            error,
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
        exporter.record(SpanRecord {
            trace_id: self.server.trace_id,
            span_id: context::new_span_id(),
            parent: Some(self.server.span_id),
            name: format!("internal {}", step.unwrap_or("step")),
            kind: SpanKind::Internal,
            start,
            end: SystemTime::now(),
            attributes: Vec::new(),
            events: Vec::new(),
            error: None,
        });
    }

    /// The request was answered with `status`: the server span.
    pub(crate) fn end(self, exporter: &Exporter, status: u16) {
        if !self.server.sampled {
            return;
        }
        exporter.record(SpanRecord::http_server(
            &self.server,
            self.parent.as_ref(),
            format!("{} {}", self.method, self.path),
            self.start,
            &self.method,
            &self.path,
            status,
            Vec::new(),
        ));
    }
}

/// The exporter a service's loop uses: OpenTelemetry's environment, named for the
/// service (`DPUMESH_SERVICE`, which `dpumesh up` and the chart set).
pub(crate) fn exporter() -> Option<Exporter> {
    let service = std::env::var("DPUMESH_SERVICE").unwrap_or_else(|_| "dpumesh-service".to_owned());
    Exporter::from_env(&service)
}

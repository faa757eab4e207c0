//! The ingress's span: the mesh's first hop. It continues the client's trace (a valid
//! `traceparent`, its sampling decision kept) or starts one sampled at the configured
//! ratio, and hands the next hop its context in `traceparent` (flags say whether the
//! trace is sampled, so every hop decides alike).

use std::net::SocketAddr;
use std::time::SystemTime;

use dpumesh_traces::context::{self, TraceContext};
use dpumesh_traces::{Exporter, SpanHead};
use http::{HeaderName, HeaderValue, Method, Request, Uri};

// Named once: a name given as text is parsed and hashed anew at every lookup, and the
// ingress looks these up on every request while tracing is on.
static TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
static TRACESTATE: HeaderName = HeaderName::from_static("tracestate");

/// A request's span while it runs.
pub(crate) struct Traced {
    ctx: TraceContext,
    parent: Option<TraceContext>,
    start: SystemTime,
    method: Method,
    // The request's URI (a shared-bytes clone, not a copy): its path names the span.
    uri: Uri,
    peer: SocketAddr,
}

impl Traced {
    /// Starts the span of `req` and gives the request its context.
    pub(crate) fn begin<B>(traces: &Exporter, req: &mut Request<B>, peer: SocketAddr) -> Self {
        let parent = req
            .headers()
            .get(&TRACEPARENT)
            .and_then(|v| v.to_str().ok())
            .and_then(TraceContext::parse);
        let ctx = context::start(parent.as_ref(), traces.ratio());
        if let Ok(value) = HeaderValue::from_bytes(&ctx.traceparent_bytes()) {
            req.headers_mut().insert(TRACEPARENT.clone(), value);
        }
        if parent.is_none() {
            // `tracestate` belongs to a valid parent only (W3C Trace Context).
            req.headers_mut().remove(&TRACESTATE);
        }
        Self {
            ctx,
            parent,
            start: SystemTime::now(),
            method: req.method().clone(),
            uri: req.uri().clone(),
            peer,
        }
    }

    /// Ends the span with the answer's status (its head: a streamed body goes on).
    pub(crate) fn end(self, traces: &Exporter, status: u16) {
        if !self.ctx.sampled {
            return;
        }
        traces.record(
            &SpanHead::server(&self.ctx, self.parent.as_ref(), self.start),
            |w| {
                w.name(format_args!("dpumesh.ingress {}", self.method))
                    .http_server(self.method.as_str(), self.uri.path(), status)
                    .attr_fmt("client.address", format_args!("{}", self.peer.ip()));
            },
        );
    }
}

//! `trace`: request ids and trace context.
//!
//! - `x-request-id`: kept when present and sane (visible ASCII, at most
//!   `max_request_id_len` bytes); otherwise a random UUIDv4 is set. Envoy does the same
//!   with `generate_request_id`, but keeps any incoming value; we replace garbage.
//! - `traceparent` (W3C Trace Context): a valid one keeps its trace id and flags and
//!   gets a new parent (span) id — this proxy hop is a span. A missing or malformed one
//!   is replaced by a new trace (a malformed one also drops `tracestate`, which the spec
//!   says must not be forwarded without a valid parent). When there is no valid
//!   `traceparent` but a valid `x-trace-id` (32 hex digits), the new trace reuses it.
//! - `x-trace-id` is set to the trace id, so services that only read that header (the
//!   host library's convention) see the same trace.
//! - Metadata `trace.request_id`, `trace.trace_id`, `trace.span_id` for later filters and
//!   access logs.

#![forbid(unsafe_code)]

pub mod ids;
pub mod traceparent;

use dpumesh_filter_sdk::metrics::Counter;
use dpumesh_filter_sdk::{Filter, Interest, Request, Verdict, export_filter};
use serde::Deserialize;

use crate::ids::IdSource;
use crate::traceparent::{TraceParent, hex, parse_trace_id, push_hex};

/// Configuration; every field has a default.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Header carrying the request id.
    pub request_id_header: String,
    /// Whether to set a request id when the request has none (or a bad one).
    pub generate_request_id: bool,
    /// Longest request id kept, in bytes.
    pub max_request_id_len: usize,
    /// Whether to propagate W3C `traceparent`.
    pub traceparent: bool,
    /// Header mirroring the trace id; empty disables it.
    pub trace_id_header: String,
    /// Whether new traces are marked sampled.
    pub sample_new_traces: bool,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            request_id_header: "x-request-id".to_owned(),
            generate_request_id: true,
            max_request_id_len: 128,
            traceparent: true,
            trace_id_header: "x-trace-id".to_owned(),
            sample_new_traces: true,
        }
    }
}

/// The filter.
#[derive(Debug)]
pub struct Trace {
    config: Config,
    generated: Counter,
    replaced: Counter,
    new_traces: Counter,
    ids: IdSource,
}

/// A random UUID version 4, e.g. `7b0e4c6a-1d3c-4c43-9d7e-6c1f5d1b2a90`.
pub fn uuid_v4(ids: &mut IdSource) -> String {
    let mut b: [u8; 16] = ids.bytes();
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let mut id = String::with_capacity(36);
    for (i, group) in [&b[..4], &b[4..6], &b[6..8], &b[8..10], &b[10..]]
        .into_iter()
        .enumerate()
    {
        if i > 0 {
            id.push('-');
        }
        push_hex(&mut id, group);
    }
    id
}

fn sane_request_id(id: &str, max: usize) -> bool {
    !id.is_empty() && id.len() <= max && id.bytes().all(|b| (0x21..=0x7e).contains(&b))
}

impl Filter for Trace {
    type Config = Config;

    fn new(config: Config) -> Result<Self, String> {
        if config.request_id_header.is_empty() {
            return Err("request_id_header must not be empty".to_owned());
        }
        if config.max_request_id_len == 0 {
            return Err("max_request_id_len must be at least 1".to_owned());
        }
        let counter = |name: &str| Counter::new(name, &[]).map_err(|e| e.to_string());
        Ok(Self {
            generated: counter("trace_request_ids_generated_total")?,
            replaced: counter("trace_headers_replaced_total")?,
            new_traces: counter("trace_new_traces_total")?,
            config,
            ids: IdSource::from_entropy(),
        })
    }

    /// The request-id header, the trace-id header and `traceparent`.
    fn interest(&self) -> Interest {
        let c = &self.config;
        let mut interest = Interest::default().header(&c.request_id_header);
        if !c.trace_id_header.is_empty() {
            interest = interest.header(&c.trace_id_header);
        }
        if c.traceparent {
            interest = interest.header("traceparent");
        }
        interest
    }

    fn on_request(&mut self, req: &Request<'_>) -> Verdict {
        let c = &self.config;
        let both = [c.request_id_header.as_str(), c.trace_id_header.as_str()];
        let names = if c.trace_id_header.is_empty() {
            &both[..1]
        } else {
            &both[..]
        };
        let values = req.headers(names);
        let request_id = values[0].clone();
        let trace_id_header = values.get(1).cloned().flatten();

        let request_id = match request_id {
            Some(id) if sane_request_id(&id, c.max_request_id_len) => Some(id),
            existing if c.generate_request_id => {
                if existing.is_some() {
                    self.replaced.increment(1);
                }
                self.generated.increment(1);
                let id = uuid_v4(&mut self.ids);
                // Edits of a configured, valid header name cannot be refused.
                let _ = req.set_header(&c.request_id_header, &id);
                Some(id)
            }
            existing => existing,
        };
        if let Some(id) = &request_id {
            req.set_metadata("trace.request_id", id);
        }

        if c.traceparent {
            // More than one traceparent is invalid (W3C Trace Context §3.2.2.1).
            let all = req.header_all("traceparent");
            let traceparent = all.first().cloned();
            let parsed = match all.as_slice() {
                [one] => TraceParent::parse(one),
                _ => None,
            };
            let next = match parsed {
                Some(parent) => TraceParent {
                    parent_id: self.ids.bytes(),
                    ..parent
                },
                None => {
                    if traceparent.is_some() {
                        self.replaced.increment(1);
                        let _ = req.remove_header("tracestate");
                    }
                    self.new_traces.increment(1);
                    TraceParent {
                        trace_id: trace_id_header
                            .as_deref()
                            .and_then(parse_trace_id)
                            .unwrap_or_else(|| self.ids.bytes()),
                        parent_id: self.ids.bytes(),
                        flags: u8::from(c.sample_new_traces),
                    }
                }
            };
            let _ = req.set_header("traceparent", &next.to_header());
            let trace_id = hex(&next.trace_id);
            if !c.trace_id_header.is_empty() && trace_id_header.as_deref() != Some(&trace_id) {
                let _ = req.set_header(&c.trace_id_header, &trace_id);
            }
            req.set_metadata("trace.trace_id", &trace_id);
            req.set_metadata("trace.span_id", &hex(&next.parent_id));
        }
        Verdict::Continue
    }
}

export_filter!(Trace);

#[cfg(test)]
mod tests {
    use dpumesh_filter_sdk::mock::{MockProxy, MockRequest};

    use super::*;

    #[test]
    fn uuids_are_version_4() {
        let mut ids = IdSource::from_entropy();
        let id = uuid_v4(&mut ids);
        assert_eq!(id.len(), 36);
        assert_eq!(&id[14..15], "4");
        assert!(matches!(&id[19..20], "8" | "9" | "a" | "b"));
        assert_ne!(uuid_v4(&mut ids), id);
    }

    #[test]
    fn a_valid_traceparent_keeps_its_trace_and_gets_a_new_span() {
        let host = MockProxy::new().install();
        let mut f: Trace = host.configure("").unwrap();
        let incoming = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";
        let req = MockRequest::get("/").with_header("traceparent", incoming);
        assert!(host.on_request(&mut f, &req).is_continue());
        let out = req.header("traceparent").unwrap();
        assert!(
            out.starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-"),
            "{out}"
        );
        assert!(out.ends_with("-00"), "sampling decision is kept: {out}");
        assert_ne!(out, incoming);
        assert_eq!(
            req.header("x-trace-id").as_deref(),
            Some("4bf92f3577b34da6a3ce929d0e0e4736")
        );
        assert_eq!(req.header("x-request-id").map(|v| v.len()), Some(36));
        assert_eq!(host.metric("trace_new_traces_total", &[]), 0.0);
    }

    #[test]
    fn garbage_is_replaced_and_tracestate_dropped() {
        let host = MockProxy::new().install();
        let mut f: Trace = host.configure("").unwrap();
        let req = MockRequest::get("/")
            .with_header("traceparent", "garbage")
            .with_header("tracestate", "vendor=1")
            .with_header("x-request-id", "has space");
        host.on_request(&mut f, &req);
        assert!(TraceParent::parse(&req.header("traceparent").unwrap()).is_some());
        assert_eq!(req.header("tracestate"), None);
        assert_ne!(req.header("x-request-id").as_deref(), Some("has space"));
        assert_eq!(host.metric("trace_headers_replaced_total", &[]), 2.0);
    }
}

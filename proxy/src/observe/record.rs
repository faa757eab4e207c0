//! One request as the tap and the access log see it.

use std::sync::Arc;

use serde::Serialize;

/// What a tap's match and the sampling look at, borrowed from the exchange before
/// any record is built.
#[derive(Debug, Clone, Copy)]
pub struct Probe<'a> {
    pub service: &'a str,
    pub route: &'a str,
    pub source: &'a str,
    pub method: &'a str,
    pub path: &'a str,
    pub status: u16,
}

/// The chain's verdict on a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// The chain let it through and it was answered by the service (or the cache).
    Allowed,
    /// A filter answered it.
    Denied,
    /// Let through, but the mesh could not get an answer (timeout, lost link,
    /// unreachable service, client gone).
    Failed,
}

/// One filter's time for this request.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FilterTime {
    pub filter: Arc<str>,
    pub us: f64,
}

/// One request, its secrets redacted ([`super::redact`]).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Record {
    /// When the request arrived at this node (Unix time, milliseconds).
    pub start_ms: u64,
    /// The node whose proxy ran its chain.
    pub node: Arc<str>,
    pub method: String,
    pub authority: String,
    /// The path and query, secret query values redacted.
    pub path: String,
    pub status: u16,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grpc_status: Option<u32>,
    /// The caller: a service of the mesh, a client certificate's principal, or
    /// `ingress`.
    pub source: String,
    /// The destination service.
    pub service: String,
    pub route: Arc<str>,
    /// From arrival to the response (its head, for a streamed answer), µs.
    pub duration_us: f64,
    pub verdict: Verdict,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub denied_by: Option<Arc<str>>,
    /// Why the mesh answered instead of the service (`none`: the service answered).
    pub failure: &'static str,
    /// Tries made (1 without retries).
    pub attempts: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub upstream: Option<String>,
    /// Each filter's time, in chain order (filters after a pause only, for a request
    /// a filter paused).
    pub filters: Vec<FilterTime>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trace_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub user_agent: Option<String>,
    /// The request's headers (after the chain), secret values redacted.
    pub headers: Vec<(String, String)>,
}

impl Record {
    /// The trace ID of a W3C `traceparent` value (`00-TRACEID-SPANID-FLAGS`).
    pub fn trace_id_of(traceparent: &str) -> Option<String> {
        let mut parts = traceparent.split('-');
        let (_, trace) = (parts.next()?, parts.next()?);
        (trace.len() == 32 && trace.bytes().all(|b| b.is_ascii_hexdigit()))
            .then(|| trace.to_owned())
    }
}

/// `1xx` ... `5xx` (anything else: `other`).
pub fn status_class(status: u16) -> &'static str {
    match status / 100 {
        1 => "1xx",
        2 => "2xx",
        3 => "3xx",
        4 => "4xx",
        5 => "5xx",
        _ => "other",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trace_ids_come_from_valid_traceparents_only() {
        assert_eq!(
            Record::trace_id_of("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
                .as_deref(),
            Some("4bf92f3577b34da6a3ce929d0e0e4736")
        );
        assert_eq!(Record::trace_id_of("00-zz-00f067aa0ba902b7-01"), None);
        assert_eq!(Record::trace_id_of(""), None);
        assert_eq!(status_class(503), "5xx");
        assert_eq!(status_class(499), "4xx");
        assert_eq!(status_class(700), "other");
    }
}

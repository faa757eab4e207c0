//! What a chain decides: go on, or a local reply (a filter's, checked to be valid
//! HTTP, or the fail-closed answer to a fault), with the head as the filters left it.

use std::sync::Arc;

use dpumesh_head::RequestHead;
use http::{HeaderName, HeaderValue};

use crate::bindings;
use crate::error::{FaultKind, FilterFault};

/// A reply the proxy sends instead of forwarding a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalReply {
    /// HTTP status.
    pub status: u16,
    /// Headers, in order.
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl LocalReply {
    /// The first value of header `name` (ASCII case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Why a request was denied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DenyCause {
    /// The filter's policy said no.
    Policy,
    /// The filter faulted and its policy is fail-closed (or its reply was invalid).
    Fault(FilterFault),
}

/// What the chain decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Forward the request.
    Continue,
    /// A filter paused the request for HTTP calls: the runner keeps it (head and
    /// place in the chain) under `park`; the owner performs `callouts` and hands each
    /// answer to [`ChainRunner::resume`], which goes on with the chain or pauses again.
    /// The outcome's head is empty meanwhile.
    Pause {
        /// The parked request, within its runner.
        park: u32,
        /// The calls to make now (empty: it waits for calls made before).
        callouts: Vec<crate::callout::Callout>,
    },
    /// Answer with `reply`.
    Deny {
        /// The filter that denied.
        filter: Arc<str>,
        /// The reply to send.
        reply: LocalReply,
        /// Policy or fault.
        cause: DenyCause,
    },
}

impl Decision {
    /// The reply of a denial.
    pub fn reply(&self) -> Option<&LocalReply> {
        match self {
            Self::Continue | Self::Pause { .. } => None,
            Self::Deny { reply, .. } => Some(reply),
        }
    }
}

/// The result of running a chain's request phase.
#[derive(Debug)]
pub struct ChainOutcome {
    /// The head with every filter's edits.
    pub head: RequestHead,
    /// Continue or deny.
    pub decision: Decision,
    /// How many filters' `on-request` ran (the response phase runs these, reversed).
    pub ran: usize,
    /// Faults met on the way, including those a fail-open policy skipped.
    pub faults: Vec<FilterFault>,
    /// Each filter's time for this request, in order, while [`crate::timing::wanted`]
    /// (empty otherwise; after a pause, the filters from the one that paused).
    pub times: Vec<crate::timing::FilterTime>,
}

pub(super) fn fault_reply(fault: &FilterFault) -> LocalReply {
    // A degraded filter is temporarily unavailable rather than broken by this request.
    let status = match fault.kind {
        FaultKind::Degraded { .. } => 503,
        _ => 500,
    };
    LocalReply {
        status,
        headers: vec![
            ("content-type".to_owned(), "text/plain".to_owned()),
            ("x-dpumesh-filter-fault".to_owned(), fault.filter.clone()),
        ],
        body: format!(
            "dpumesh: filter \"{}\" {} in {}; the request was denied (fail-closed)\n",
            fault.filter, fault.kind, fault.phase
        ),
    }
}

/// Checks a filter's reply can be sent as HTTP.
pub(super) fn checked_reply(reply: bindings::LocalReply) -> Result<LocalReply, String> {
    if !(100..=599).contains(&reply.status) {
        return Err(format!("status {} is outside 100-599", reply.status));
    }
    for (name, value) in &reply.headers {
        HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| format!("header name {name:?} is not valid HTTP"))?;
        HeaderValue::from_str(value)
            .map_err(|_| format!("value of header {name:?} is not valid HTTP"))?;
    }
    Ok(LocalReply {
        status: reply.status,
        headers: reply.headers,
        body: reply.body,
    })
}

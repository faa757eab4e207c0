//! HTTP calls a filter makes while its request waits (proxy-wasm's `proxy_http_call`):
//! what the filter asked for, what came back, and which upstream names a call may
//! use. The runtime never performs a call: the thread that owns the chain hands each
//! [`Callout`] to whoever can reach the upstream and brings the [`CalloutReply`] back
//! to the same chain runner (see [`crate::ChainRunner::resume`]).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwapOption;

/// Most headers and body bytes of a call's request or response the runtime carries.
pub const MAX_CALLOUT_BYTES: usize = 1 << 20;

/// An HTTP call a filter made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Callout {
    /// The filter's token for the call (unique within the instance that made it).
    pub token: u32,
    /// The upstream it names: a mesh service or a configured upstream.
    pub upstream: String,
    /// The request's headers, pseudo-headers (`:method`, `:path`, `:authority`)
    /// included, in the filter's order.
    pub headers: Vec<(String, Vec<u8>)>,
    /// The request body.
    pub body: Vec<u8>,
    /// How long the filter waits for the answer.
    pub timeout: Duration,
}

impl Callout {
    /// The first value of header `name` (pseudo-headers included) as text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .and_then(|(_, v)| std::str::from_utf8(v).ok())
    }
}

/// What a call came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CalloutReply {
    /// The upstream answered.
    Response {
        /// Its status.
        status: u16,
        /// Its headers (without `:status`, which the filter sees first).
        headers: Vec<(String, Vec<u8>)>,
        /// Its body.
        body: Vec<u8>,
    },
    /// No answer: refused, unreachable, reset or timed out. A filter sees a response
    /// without headers or body, as Envoy shows a failed call.
    Failed {
        /// Why, for the log.
        reason: String,
    },
}

impl CalloutReply {
    /// The response's headers as the filter reads them: `:status` first.
    pub fn header_pairs(&self) -> Vec<(String, Vec<u8>)> {
        match self {
            Self::Response {
                status, headers, ..
            } => {
                let mut all = Vec::with_capacity(headers.len() + 1);
                all.push((":status".to_owned(), status.to_string().into_bytes()));
                all.extend(headers.iter().cloned());
                all
            }
            Self::Failed { .. } => Vec::new(),
        }
    }

    /// The response body (empty for a failed call).
    pub fn body(&self) -> &[u8] {
        match self {
            Self::Response { body, .. } => body,
            Self::Failed { .. } => &[],
        }
    }
}

/// The upstream names calls may use, set by the proxy from its policy (mesh services
/// and configured upstreams); a call to any other name is refused when it is made
/// (`BadArgument`, as Envoy refuses an unknown cluster). Until the proxy sets them
/// (a runtime used alone, in tests and `dpumesh filter test`), every name is taken.
#[derive(Debug, Default)]
pub struct CalloutTargets {
    names: ArcSwapOption<BTreeSet<String>>,
}

impl CalloutTargets {
    /// Sets the names calls may use.
    pub fn set(&self, names: BTreeSet<String>) {
        self.names.store(Some(Arc::new(names)));
    }

    /// Whether a call may name `upstream`.
    pub fn allows(&self, upstream: &str) -> bool {
        match &*self.names.load() {
            Some(names) => names.contains(upstream),
            None => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_is_taken_until_the_proxy_names_them() {
        let targets = CalloutTargets::default();
        assert!(targets.allows("anything"));
        targets.set(["auth".to_owned()].into());
        assert!(targets.allows("auth"));
        assert!(!targets.allows("httpbin"));
    }

    #[test]
    fn a_failed_call_has_no_headers_or_body() {
        let failed = CalloutReply::Failed {
            reason: "timeout".into(),
        };
        assert!(failed.header_pairs().is_empty());
        assert!(failed.body().is_empty());
        let ok = CalloutReply::Response {
            status: 200,
            headers: vec![("x".into(), b"1".to_vec())],
            body: b"hi".to_vec(),
        };
        assert_eq!(ok.header_pairs()[0], (":status".into(), b"200".to_vec()));
        assert_eq!(ok.body(), b"hi");
    }
}

//! Trailer fields: header fields sent after a body (gRPC's `grpc-status` and
//! `grpc-message`, a digest of a streamed body). They travel beside a head on the wire
//! ([`crate::wire`]) and are never merged into it: filters see heads, not trailers,
//! so a field that would decide anything (framing, routing, authentication, caching)
//! has no business in them. RFC 9110 §6.5.1 forbids senders to put such fields there;
//! a hop that receives them drops them rather than forward a client's or a pod's word
//! in a place nothing checks.

use http::HeaderMap;

use crate::{RESERVED_PREFIX, is_hop_by_hop};

/// Fields a trailer section must not carry (beyond the hop-by-hop ones and the mesh's
/// own `x-dpumesh-*`): they frame the message, route it, authenticate it, or control
/// how the response is cached or presented, and every hop reads them from the head.
const REFUSED: [&str; 21] = [
    "age",
    "authorization",
    "cache-control",
    "content-encoding",
    "content-range",
    "content-type",
    "cookie",
    "date",
    "expect",
    "expires",
    "host",
    "location",
    "max-forwards",
    "pragma",
    "proxy-authenticate",
    "proxy-authorization",
    "range",
    "retry-after",
    "set-cookie",
    "trailer",
    "www-authenticate",
];

/// Whether a trailer field named `name` (lowercase, as `http` keeps names) may pass.
pub fn allowed(name: &str) -> bool {
    !is_hop_by_hop(name)
        && !name.starts_with(RESERVED_PREFIX)
        && !name.starts_with(':')
        && !REFUSED.contains(&name)
}

/// Drops the fields [`allowed`] refuses; how many it dropped.
pub fn keep_allowed(trailers: &mut HeaderMap) -> usize {
    let refused: Vec<_> = trailers
        .keys()
        .filter(|n| !allowed(n.as_str()))
        .cloned()
        .collect();
    let mut dropped = 0;
    for name in refused {
        if let http::header::Entry::Occupied(e) = trailers.entry(name) {
            dropped += e.remove_entry_mult().1.count();
        }
    }
    dropped
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    #[test]
    fn grpc_trailers_pass_and_deciding_fields_do_not() {
        for name in [
            "grpc-status",
            "grpc-message",
            "grpc-status-details-bin",
            "x-grpc-test-echo-trailing-bin",
            "digest",
        ] {
            assert!(allowed(name), "{name}");
        }
        for name in [
            "content-length",
            "transfer-encoding",
            "te",
            "authorization",
            "host",
            "set-cookie",
            "x-dpumesh-generation",
            "trailer",
        ] {
            assert!(!allowed(name), "{name}");
        }
    }

    #[test]
    fn refused_fields_are_dropped_every_value_counted() {
        let mut t = HeaderMap::new();
        t.append("grpc-status", HeaderValue::from_static("0"));
        t.append("set-cookie", HeaderValue::from_static("a=1"));
        t.append("set-cookie", HeaderValue::from_static("b=2"));
        t.append("x-dpumesh-circuit", HeaderValue::from_static("open"));
        assert_eq!(keep_allowed(&mut t), 3);
        assert_eq!(t.len(), 1);
        assert_eq!(t["grpc-status"], "0");
    }
}

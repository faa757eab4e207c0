//! The HTTP cache's policy over arbitrary request and response headers (what clients
//! and services send): `Cache-Control`, `Vary`, dates, ETags and conditional headers
//! never panic, and a stored response is found again by the request that stored it.
#![no_main]

use std::time::{Duration, SystemTime};

use dpumesh_http_cache::{Entry, Index, Lookup, Rule, policy};
use http::{HeaderMap, HeaderName, HeaderValue};
use libfuzzer_sys::fuzz_target;

const NAMES: [&str; 10] = [
    "cache-control",
    "vary",
    "etag",
    "last-modified",
    "date",
    "expires",
    "age",
    "if-none-match",
    "if-modified-since",
    "accept-language",
];

fn headers(pairs: &[(u8, Vec<u8>)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (n, v) in pairs {
        let name = HeaderName::from_static(NAMES[*n as usize % NAMES.len()]);
        if let Ok(v) = HeaderValue::from_bytes(v) {
            h.append(name, v);
        }
    }
    h
}

fuzz_target!(
    |input: (Vec<(u8, Vec<u8>)>, Vec<(u8, Vec<u8>)>, u16, u32)| {
        let (req, resp, status, secs) = input;
        let (request, response) = (headers(&req), headers(&resp));
        let rule = Rule {
            max_object: 1 << 20,
            default_ttl: Some(Duration::from_secs(5)),
        };
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(u64::from(secs));
        let _ = policy::not_modified(&request, &response);
        let _ = policy::initial_age(&response, now, now);
        if let Ok(lifetime) = policy::storable(&rule, "GET", &request, status, &response, 10) {
            let entry = Entry::new(
                status,
                &response,
                &request,
                "k".into(),
                10,
                lifetime,
                now,
                now,
            );
            let mut index = Index::new();
            index.insert("h/p", entry);
            // The request that stored it finds it (fresh or stale, never a miss).
            assert_ne!(index.lookup("h/p", &request, now), Lookup::Miss);
        }
    }
);

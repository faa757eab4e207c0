//! The ingress's HTTP/1 boundary tracker (finds requests with both Content-Length and
//! Transfer-Encoding): never a panic, and what it finds does not depend on how the
//! bytes were split into reads.
#![no_main]

use std::sync::Arc;

use dpumesh_ingress::framing::{Ambiguous, Tracker};
use libfuzzer_sys::fuzz_target;

fn found(stream: &[u8], cuts: &[u8]) -> Vec<u64> {
    let found = Arc::new(parking_lot::Mutex::new(Ambiguous::default()));
    let mut tracker = Tracker::new(4096, found.clone());
    let mut rest = stream;
    for &cut in cuts {
        let n = (cut as usize).min(rest.len());
        tracker.feed(&rest[..n]);
        rest = &rest[n..];
    }
    tracker.feed(rest);
    let indexes = found.lock().indexes();
    indexes
}

fuzz_target!(|data: &[u8]| {
    let Some((&n, rest)) = data.split_first() else {
        return;
    };
    let (cuts, stream) = rest.split_at((n as usize % 16).min(rest.len()));
    assert_eq!(found(stream, &[]), found(stream, cuts), "split at {cuts:?}");
});

//! What a rate limit's new subject costs when the node's shared state is full of live
//! buckets (issue 49's "a million rate-limit subjects"), in one run:
//! - `evicts one`: the store as it is, sweeping at most every 250 ms: each new
//!   subject evicts an idle bucket (a new key each take);
//! - `swept first (before)`: a sweep, then the take: what every take for a new key
//!   did before the sweeps were spaced.
//!
//! `cargo bench -p dpumesh-shared-state --bench full`

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use dpumesh_clock::{ManualClock, SharedClock};
use dpumesh_shared_state::{BucketSpec, SharedState, StateLimits};

fn full(c: &mut Criterion) {
    let spec = BucketSpec {
        capacity: 1_000_000_000,
        refill_tokens: 1_000_000_000,
        refill_interval_ms: 60_000,
    };
    let mut group = c.benchmark_group("new subject, full store");
    for entries in [10_000, 100_000] {
        let clock: SharedClock = ManualClock::at_unix_secs(1_700_000_000);
        let state = SharedState::new(
            clock,
            StateLimits {
                max_entries: entries,
            },
        );
        let ns = state.namespace("ratelimit");
        for i in 0..entries {
            ns.token_bucket_take(&format!("s{i}"), spec, 1).unwrap();
        }
        let mut n = 0u64;
        let mut key = String::new();
        group.bench_function(format!("{entries} entries, evicts one"), |b| {
            b.iter(|| {
                use std::fmt::Write as _;
                n += 1;
                key.clear();
                let _ = write!(key, "new{n}");
                ns.token_bucket_take(black_box(&key), spec, 1).unwrap()
            })
        });
        group.bench_function(format!("{entries} entries, swept first (before)"), |b| {
            b.iter(|| {
                state.sweep_expired();
                ns.token_bucket_take(black_box("new"), spec, 1)
            })
        });
    }
    group.finish();
}

criterion_group!(benches, full);
criterion_main!(benches);

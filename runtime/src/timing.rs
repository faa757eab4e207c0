//! Per-request filter times, taken only while someone looks at them (a tap or an
//! access log that names them): otherwise the chain records its histograms alone and
//! a request pays one relaxed load for this.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// How long one filter took for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FilterTime {
    pub filter: Arc<str>,
    pub ns: u64,
}

/// How many observers want per-request times (process-wide: chains run on shards and
/// pool workers alike).
static WANTED: AtomicUsize = AtomicUsize::new(0);

/// Whether chains should keep per-request filter times now.
#[inline]
pub fn wanted() -> bool {
    WANTED.load(Ordering::Relaxed) != 0
}

/// Per-request times are kept while the returned guard lives.
pub fn want() -> TimingGuard {
    WANTED.fetch_add(1, Ordering::Relaxed);
    TimingGuard(())
}

/// Keeps per-request filter times on until dropped.
#[derive(Debug)]
pub struct TimingGuard(());

impl Drop for TimingGuard {
    fn drop(&mut self) {
        WANTED.fetch_sub(1, Ordering::Relaxed);
    }
}

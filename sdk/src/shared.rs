//! Integer state shared by every worker of the node, namespaced to this filter.
//!
//! Each call is one atomic decision on the host, so there is no read-modify-write race
//! between workers and no compare-and-swap loop in the guest.

use std::fmt;

/// Why a shared-state call failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StateError {
    /// The key is empty or longer than 256 bytes.
    InvalidKey,
    /// The key holds a value of the other kind (integer vs token bucket).
    WrongType,
    /// The node's store is full: decide whether to fail open or closed.
    Full,
}

impl fmt::Display for StateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::InvalidKey => "invalid shared-state key",
            Self::WrongType => "shared-state key holds a value of another kind",
            Self::Full => "shared-state store is full",
        })
    }
}

impl std::error::Error for StateError {}

/// A token bucket's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenBucket {
    /// Most tokens held; the bucket starts full.
    pub capacity: u64,
    /// Tokens added per whole interval.
    pub refill_tokens: u64,
    /// Interval length in milliseconds.
    pub refill_interval_ms: u64,
}

/// The outcome of [`token_bucket_take`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketResult {
    /// Whether the tokens were taken.
    pub allowed: bool,
    /// Tokens left.
    pub remaining: u64,
    /// Milliseconds until the next refill.
    pub reset_after_ms: u64,
}

/// Adds `delta` to the integer at `key` and returns the new value; a new key starts at
/// 0 and expires `ttl_ms` after creation (0 = never).
pub fn increment(key: &str, delta: i64, ttl_ms: u64) -> Result<i64, StateError> {
    crate::sys::state_increment(key, delta, ttl_ms)
}

/// The integer at `key`, if present.
pub fn get(key: &str) -> Result<Option<i64>, StateError> {
    crate::sys::state_get(key)
}

/// Sets `key` to `desired` if it holds `expected` (`None` = absent); otherwise returns
/// `Ok(Err(current))`.
pub fn compare_and_swap(
    key: &str,
    expected: Option<i64>,
    desired: i64,
    ttl_ms: u64,
) -> Result<Result<(), Option<i64>>, StateError> {
    crate::sys::state_compare_and_swap(key, expected, desired, ttl_ms)
}

/// Removes `key`; returns whether it was there.
pub fn delete(key: &str) -> Result<bool, StateError> {
    crate::sys::state_delete(key)
}

/// Takes `cost` tokens from the bucket at `key`, node-wide and atomically.
pub fn token_bucket_take(
    key: &str,
    bucket: TokenBucket,
    cost: u64,
) -> Result<BucketResult, StateError> {
    crate::sys::token_bucket_take(key, bucket, cost)
}

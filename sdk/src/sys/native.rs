//! The native backend: every call goes to the current thread's [`MockProxy`], which
//! runs the proxy's own shared-state and key-verification code on a manual clock.

use dpumesh_clock::Clock as _;

use crate::crypto::{Algorithm, VerifyError};
use crate::log::Level;
use crate::metrics::{Kind, MetricError};
use crate::mock::MockProxy;
use crate::shared::{BucketResult, StateError, TokenBucket};

pub(crate) fn log_enabled(level: Level) -> bool {
    MockProxy::current().log_enabled(level)
}

pub(crate) fn log(level: Level, message: &str) {
    MockProxy::current().push_log(level, message)
}

pub(crate) fn wall_ns() -> u64 {
    MockProxy::current().clock().wall_ns()
}

pub(crate) fn monotonic_ns() -> u64 {
    MockProxy::current().clock().monotonic_ns()
}

pub(crate) fn define_metric(
    kind: Kind,
    name: &str,
    labels: &[(&str, &str)],
) -> Result<u32, MetricError> {
    MockProxy::current().define_metric(kind, name, labels)
}

pub(crate) fn counter_add(id: u32, delta: u64) {
    MockProxy::current().update_metric(id, Kind::Counter, |v| v + delta as f64)
}

pub(crate) fn gauge_set(id: u32, value: f64) {
    MockProxy::current().update_metric(id, Kind::Gauge, |_| value)
}

pub(crate) fn gauge_add(id: u32, delta: f64) {
    MockProxy::current().update_metric(id, Kind::Gauge, |v| v + delta)
}

pub(crate) fn observe(id: u32, value: f64) {
    MockProxy::current().update_metric(id, Kind::Histogram, |v| v + value)
}

fn state_error(e: dpumesh_shared_state::StateError) -> StateError {
    use dpumesh_shared_state::StateError as S;
    match e {
        S::InvalidKey => StateError::InvalidKey,
        S::WrongType => StateError::WrongType,
        S::Full => StateError::Full,
    }
}

pub(crate) fn state_increment(key: &str, delta: i64, ttl_ms: u64) -> Result<i64, StateError> {
    MockProxy::current()
        .namespace()
        .increment(key, delta, ttl_ms)
        .map_err(state_error)
}

pub(crate) fn state_get(key: &str) -> Result<Option<i64>, StateError> {
    MockProxy::current()
        .namespace()
        .get(key)
        .map_err(state_error)
}

pub(crate) fn state_compare_and_swap(
    key: &str,
    expected: Option<i64>,
    desired: i64,
    ttl_ms: u64,
) -> Result<Result<(), Option<i64>>, StateError> {
    MockProxy::current()
        .namespace()
        .compare_and_swap(key, expected, desired, ttl_ms)
        .map_err(state_error)
}

pub(crate) fn state_delete(key: &str) -> Result<bool, StateError> {
    MockProxy::current()
        .namespace()
        .delete(key)
        .map_err(state_error)
}

pub(crate) fn token_bucket_take(
    key: &str,
    bucket: TokenBucket,
    cost: u64,
) -> Result<BucketResult, StateError> {
    let spec = dpumesh_shared_state::BucketSpec {
        capacity: bucket.capacity,
        refill_tokens: bucket.refill_tokens,
        refill_interval_ms: bucket.refill_interval_ms,
    };
    MockProxy::current()
        .namespace()
        .token_bucket_take(key, spec, cost)
        .map(|r| BucketResult {
            allowed: r.allowed,
            remaining: r.remaining,
            reset_after_ms: r.reset_after_ms,
        })
        .map_err(state_error)
}

pub(crate) fn verify(
    alg: Algorithm,
    key_set: &str,
    key_id: Option<&str>,
    message: &[u8],
    signature: &[u8],
) -> Result<String, VerifyError> {
    MockProxy::current()
        .keys()
        .verify(alg, key_set, key_id, message, signature)
}

pub(crate) fn key_set_version(key_set: &str) -> u64 {
    MockProxy::current().keys().version(key_set)
}

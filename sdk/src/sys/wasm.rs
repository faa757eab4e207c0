//! The Wasm backend: each function is one call of a `dpumesh:filter` import.

use crate::bindings::dpumesh::filter::{clock, crypto as wit_crypto, log as wit_log};
use crate::bindings::dpumesh::filter::{metrics as wit_metrics, shared_state as wit_state};
use crate::crypto::{Algorithm, VerifyError};
use crate::log::Level;
use crate::metrics::{Kind, MetricError};
use crate::shared::{BucketResult, StateError, TokenBucket};

fn level(level: Level) -> wit_log::Level {
    match level {
        Level::Trace => wit_log::Level::Trace,
        Level::Debug => wit_log::Level::Debug,
        Level::Info => wit_log::Level::Info,
        Level::Warn => wit_log::Level::Warn,
        Level::Error => wit_log::Level::Error,
    }
}

pub(crate) fn log_enabled(l: Level) -> bool {
    wit_log::enabled(level(l))
}

pub(crate) fn log(l: Level, message: &str) {
    wit_log::log(level(l), message)
}

pub(crate) fn wall_ns() -> u64 {
    clock::wall_ns()
}

pub(crate) fn monotonic_ns() -> u64 {
    clock::monotonic_ns()
}

pub(crate) fn define_metric(
    kind: Kind,
    name: &str,
    labels: &[(&str, &str)],
) -> Result<u32, MetricError> {
    let result = match kind {
        Kind::Counter => wit_metrics::counter(name, labels),
        Kind::Gauge => wit_metrics::gauge(name, labels),
        Kind::Histogram => wit_metrics::histogram(name, labels),
    };
    result.map_err(|e| match e {
        wit_metrics::MetricError::InvalidName => MetricError::InvalidName,
        wit_metrics::MetricError::InvalidLabel => MetricError::InvalidLabel,
        wit_metrics::MetricError::TooMany => MetricError::TooMany,
    })
}

pub(crate) fn counter_add(id: u32, delta: u64) {
    pending::add(id, delta)
}

pub(crate) fn gauge_set(id: u32, value: f64) {
    wit_metrics::gauge_set(id, value)
}

pub(crate) fn gauge_add(id: u32, delta: f64) {
    wit_metrics::gauge_add(id, delta)
}

pub(crate) fn observe(id: u32, value: f64) {
    wit_metrics::observe(id, value)
}

/// Sends the counter increments gathered during the current export call.
pub(crate) fn flush_counters() {
    pending::flush()
}

/// The counter increments gathered during this call, handed over (the batched call
/// returns them with its outcome instead of calling the proxy).
pub(crate) fn take_counters() -> Vec<(u32, u64)> {
    pending::take()
}

/// Counter increments gathered during one export call: a host call per increment costs
/// more than the rest of a typical filter, so they are sent in one batch when the call
/// returns (the export glue calls [`flush_counters`]).
mod pending {
    use std::cell::RefCell;

    use super::wit_metrics;

    thread_local! {
        static PENDING: RefCell<Vec<(u32, u64)>> = const { RefCell::new(Vec::new()) };
    }

    pub(super) fn add(id: u32, delta: u64) {
        PENDING.with_borrow_mut(|pending| match pending.iter_mut().find(|(i, _)| *i == id) {
            Some((_, sum)) => *sum = sum.saturating_add(delta),
            None => pending.push((id, delta)),
        });
    }

    pub(super) fn take() -> Vec<(u32, u64)> {
        PENDING.with_borrow_mut(std::mem::take)
    }

    pub(super) fn flush() {
        PENDING.with_borrow_mut(|pending| {
            match pending.as_slice() {
                [] => return,
                [(id, delta)] => wit_metrics::increment(*id, *delta),
                deltas => wit_metrics::increment_batch(deltas),
            }
            pending.clear();
        });
    }
}

fn state_error(e: wit_state::StateError) -> StateError {
    match e {
        wit_state::StateError::InvalidKey => StateError::InvalidKey,
        wit_state::StateError::WrongType => StateError::WrongType,
        wit_state::StateError::Full => StateError::Full,
    }
}

pub(crate) fn state_increment(key: &str, delta: i64, ttl_ms: u64) -> Result<i64, StateError> {
    wit_state::increment(key, delta, ttl_ms).map_err(state_error)
}

pub(crate) fn state_get(key: &str) -> Result<Option<i64>, StateError> {
    wit_state::get(key).map_err(state_error)
}

pub(crate) fn state_compare_and_swap(
    key: &str,
    expected: Option<i64>,
    desired: i64,
    ttl_ms: u64,
) -> Result<Result<(), Option<i64>>, StateError> {
    wit_state::compare_and_swap(key, expected, desired, ttl_ms).map_err(state_error)
}

pub(crate) fn state_delete(key: &str) -> Result<bool, StateError> {
    wit_state::delete(key).map_err(state_error)
}

pub(crate) fn token_bucket_take(
    key: &str,
    bucket: TokenBucket,
    cost: u64,
) -> Result<BucketResult, StateError> {
    wit_state::token_bucket_take(
        key,
        bucket.capacity,
        bucket.refill_tokens,
        bucket.refill_interval_ms,
        cost,
    )
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
    let alg = match alg {
        Algorithm::Hs256 => wit_crypto::Algorithm::Hs256,
        Algorithm::Hs384 => wit_crypto::Algorithm::Hs384,
        Algorithm::Hs512 => wit_crypto::Algorithm::Hs512,
        Algorithm::Rs256 => wit_crypto::Algorithm::Rs256,
        Algorithm::Rs384 => wit_crypto::Algorithm::Rs384,
        Algorithm::Rs512 => wit_crypto::Algorithm::Rs512,
        Algorithm::Ps256 => wit_crypto::Algorithm::Ps256,
        Algorithm::Ps384 => wit_crypto::Algorithm::Ps384,
        Algorithm::Ps512 => wit_crypto::Algorithm::Ps512,
        Algorithm::Es256 => wit_crypto::Algorithm::Es256,
        Algorithm::Es384 => wit_crypto::Algorithm::Es384,
        Algorithm::EdDsa => wit_crypto::Algorithm::Eddsa,
        // Newer than the enum: by name.
        Algorithm::Es512 => {
            return wit_crypto::verify_named(alg.name(), key_set, key_id, message, signature)
                .map_err(verify_error);
        }
    };
    wit_crypto::verify(alg, key_set, key_id, message, signature).map_err(verify_error)
}

fn verify_error(e: wit_crypto::VerifyError) -> VerifyError {
    match e {
        wit_crypto::VerifyError::UnknownKeySet => VerifyError::UnknownKeySet,
        wit_crypto::VerifyError::UnknownKey => VerifyError::UnknownKey,
        wit_crypto::VerifyError::KeyAlgorithmMismatch => VerifyError::KeyAlgorithmMismatch,
        wit_crypto::VerifyError::InvalidSignature => VerifyError::InvalidSignature,
    }
}

pub(crate) fn key_set_version(key_set: &str) -> u64 {
    wit_crypto::key_set_version(key_set)
}

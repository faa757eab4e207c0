//! The node-wide services a filter imports: log, clock, metrics, shared state and
//! signature verification.

use dpumesh_shared_state::BucketSpec;

use super::{MetricHandle, MetricKind, StoreState};
use crate::bindings::dpumesh::filter::{clock, crypto, log, metrics, shared_state};

// === impl log ===

fn enabled(level: log::Level) -> bool {
    match level {
        log::Level::Trace => tracing::enabled!(target: "dpumesh::filter", tracing::Level::TRACE),
        log::Level::Debug => tracing::enabled!(target: "dpumesh::filter", tracing::Level::DEBUG),
        log::Level::Info => tracing::enabled!(target: "dpumesh::filter", tracing::Level::INFO),
        log::Level::Warn => tracing::enabled!(target: "dpumesh::filter", tracing::Level::WARN),
        log::Level::Error => tracing::enabled!(target: "dpumesh::filter", tracing::Level::ERROR),
    }
}

impl log::Host for StoreState {
    fn enabled(&mut self, level: log::Level) -> wasmtime::Result<bool> {
        Ok(enabled(level))
    }

    fn log(&mut self, level: log::Level, message: String) -> wasmtime::Result<()> {
        let filter = &*self.member().tag.name;
        match level {
            log::Level::Trace => tracing::trace!(target: "dpumesh::filter", filter, "{message}"),
            log::Level::Debug => tracing::debug!(target: "dpumesh::filter", filter, "{message}"),
            log::Level::Info => tracing::info!(target: "dpumesh::filter", filter, "{message}"),
            log::Level::Warn => tracing::warn!(target: "dpumesh::filter", filter, "{message}"),
            log::Level::Error => tracing::error!(target: "dpumesh::filter", filter, "{message}"),
        }
        Ok(())
    }
}

// === impl clock ===

impl clock::Host for StoreState {
    fn wall_ns(&mut self) -> wasmtime::Result<u64> {
        Ok(self.services.clock.wall_ns())
    }

    fn monotonic_ns(&mut self) -> wasmtime::Result<u64> {
        Ok(self.services.clock.monotonic_ns())
    }
}

// === impl metrics ===

impl metrics::Host for StoreState {
    fn counter(
        &mut self,
        name: String,
        labels: Vec<(String, String)>,
    ) -> wasmtime::Result<Result<u32, metrics::MetricError>> {
        Ok(self.define_metric(MetricKind::Counter, name, labels))
    }

    fn gauge(
        &mut self,
        name: String,
        labels: Vec<(String, String)>,
    ) -> wasmtime::Result<Result<u32, metrics::MetricError>> {
        Ok(self.define_metric(MetricKind::Gauge, name, labels))
    }

    fn histogram(
        &mut self,
        name: String,
        labels: Vec<(String, String)>,
    ) -> wasmtime::Result<Result<u32, metrics::MetricError>> {
        Ok(self.define_metric(MetricKind::Histogram, name, labels))
    }

    fn increment(&mut self, id: u32, delta: u64) -> wasmtime::Result<()> {
        if let Some(MetricHandle::Counter(c)) = self.member().metrics.get(id as usize) {
            c.increment(delta);
        }
        Ok(())
    }

    fn increment_batch(&mut self, deltas: Vec<(u32, u64)>) -> wasmtime::Result<()> {
        for (id, delta) in deltas {
            metrics::Host::increment(self, id, delta)?;
        }
        Ok(())
    }

    fn gauge_set(&mut self, id: u32, value: f64) -> wasmtime::Result<()> {
        if let Some(MetricHandle::Gauge(g)) = self.member().metrics.get(id as usize) {
            g.set(value);
        }
        Ok(())
    }

    fn gauge_add(&mut self, id: u32, delta: f64) -> wasmtime::Result<()> {
        if let Some(MetricHandle::Gauge(g)) = self.member().metrics.get(id as usize) {
            g.increment(delta);
        }
        Ok(())
    }

    fn observe(&mut self, id: u32, value: f64) -> wasmtime::Result<()> {
        if let Some(MetricHandle::Histogram(h)) = self.member().metrics.get(id as usize) {
            h.record(value);
        }
        Ok(())
    }
}

// === impl shared-state ===

fn state_error(e: dpumesh_shared_state::StateError) -> shared_state::StateError {
    match e {
        dpumesh_shared_state::StateError::InvalidKey => shared_state::StateError::InvalidKey,
        dpumesh_shared_state::StateError::WrongType => shared_state::StateError::WrongType,
        dpumesh_shared_state::StateError::Full => shared_state::StateError::Full,
    }
}

impl shared_state::Host for StoreState {
    fn increment(
        &mut self,
        key: String,
        delta: i64,
        ttl_ms: u64,
    ) -> wasmtime::Result<Result<i64, shared_state::StateError>> {
        Ok(self
            .member()
            .namespace
            .increment(&key, delta, ttl_ms)
            .map_err(state_error))
    }

    fn get(
        &mut self,
        key: String,
    ) -> wasmtime::Result<Result<Option<i64>, shared_state::StateError>> {
        Ok(self.member().namespace.get(&key).map_err(state_error))
    }

    fn compare_and_swap(
        &mut self,
        key: String,
        expected: Option<i64>,
        desired: i64,
        ttl_ms: u64,
    ) -> wasmtime::Result<Result<Result<(), Option<i64>>, shared_state::StateError>> {
        Ok(self
            .member()
            .namespace
            .compare_and_swap(&key, expected, desired, ttl_ms)
            .map_err(state_error))
    }

    fn delete(&mut self, key: String) -> wasmtime::Result<Result<bool, shared_state::StateError>> {
        Ok(self.member().namespace.delete(&key).map_err(state_error))
    }

    fn token_bucket_take(
        &mut self,
        key: String,
        capacity: u64,
        refill_tokens: u64,
        refill_interval_ms: u64,
        cost: u64,
    ) -> wasmtime::Result<Result<shared_state::BucketResult, shared_state::StateError>> {
        let spec = BucketSpec {
            capacity,
            refill_tokens,
            refill_interval_ms,
        };
        Ok(self
            .member()
            .namespace
            .token_bucket_take(&key, spec, cost)
            .map(|r| shared_state::BucketResult {
                allowed: r.allowed,
                remaining: r.remaining,
                reset_after_ms: r.reset_after_ms,
            })
            .map_err(state_error))
    }
}

// === impl crypto ===

fn algorithm(alg: crypto::Algorithm) -> dpumesh_keys::Algorithm {
    use dpumesh_keys::Algorithm as A;
    match alg {
        crypto::Algorithm::Hs256 => A::Hs256,
        crypto::Algorithm::Hs384 => A::Hs384,
        crypto::Algorithm::Hs512 => A::Hs512,
        crypto::Algorithm::Rs256 => A::Rs256,
        crypto::Algorithm::Rs384 => A::Rs384,
        crypto::Algorithm::Rs512 => A::Rs512,
        crypto::Algorithm::Ps256 => A::Ps256,
        crypto::Algorithm::Ps384 => A::Ps384,
        crypto::Algorithm::Ps512 => A::Ps512,
        crypto::Algorithm::Es256 => A::Es256,
        crypto::Algorithm::Es384 => A::Es384,
        crypto::Algorithm::Eddsa => A::EdDsa,
    }
}

impl StoreState {
    fn verify_with(
        &self,
        alg: dpumesh_keys::Algorithm,
        key_set: &str,
        key_id: Option<&str>,
        message: &[u8],
        signature: &[u8],
    ) -> Result<String, crypto::VerifyError> {
        use dpumesh_keys::VerifyError as K;
        self.services
            .keys
            .verify(alg, key_set, key_id, message, signature)
            .map_err(|e| match e {
                K::UnknownKeySet => crypto::VerifyError::UnknownKeySet,
                K::UnknownKey => crypto::VerifyError::UnknownKey,
                K::KeyAlgorithmMismatch => crypto::VerifyError::KeyAlgorithmMismatch,
                K::InvalidSignature => crypto::VerifyError::InvalidSignature,
            })
    }
}

impl crypto::Host for StoreState {
    fn verify(
        &mut self,
        alg: crypto::Algorithm,
        key_set: String,
        key_id: Option<String>,
        message: Vec<u8>,
        signature: Vec<u8>,
    ) -> wasmtime::Result<Result<String, crypto::VerifyError>> {
        Ok(self.verify_with(
            algorithm(alg),
            &key_set,
            key_id.as_deref(),
            &message,
            &signature,
        ))
    }

    fn verify_named(
        &mut self,
        alg: String,
        key_set: String,
        key_id: Option<String>,
        message: Vec<u8>,
        signature: Vec<u8>,
    ) -> wasmtime::Result<Result<String, crypto::VerifyError>> {
        Ok(match alg.parse::<dpumesh_keys::Algorithm>() {
            Ok(alg) => self.verify_with(alg, &key_set, key_id.as_deref(), &message, &signature),
            Err(_) => Err(crypto::VerifyError::KeyAlgorithmMismatch),
        })
    }

    fn key_set_version(&mut self, key_set: String) -> wasmtime::Result<u64> {
        Ok(self.services.keys.version(&key_set))
    }
}

//! Shared helpers: a runtime with a test-wide compile cache, and chains of the
//! configurable test filter.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use dpumesh_runtime::{
    FilterChain, FilterSettings, LoadedFilter, RequestHead, Runtime, RuntimeConfig,
};
use dpumesh_test_artifacts as artifacts;

pub fn cache_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cwasm-cache")
}

pub fn runtime() -> Runtime {
    runtime_with(true)
}

/// A runtime whose filters run as core instances where they can (`core_calls`), or
/// all through wasmtime's component calls.
pub fn runtime_with(core_calls: bool) -> Runtime {
    Runtime::new(RuntimeConfig {
        cache_dir: Some(cache_dir()),
        max_instances: 32,
        core_calls,
        ..RuntimeConfig::default()
    })
    .expect("runtime starts")
}

/// Test-filter settings with namespace `test`, so filters of one chain share counters.
///
/// A generous CPU deadline: these tests are not about it (the deadline tests set
/// their own).
pub fn settings(name: &str, config: serde_json::Value) -> FilterSettings {
    FilterSettings::new(name, config.to_string())
        .namespace("test")
        .deadline(Duration::from_secs(2))
}

pub fn load(rt: &Runtime, settings: FilterSettings) -> Arc<LoadedFilter> {
    rt.load_filter(settings, &artifacts::read(artifacts::TEST_FILTER))
        .expect("test filter loads")
}

/// A chain of test filters; fused when `DPUMESH_TEST_FUSED=1`, which is how
/// `scripts/test.sh` runs the chain and fault tests a second time to hold fused
/// chains to the same behaviour.
pub fn chain(rt: &Runtime, filters: Vec<FilterSettings>) -> Arc<FilterChain> {
    let loaded = filters.into_iter().map(|s| load(rt, s)).collect();
    let chain = FilterChain::new("test-chain", loaded);
    if fused() {
        Arc::new(chain.fuse().expect("the test chain fuses"))
    } else {
        Arc::new(chain)
    }
}

/// Whether this run holds fused chains to the tests (`DPUMESH_TEST_FUSED=1`).
pub fn fused() -> bool {
    std::env::var("DPUMESH_TEST_FUSED").is_ok_and(|v| v == "1")
}

pub fn get(target: &str) -> RequestHead {
    let mut head = RequestHead::new("GET", target);
    head.authority = "api.example.com".to_owned();
    head
}

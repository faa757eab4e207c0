//! Paths of the guest components built for tests and benches (see `build.rs`).

/// The configurable test filter (`tests/programs/test-filter`).
pub const TEST_FILTER: &str = env!("TEST_FILTER_WASM");

/// The sample `guard` filter (`samples/filters/guard`).
pub const SAMPLE_GUARD: &str = env!("SAMPLE_GUARD_WASM");

/// The API-key sample filter in Rust (`samples/filters/rust`).
pub const SAMPLE_APIKEY: &str = env!("SAMPLE_APIKEY_WASM");

/// The built-in `trace` filter (`filters/trace`).
pub const FILTER_TRACE: &str = env!("FILTER_TRACE_WASM");

/// The built-in `ratelimit` filter (`filters/ratelimit`).
pub const FILTER_RATELIMIT: &str = env!("FILTER_RATELIMIT_WASM");

/// The built-in `circuit-breaker` filter (`filters/circuit-breaker`).
pub const FILTER_CIRCUIT_BREAKER: &str = env!("FILTER_CIRCUIT_BREAKER_WASM");

/// The built-in `rbac` filter (`filters/rbac`).
pub const FILTER_RBAC: &str = env!("FILTER_RBAC_WASM");

/// The built-in `jwt` filter (`filters/jwt`).
pub const FILTER_JWT: &str = env!("FILTER_JWT_WASM");

/// The built-in filters by folder name under `filters/` (and `tests/conformance/`).
pub const BUILTIN_FILTERS: &[(&str, &str)] = &[
    ("trace", FILTER_TRACE),
    ("ratelimit", FILTER_RATELIMIT),
    ("circuit-breaker", FILTER_CIRCUIT_BREAKER),
    ("rbac", FILTER_RBAC),
    ("jwt", FILTER_JWT),
];

/// Reads a component's bytes.
///
/// # Panics
/// If the file is missing (the build script guarantees it is not).
pub fn read(path: &str) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("reading {path}: {e}"))
}

/// The configurable proxy-wasm test plugin (`tests/programs/proxy-wasm-test`), a core
/// module built with the proxy-wasm crate for `wasm32-wasip1`.
pub const PROXY_WASM_TEST: &str = env!("PROXY_WASM_TEST_WASM");

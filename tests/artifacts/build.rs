//! Builds the guest components used by tests and benches (`wasm32-wasip2`, release)
//! and exports their paths as compile-time environment variables. Components are build
//! outputs, never committed.

use std::path::{Path, PathBuf};
use std::process::Command;

/// (cargo package, crate file stem, exported variable)
const GUESTS: &[(&str, &str, &str)] = &[
    (
        "dpumesh-test-filter",
        "dpumesh_test_filter",
        "TEST_FILTER_WASM",
    ),
    (
        "dpumesh-sample-guard",
        "dpumesh_sample_guard",
        "SAMPLE_GUARD_WASM",
    ),
    (
        "dpumesh-sample-apikey",
        "dpumesh_sample_apikey",
        "SAMPLE_APIKEY_WASM",
    ),
    (
        "dpumesh-filter-trace",
        "dpumesh_filter_trace",
        "FILTER_TRACE_WASM",
    ),
    (
        "dpumesh-filter-ratelimit",
        "dpumesh_filter_ratelimit",
        "FILTER_RATELIMIT_WASM",
    ),
    (
        "dpumesh-filter-circuit-breaker",
        "dpumesh_filter_circuit_breaker",
        "FILTER_CIRCUIT_BREAKER_WASM",
    ),
    (
        "dpumesh-filter-rbac",
        "dpumesh_filter_rbac",
        "FILTER_RBAC_WASM",
    ),
    (
        "dpumesh-filter-jwt",
        "dpumesh_filter_jwt",
        "FILTER_JWT_WASM",
    ),
];

fn main() {
    let manifest_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let workspace = manifest_dir.join("../..").canonicalize().unwrap();
    println!("cargo:rerun-if-changed=build.rs");
    for watched in [
        "wit",
        "sdk",
        "crates/claims",
        "crates/jose",
        "filters",
        "tests/programs",
        "samples/filters",
        "Cargo.lock",
    ] {
        let path = workspace.join(watched);
        // Cargo takes a missing path as changed: every cargo command would run this
        // script again and rebuild what uses the components (it did, after claims and
        // jose moved under crates/: 20 s of CI a cargo step).
        assert!(
            path.exists(),
            "{} is gone: name where it moved in tests/artifacts/build.rs",
            path.display()
        );
        println!("cargo:rerun-if-changed={}", path.display());
    }
    let target_dir = workspace.join("target").join("wasm-artifacts");
    build(&workspace, &target_dir, "wasm32-wasip2", GUESTS);
    // proxy-wasm plugins are core modules for WASI preview 1, as Envoy's are.
    build(&workspace, &target_dir, "wasm32-wasip1", PROXY_WASM_GUESTS);
}

/// Core-module guests (`wasm32-wasip1`): proxy-wasm plugins.
const PROXY_WASM_GUESTS: &[(&str, &str, &str)] = &[(
    "dpumesh-proxy-wasm-test",
    "dpumesh_proxy_wasm_test",
    "PROXY_WASM_TEST_WASM",
)];

/// Builds `guests` for `target` in one cargo run and exports their paths.
fn build(workspace: &Path, target_dir: &Path, target: &str, guests: &[(&str, &str, &str)]) {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(workspace)
        .args(["build", "--release", "--target", target])
        .arg("--target-dir")
        .arg(target_dir);
    for (package, _, _) in guests {
        cmd.args(["-p", package]);
    }
    // Settings of the outer build must not leak into the guest build.
    for var in [
        "CARGO_ENCODED_RUSTFLAGS",
        "RUSTFLAGS",
        "CARGO_TARGET_DIR",
        "CARGO_BUILD_TARGET",
        "CARGO_MAKEFLAGS",
        "RUSTC_WORKSPACE_WRAPPER",
        "CARGO_PRIMARY_PACKAGE",
    ] {
        cmd.env_remove(var);
    }
    // Guests run per request on the DPU's cores: whole-program optimization (LTO, one
    // codegen unit) inlines the SDK's glue into each filter. wasm32 aborts on panic
    // already (the host sees a trap with the panic message on stderr).
    cmd.env("CARGO_PROFILE_RELEASE_DEBUG", "false")
        .env("CARGO_PROFILE_RELEASE_STRIP", "true")
        .env("CARGO_PROFILE_RELEASE_LTO", "fat")
        .env("CARGO_PROFILE_RELEASE_CODEGEN_UNITS", "1");
    let status = cmd
        .status()
        .expect("run cargo to build the guest components");
    assert!(
        status.success(),
        "building guests for {target} failed; is the target installed? (rustup target add {target})"
    );
    for (_, stem, var) in guests {
        let path = target_dir
            .join(target)
            .join("release")
            .join(format!("{stem}.wasm"));
        assert!(exists(&path), "expected {}", path.display());
        println!("cargo:rustc-env={var}={}", path.display());
    }
}

fn exists(path: &Path) -> bool {
    path.is_file()
}

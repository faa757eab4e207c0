#!/usr/bin/env bash
# Runs every check and test: formatting, clippy (warnings are errors), and the whole
# workspace's tests (guest components are built for wasm32-wasip2 by the test build).
set -euo pipefail
cd "$(dirname "$0")/.."
# One clean build: incremental state would only double the target directory's size.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"

./scripts/install-toolchain.sh
echo "==> cargo fmt --check"
cargo fmt --all --check
echo "==> cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "==> cargo clippy (guest crates for wasm32-wasip2)"
cargo clippy --locked --target wasm32-wasip2 -p dpumesh-filter-sdk -p dpumesh-guest-alloc -p dpumesh-sample-guard -p dpumesh-sample-apikey -p dpumesh-test-filter -p dpumesh-filter-trace -p dpumesh-filter-ratelimit -p dpumesh-filter-circuit-breaker -p dpumesh-filter-rbac -p dpumesh-filter-jwt -- -D warnings
echo "==> cargo clippy (the proxy-wasm test plugin for wasm32-wasip1)"
cargo clippy --locked --target wasm32-wasip1 -p dpumesh-proxy-wasm-test -- -D warnings
echo "==> cargo clippy (data path with the DOCA backends: type-checked, linked only on BlueField)"
cargo clippy --locked -p dpumesh-dpa --features doca --all-targets -- -D warnings
echo "==> cargo clippy (data path with the verbs backend)"
cargo clippy --locked -p dpumesh-dpa --features verbs --all-targets -- -D warnings
echo "==> the Python host library (pip install ./host-lib/python)"
./scripts/install-python.sh
echo "==> cargo test"
cargo test --workspace --locked
echo "==> the runtime's chain and fault tests again, every test chain fused into one component"
DPUMESH_TEST_FUSED=1 cargo test --locked -p dpumesh-runtime --test all -- chain:: faults:: claims::
echo "==> cargo test (verbs backend: with no RDMA device it says so)"
cargo test --locked -p dpumesh-dpa --features verbs --lib fabric::verbs
echo "==> the DPU side for Arm64 (aarch64 cross-build, tests under qemu)"
./scripts/test-arm64.sh
echo "==> pytest (the Python host library: the seed's examples, errors, WSGI)"
python3 -m pytest -q host-lib/python/tests
echo "==> deploy/ (Helm chart rendered by Helm, DPF manifests against the DPF CRDs, kustomize, Kubernetes schemas)"
./scripts/install-deploy-tools.sh >/dev/null
python3 -m pytest -q deploy/tests

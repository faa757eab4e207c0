#!/usr/bin/env bash
# One command on a fresh machine: install the toolchains, build the sample and built-in
# filters as Wasm components and the dpumesh binary (release), and run the demo.
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/install-toolchain.sh
echo "==> building the sample filter (wasm32-wasip2 component)"
CARGO_PROFILE_RELEASE_DEBUG=false CARGO_PROFILE_RELEASE_STRIP=true \
    cargo build --release --target wasm32-wasip2 -p dpumesh-sample-guard
echo "==> building the built-in filters (target/wasm-artifacts; used by samples/proxy/proxy.yaml)"
cargo build --release -p dpumesh-test-artifacts
echo "==> building dpumesh (release; wasmtime takes a few minutes the first time)"
cargo build --release -p dpumesh
echo "==> running the demo"
exec ./target/release/dpumesh demo "$@"

#!/usr/bin/env bash
# One command on a fresh machine: install the toolchains, build the built-in filters as
# Wasm components, the dpumesh binary and the hotel sample (release), install the host
# library's Python package, and start the local mesh (`dpumesh up`: ingress, two nodes, the hotel services). Ctrl-C stops it.
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/install-toolchain.sh
echo "==> building the sample filter (wasm32-wasip2 component)"
CARGO_PROFILE_RELEASE_DEBUG=false CARGO_PROFILE_RELEASE_STRIP=true \
    cargo build --release --target wasm32-wasip2 -p dpumesh-sample-guard
echo "==> building the built-in filters (target/wasm-artifacts; used by samples/proxy/proxy.yaml)"
cargo build --release -p dpumesh-test-artifacts
echo "==> building dpumesh and the hotel sample (release; wasmtime takes a few minutes the first time)"
cargo build --release -p dpumesh -p dpumesh-sample-hotel
echo "==> the host library for Python (pip install ./host-lib/python; samples/hotel-py)"
./scripts/install-python.sh
echo "==> starting the local mesh"
exec ./target/release/dpumesh up "$@"

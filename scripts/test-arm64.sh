#!/usr/bin/env bash
# The DPU side built for BlueField-3's Arm cores (aarch64-unknown-linux-gnu, Debian's
# cross linker) and its tests run under qemu-aarch64 user emulation (.cargo/config.toml
# names both): the data path (rings, pools, doorbells, DMA cases 1/2/3 through real pod
# processes, both fabrics, RPC), the filter runtime (chains, limits, deadlines, reload,
# Cranelift's aarch64 code), every built-in filter's conformance suite, the BlueCache
# agent (protocol, backends, pipelined transfers, cancellation), the HTTP cache's
# policy, and the Pingmesh agent's logic (prober, responder, probe messages; the UD
# queue pairs are in the data path's tests).
# `./scripts/test.sh` runs this; alone: `./scripts/test-arm64.sh`. Arguments go to
# `cargo test` (`--no-run` builds only; `--no-fail-fast` runs every binary).
#
# Left out under emulation, with the reason: the proxy, ingress and CLI end-to-end
# tests (they are x86-64 process orchestration over the same crates tested here, and
# under qemu each would cost minutes of CI for no Arm-specific code), and the runtime's
# CPU-deadline test binary (it measures CPU time against wall time, which emulation
# distorts: its logic is covered by the budget's unit tests here).
#
# qemu-user runs aarch64 code on x86-64's stronger memory model, so these runs cannot
# show a missing barrier: the orderings of the shared-memory protocols were reviewed
# for Arm instead (docs/data-path.md, "Memory ordering on Arm").
set -euo pipefail
cd "$(dirname "$0")/.."
target=aarch64-unknown-linux-gnu
# One cargo invocation: the three packages share one feature resolution, so wasmtime
# and Cranelift are compiled for aarch64 once (separate invocations built them twice,
# ~4 minutes of CI).
echo "==> aarch64 under qemu: the data path, the filter runtime, the built-in filters' suites, the BlueCache agent, the HTTP cache policy, Pingmesh"
cargo test --locked --target "$target" \
    -p dpumesh-dpa -p dpumesh-rings -p dpumesh-fabric -p dpumesh-control -p dpumesh-runtime -p dpumesh-conformance -p dpumesh-store -p dpumesh-http-cache -p dpumesh-pingmesh \
    --lib --test cases --test fabric_cases --test multiprocess --test all --test suites "$@"

#!/usr/bin/env bash
# Installs what building and testing DPUmesh needs, idempotently: the pinned Rust
# toolchain (rust-toolchain.toml) with rustfmt, clippy and the wasm32-wasip2 target.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v rustup >/dev/null 2>&1; then
    echo "error: rustup is required (https://rustup.rs); install it, then rerun $0" >&2
    exit 1
fi
channel=$(sed -n 's/^channel = "\(.*\)"/\1/p' rust-toolchain.toml)
rustup toolchain list | grep -q "^${channel}" || rustup toolchain install "$channel" --profile minimal
rustup component list --toolchain "$channel" --installed | grep -q '^rustfmt' \
    || rustup component add --toolchain "$channel" rustfmt
rustup component list --toolchain "$channel" --installed | grep -q '^clippy' \
    || rustup component add --toolchain "$channel" clippy
rustup target list --toolchain "$channel" --installed | grep -qx wasm32-wasip2 \
    || rustup target add --toolchain "$channel" wasm32-wasip2

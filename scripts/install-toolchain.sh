#!/usr/bin/env bash
# Installs what building and testing DPUmesh needs, idempotently: the pinned Rust
# toolchain (rust-toolchain.toml) with rustfmt, clippy and the wasm32-wasip2 target, the
# guest toolchains of the other filter languages, and the Arm64 cross toolchain.
set -euo pipefail
cd "$(dirname "$0")/.."

# Installs the Debian packages given after the purpose that are missing (as root),
# or says what is missing for that purpose.
debian_packages() {
    local purpose=$1 missing="" p
    shift
    for p in "$@"; do
        dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"
    done
    [ -z "$missing" ] && return 0
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
    else
        echo "warning: $purpose need: apt-get install$missing" >&2
    fi
}

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
for target in wasm32-wasip2 wasm32-wasip1; do
    # wasip1: proxy-wasm plugins are core modules for WASI preview 1, as Envoy's are.
    rustup target list --toolchain "$channel" --installed | grep -qx "$target" \
        || rustup target add --toolchain "$channel" "$target"
done

# Guest toolchains for `dpumesh filter build` in other languages.
# Python: componentize-py from PyPI.
componentize_py_version=0.25.1
if ! command -v componentize-py >/dev/null 2>&1 \
    || [ "$(componentize-py --version 2>/dev/null)" != "componentize-py ${componentize_py_version}" ]; then
    if command -v pip3 >/dev/null 2>&1; then
        pip3 install --quiet --disable-pip-version-check "componentize-py==${componentize_py_version}"
    else
        echo "warning: pip3 not found; Python filters need: pip install componentize-py==${componentize_py_version}" >&2
    fi
fi

# JavaScript: ComponentizeJS from npm, driven through its JS API by `dpumesh filter build`.
componentize_js_version=0.23.0
js_tools="${DPUMESH_JS_TOOLS:-${XDG_CACHE_HOME:-$HOME/.cache}/dpumesh/js-tools}"
js_installed="$js_tools/node_modules/@bytecodealliance/componentize-js/package.json"
if ! grep -q "\"version\": \"${componentize_js_version}\"" "$js_installed" 2>/dev/null; then
    if command -v npm >/dev/null 2>&1; then
        mkdir -p "$js_tools"
        npm install --silent --no-audit --no-fund --prefix "$js_tools" \
            "@bytecodealliance/componentize-js@${componentize_js_version}"
    else
        echo "warning: npm not found; JavaScript filters need Node.js and npm (apt install nodejs npm)" >&2
    fi
fi

# C: clang for wasm32-wasi with wasi-libc (bindings and componentizing are in-process).
# The data path's `verbs` feature: libibverbs/librdmacm headers and libclang for
# rdma-sys' bindgen (compiled and tested for the no-device case in CI).
# R-Pingmesh's gRPC APIs: protoc compiles crates/pingmesh/proto for tonic/prost at build time.
debian_packages "the Pingmesh gRPC build" protobuf-compiler
# The Pingmesh dashboard's test loads it in headless Chromium.
debian_packages "the dashboard's browser test" chromium
debian_packages "the HTTPS tests (curl over TLS with HTTP/2)" curl
debian_packages "C filters and the verbs backend" \
    clang lld wasi-libc libclang-rt-14-dev-wasm32 libibverbs-dev librdmacm-dev libclang-dev pkg-config

# The DPU side for BlueField-3's Arm cores: the aarch64 target, Debian's cross linker
# and qemu user emulation to run its tests (scripts/test-arm64.sh; .cargo/config.toml
# names the linker and the runner).
rustup target list --toolchain "$channel" --installed | grep -qx aarch64-unknown-linux-gnu \
    || rustup target add --toolchain "$channel" aarch64-unknown-linux-gnu
debian_packages "the Arm64 build and its emulated tests" \
    gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user-static

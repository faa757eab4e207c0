#!/usr/bin/env bash
# Installs the host library's Python package (`dpumesh`, built from host-lib/python
# with maturin through pip) and what its tests and samples need (Flask, pytest), for
# the python3 on PATH. Idempotent; the package is rebuilt from the current source
# each time (cargo's cache makes an unchanged one quick).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v pip3 >/dev/null 2>&1; then
    echo "error: pip3 is required for the Python host library (apt-get install python3-pip)" >&2
    exit 1
fi
pip=(pip3 install --quiet --disable-pip-version-check)
python3 -c "import flask, pytest" 2>/dev/null || "${pip[@]}" "flask>=2.2,<4" "pytest>=7,<9"
# FastAPI: the ASGI side's tests (python -m dpumesh.server --asgi).
python3 -c "import fastapi" 2>/dev/null || "${pip[@]}" "fastapi>=0.100,<1"
# grpcio: a Python gRPC server joined through the bridge (cli/tests/bridge.rs), its
# code generated from samples/grpc/proto by grpcio-tools.
python3 -c "import grpc, grpc_tools" 2>/dev/null || "${pip[@]}" "grpcio>=1.60,<2" "grpcio-tools>=1.60,<2"
# websockets: an unmodified WebSocket server and client through the mesh
# (cli/tests/bridge.rs).
python3 -c "import websockets" 2>/dev/null || "${pip[@]}" "websockets>=12,<16"
# matplotlib: bench/scale.sh's plots (one PNG per dimension).
python3 -c "import matplotlib" 2>/dev/null || "${pip[@]}" "matplotlib>=3.7,<4"
python3 -c "import maturin" 2>/dev/null || "${pip[@]}" "maturin>=1.9.4,<2"
# No build isolation: maturin (installed above) builds with the workspace's Cargo.lock
# and target directory, so the Rust dependencies are shared with the other builds.
"${pip[@]}" --no-build-isolation --force-reinstall --no-deps ./host-lib/python
python3 -c "import dpumesh, dpumesh._native" || {
    echo "error: the dpumesh package did not import after installing" >&2
    exit 1
}

"""The Python binding's cost per step against the Rust library, in one run.

The same three handlers — answer at once, one egress call, one internal step — run on
the same event loop over the in-memory transport (an upstream answering at once, in
Rust), as a Rust handler and as a Python one (bare WSGI, and Flask). Rounds alternate
Python and Rust so the machine's drift hits both. Per step overhead = (handler with the
step − handler without) in Python minus the same difference in Rust.

    python3 host-lib/python/bench/binding.py [requests per round] [rounds]
"""

import statistics
import sys

from flask import Flask

from dpumesh import _native
from dpumesh.server import get_context
from dpumesh.testing import TestMesh

N = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 5


def done():
    return "done"


def bare(environ, start_response):
    path = environ["PATH_INFO"]
    if path == "/egress":
        get_context().call("GET", "http://a/")
        start_response("200 OK", [])
        return [b""]
    if path == "/internal":
        get_context().run_internal(done)
        start_response("200 OK", [])
        return [b""]
    start_response("200 OK", [("content-type", "text/plain")])
    return [b"pong\n"]


flask_app = Flask(__name__)


@flask_app.route("/none")
def f_none():
    return "pong\n"


@flask_app.route("/egress")
def f_egress():
    get_context().call("GET", "http://a/")
    return ""


@flask_app.route("/internal")
def f_internal():
    get_context().run_internal(done)
    return ""


def main():
    meshes = {
        "bare WSGI": TestMesh(bare, services={"a": "a"}, record=False),
        "Flask": TestMesh(flask_app, services={"a": "a"}, record=False),
    }
    kinds = ["none", "egress", "internal"]
    times = {(who, k): [] for who in ["Rust", *meshes] for k in kinds}
    for mesh in meshes.values():  # warm up
        for k in kinds:
            mesh.run_batch(f"/{k}", 2000)
    for _ in range(ROUNDS):
        for k in kinds:
            times[("Rust", k)].append(_native.bench_rust(k, N))
            for who, mesh in meshes.items():
                times[(who, k)].append(mesh.run_batch(f"/{k}", N))
    med = {key: statistics.median(v) / 1000 for key, v in times.items()}
    print(f"{N} requests per round, {ROUNDS} rounds, median µs per request (wall)")
    print(f"{'handler':<12}" + "".join(f"{who:>12}" for who in ["Rust", *meshes]))
    for k in kinds:
        print(f"{k:<12}" + "".join(f"{med[(who, k)]:>12.2f}" for who in ["Rust", *meshes]))
    print()
    for k in ["egress", "internal"]:
        rust = med[("Rust", k)] - med[("Rust", "none")]
        for who in meshes:
            py = med[(who, k)] - med[(who, "none")]
            print(
                f"per {k} step, {who}: {py:.2f} µs vs Rust {rust:.2f} µs "
                f"→ binding overhead {py - rust:.2f} µs ({py / rust if rust > 0 else float('nan'):.1f}×)"
            )
    for who in meshes:
        print(f"a request answered at once, {who}: {med[(who, 'none')]:.2f} µs vs Rust {med[('Rust', 'none')]:.2f} µs")


if __name__ == "__main__":
    main()

"""Seed example 1 — basic use: an internal step on the thread pool, then two calls
at the same time. The answer is the graph's last step's result."""

from flask import Flask

from dpumesh.server import get_context

app = Flask(__name__)
config = {"scale": 2}


def process_data(cfg):
    return f"processed x{cfg['scale']}"


@app.route("/api/v1", methods=["GET", "POST"])
def handler():
    ctx = get_context()
    if ctx is not None:
        # Step 1: internal work (thread pool)
        ctx.run_internal(process_data, args=(config,), id="process")
        # Step 2: two calls at once (the data path carries both)
        with ctx.parallel():
            ctx.call("GET", "http://svc-a/api/v1")
            ctx.call("GET", "http://svc-b/api/v1")
        return ""  # the server answers with the graph's result
    return "not on the mesh"

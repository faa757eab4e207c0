"""Seed example 5 — fan-out / fan-in, with the low-level API and with a request
builder that returns several requests (sent at once inside a parallel block)."""

from flask import Flask

from dpumesh import EgressStep, InternalStep, order, pipe
from dpumesh.server import get_context

app = Flask(__name__)
user_url = "http://user/me"
order_url = "http://orders/latest"


def merge_fn(fetch_user, fetch_order):
    return {"user": fetch_user.json(), "order": fetch_order.json()}


@app.route("/low-level")
def low_level():
    ctx = get_context()
    ctx.add(
        order([
            pipe([
                EgressStep("fetch_user", requests=[("GET", user_url, {}, None)]),
                EgressStep("fetch_order", requests=[("GET", order_url, {}, None)]),
            ]),
            InternalStep("merge", func=merge_fn, inputs=["fetch_user", "fetch_order"]),
        ])
    )
    return ""


def shards(index):
    return [("GET", f"http://shard-{n}/search?q=x", {}, None) for n in index.json()["shards"]]


def gather(search):
    return {"hits": sorted(p.body for p in search.parts)}


@app.route("/search")
def search():
    ctx = get_context()
    ctx.call("GET", "http://index/shards", id="index")
    with ctx.parallel():
        ctx.call("GET", "unused", request_builder=shards, inputs=["index"], id="search")
    ctx.run_internal(gather, inputs=["search"])
    return ""

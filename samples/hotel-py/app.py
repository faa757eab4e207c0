"""The hotel sample's frontend in Python (Flask): it calls the Rust `user` and
`reservation` services at the same time through the mesh, then merges their answers
in an internal step — the same answers as the Rust frontend (`samples/hotel`).

Run on the mesh: `dpumesh up --config samples/hotel-py/mesh.yaml` (the mesh file starts it with
`python3 -m dpumesh.server app:app`). Under plain Flask (`flask --app app run`) the
handlers that need the mesh say so.
"""

import json

from flask import Flask, request

from dpumesh.server import get_context

app = Flask(__name__)


def merge(user, reservation):
    return {"user": user.json(), "reservations": reservation.json()["reservations"]}


@app.route("/hotels")
def hotels():
    ctx = get_context()
    if ctx is None:
        return "the frontend needs the mesh to call user and reservation\n", 503
    user = request.args.get("user", "0")
    with ctx.parallel():
        ctx.call("GET", f"http://user/user?id={user}", id="user")
        ctx.call("GET", f"http://reservation/reservations?user={user}", id="reservation")
    ctx.run_internal(merge, inputs=["user", "reservation"])
    return ""


@app.route("/ping")
@app.route("/limited")
def ping():
    return "pong\n"


@app.route("/echo", methods=["POST"])
def echo():
    body = request.get_data()
    import zlib

    return body[::-1], 200, {"x-crc32": str(zlib.crc32(body)), "x-len": str(len(body))}


@app.route("/hotels/inventory")
def inventory():
    # No service `inventory` runs in this mesh: the call fails, so does its step, and
    # the sequence stops there (502 naming the step, as the seed's error semantics say).
    ctx = get_context()
    ctx.call("GET", "http://inventory/stock", id="stock")
    ctx.run_internal(lambda stock: "never reached", inputs=["stock"])
    return ""


@app.route("/whoami")
def whoami():
    return json.dumps({"service": "frontend", "language": "python"}), 200, {
        "content-type": "application/json"
    }

"""The hotel sample's `user` service in Python: the same answers as the Rust one, so
the Rust frontend can call it through the mesh (Rust → Python) — the end-to-end test
runs the Rust hotel mesh with this in place of the Rust `user`."""

from flask import Flask, jsonify, request

app = Flask(__name__)


@app.route("/user")
def user():
    uid = request.args.get("id", "0")
    return jsonify({"id": uid, "name": f"guest-{uid}", "served_by": "python"})

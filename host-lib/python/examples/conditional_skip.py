"""Seed example 4 — conditional execution: a request builder returning [] skips its
step; the next step sees it skipped."""

from flask import Flask, request

from dpumesh.server import get_context

app = Flask(__name__)


def maybe_audit(account):
    if account.json().get("audited"):
        return []  # nothing to do: the step is skipped
    return [("POST", "http://audit/record", {"content-type": "application/json"}, account.body)]


def summary(account, audit):
    return {"account": account.json()["id"], "audit": "skipped" if audit.skipped else audit.body}


@app.route("/account/<name>")
def account(name):
    ctx = get_context()
    ctx.call("GET", f"http://accounts/{name}", id="account")
    ctx.call("POST", "unused", request_builder=maybe_audit, inputs=["account"], id="audit")
    ctx.run_internal(summary, inputs=["account", "audit"])
    return ""

"""Seed example 3 — a request built from an earlier result: the URL and body are
decided when the step starts."""

from flask import Flask

from dpumesh.server import get_context

app = Flask(__name__)


def build_req(config_step):
    target_host = config_step.body.strip()
    return [("POST", f"http://{target_host}/api", {}, "data")]


@app.route("/dynamic")
def dynamic_handler():
    ctx = get_context()
    s1 = ctx.call("GET", "http://config-service/target", id="config_step")
    # the url is ignored: request_builder's requests are sent
    ctx.call("GET", "dummy", request_builder=build_req, inputs=[s1])
    return ""

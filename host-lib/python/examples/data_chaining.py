"""Seed example 2 — data chaining: a step's result is the next step's input, passed
as a StepResult."""

from flask import Flask

from dpumesh.server import get_context

app = Flask(__name__)


def process_user_data(user_step):
    # user_step is the StepResult of "get_user" (passed positionally: the function
    # has no parameter named after the step)
    return f"Hello, {user_step.body}"


def greet(get_user):
    # named after the step: passed by keyword
    return {"greeting": f"Hi {get_user.json()['name']}", "status": get_user.status_code}


@app.route("/chain")
def chain_handler():
    ctx = get_context()
    step1 = ctx.call("GET", "http://user-service/me", id="get_user")
    ctx.run_internal(process_user_data, inputs=[step1])
    return ""


@app.route("/chain-json")
def chain_json():
    ctx = get_context()
    ctx.call("GET", "http://user-service/me.json", id="get_user")
    ctx.run_internal(greet, inputs=["get_user"])
    return ""

"""Bad input and failures: clear errors naming what went wrong, and the service goes
on serving."""

import pytest
from flask import Flask, request

from dpumesh import EgressStep, ExecutionContext, InternalStep, StepResult, order, pipe
from dpumesh import context as context_module
from dpumesh.server import get_context
from dpumesh.testing import TestMesh


def make_app():
    app = Flask(__name__)

    @app.route("/raise")
    def boom():
        raise ValueError("nope")

    @app.route("/internal-raises")
    def internal_raises():
        ctx = get_context()
        ctx.run_internal(lambda: 1 / 0, id="divide")
        ctx.call("GET", "http://never-called/")
        return ""

    @app.route("/bad-builder")
    def bad_builder():
        ctx = get_context()
        ctx.call("GET", "x", request_builder=lambda: 42, id="build")
        return ""

    @app.route("/bad-request-tuple")
    def bad_request_tuple():
        ctx = get_context()
        ctx.call("GET", "x", request_builder=lambda: [("GET", "http://up/")], id="short")
        return ""

    @app.route("/bad-return")
    def bad_return():
        get_context().run_internal(lambda: object(), id="returns-object")
        return ""

    @app.route("/duplicate")
    def duplicate():
        ctx = get_context()
        ctx.call("GET", "http://up/", id="a")
        ctx.call("GET", "http://up/", id="a")
        return ""

    @app.route("/both")
    def both():
        get_context().call("GET", "http://up/")
        return "a body too"

    @app.route("/plain", methods=["POST"])
    def plain():
        return (
            f"{request.method} {request.args.get('q')} {request.headers.get('x-who')} "
            f"{request.get_data(as_text=True)}",
            201,
            {"x-served-by": "flask"},
        )

    @app.route("/timeout")
    def timeout():
        get_context().call("GET", "http://silent/", timeout=0.05, id="slow")
        return ""

    @app.route("/transport")
    def transport():
        get_context().call("GET", "http://nowhere/", id="lost")
        return ""

    return app


@pytest.fixture()
def mesh():
    services = {
        "up": lambda req: (200, "up", 1),
        "never-called": lambda req: pytest.fail("called after a failed step"),
        "silent": lambda req: None,
    }
    return TestMesh(make_app(), services=services)


def test_a_handler_that_raises_answers_500_naming_the_handler(mesh):
    r = mesh.get("/raise")
    assert r.status == 500
    assert "test_errors.make_app.<locals>.boom" in r.text
    assert "ValueError: nope" in r.text


def test_an_internal_step_that_raises_fails_its_step_and_stops_the_sequence(mesh):
    r = mesh.get("/internal-raises")
    assert r.status == 500
    assert "divide" in r.text and "ZeroDivisionError" in r.text
    assert mesh.sent == []


def test_a_request_builder_returning_the_wrong_type_is_a_clear_type_error(mesh):
    r = mesh.get("/bad-builder")
    assert r.status == 500
    assert "TypeError: request_builder of step 'build' returned int" in r.text
    r = mesh.get("/bad-request-tuple")
    assert r.status == 500
    assert "TypeError" in r.text and "(method, url, headers, body)" in r.text


def test_an_internal_step_returning_an_unknown_type_is_a_type_error(mesh):
    r = mesh.get("/bad-return")
    assert r.status == 500
    assert "TypeError: internal step 'returns-object' returned object" in r.text


def test_a_duplicate_step_id_is_an_error_at_registration_naming_it(mesh):
    r = mesh.get("/duplicate")
    assert r.status == 500
    assert "step id 'a' is used twice" in r.text
    assert mesh.sent == []


def test_a_handler_returning_a_body_and_a_graph_is_told_to_return_empty(mesh):
    r = mesh.get("/both")
    assert r.status == 500
    assert 'return ""' in r.text


def test_a_handler_that_does_not_use_the_context_is_served_as_is(mesh):
    r = mesh.request("POST", "/plain?q=42", headers={"x-who": "me"}, body=b"payload")
    assert r.status == 201
    assert r.headers["x-served-by"] == "flask"
    assert r.text == "POST 42 me payload"


def test_a_step_past_its_timeout_answers_504(mesh):
    r = mesh.get("/timeout")
    assert r.status == 504
    assert "slow" in r.text


def test_a_call_the_transport_cannot_carry_answers_502(mesh):
    r = mesh.get("/transport")
    assert r.status == 502
    assert "lost" in r.text


def test_the_service_goes_on_serving_after_every_kind_of_failure(mesh):
    for path in ["/raise", "/internal-raises", "/bad-builder", "/bad-return", "/duplicate"]:
        assert mesh.get(path).status == 500
    assert mesh.get("/nowhere").status == 404
    assert mesh.request("POST", "/plain?q=1", body=b"x").status == 201


def test_inputs_must_name_steps_scheduled_before():
    ctx = ExecutionContext()
    ctx.call("GET", "http://a/", id="a")
    with pytest.raises(ValueError, match="step 'b' takes input 'later', which is not a step scheduled before it"):
        ctx.run_internal(print, inputs=["later"], id="b")
    with ctx.parallel():
        ctx.call("GET", "http://c/", id="c")
        with pytest.raises(ValueError, match="takes input 'c', which runs at the same time"):
            ctx.call("GET", "http://d/", id="d", inputs=["c"])
    # after the block, its steps are done
    ctx.run_internal(print, inputs=["a", "c"], id="e")


def test_the_low_level_graph_is_checked_when_added():
    ctx = ExecutionContext()
    with pytest.raises(ValueError, match="'x' is used twice"):
        ctx.add(order([EgressStep("x", requests=[("GET", "http://a/", {}, None)])] * 2))
    with pytest.raises(ValueError, match="takes input 'u', which runs at the same time"):
        ctx.add(
            pipe([
                EgressStep("u", requests=[("GET", "http://a/", {}, None)]),
                InternalStep("m", func=print, inputs=["u"]),
            ])
        )
    with pytest.raises(TypeError, match="a request is a \\(method, url, headers, body\\) tuple"):
        EgressStep("bad", requests=[("GET", "http://a/")])
    with pytest.raises(TypeError, match="inputs must be a list"):
        InternalStep("s", func=print, inputs="a")
    with pytest.raises(TypeError, match="not a step"):
        order(["just a string"])


def test_get_context_is_none_under_plain_flask():
    app = Flask(__name__)

    @app.route("/")
    def index():
        return "mesh" if get_context() is not None else "plain"

    assert app.test_client().get("/").text == "plain"


def test_get_context_outside_a_handler_while_serving_is_an_error():
    context_module._serving.set()
    try:
        with pytest.raises(RuntimeError, match="outside a request handler"):
            get_context()
    finally:
        context_module._serving.clear()


def test_step_result_reads_like_the_seed_says():
    ok = StepResult("s", status_code=200, body=b'{"a": 1}', headers=[("content-type", "application/json")])
    assert (ok.id, ok.status_code, ok.ok, ok.error, ok.skipped) == ("s", 200, True, None, False)
    assert ok.body == '{"a": 1}' and ok.content == b'{"a": 1}' and ok.json() == {"a": 1}
    assert ok.headers == {"content-type": "application/json"}
    failed = StepResult("t", status_code=500, error="boom")
    assert (failed.ok, failed.error) == (False, "failed: boom")

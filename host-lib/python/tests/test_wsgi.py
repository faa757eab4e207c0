"""The WSGI side: what a Flask app sees of a request from the data path, and how
`python -m dpumesh.server` finds the app."""

import pytest
from flask import Flask, request

from dpumesh.server import load
from dpumesh.testing import TestMesh
from dpumesh.wsgi import environ_for


def test_the_environ_follows_pep_3333():
    env = environ_for(
        "POST",
        "/caf%C3%A9/a%2Fb?q=1&r=%20",
        [
            ("host", "frontend:8080"),
            ("content-type", "application/json"),
            ("content-length", "999"),
            ("accept", "text/html"),
            ("accept", "application/json"),
            ("cookie", "a=1"),
            ("cookie", "b=2"),
            ("x_spoofed", "1"),
            ("x-forwarded-for", "10.0.0.7, 10.0.0.1"),
            ("x-forwarded-proto", "https"),
        ],
        b"{}",
        "frontend",
        ("http", "192.0.2.44", 51000, None),
    )
    # The decoded path as latin-1 code points of its UTF-8 bytes; the query raw.
    assert env["PATH_INFO"] == "/café/a/b".encode("utf-8").decode("latin-1")
    assert env["QUERY_STRING"] == "q=1&r=%20"
    assert env["RAW_URI"] == "/caf%C3%A9/a%2Fb?q=1&r=%20"
    assert (env["SERVER_NAME"], env["SERVER_PORT"]) == ("frontend", "8080")
    assert env["CONTENT_TYPE"] == "application/json"
    # The length of the body that arrived, not the header's claim.
    assert env["CONTENT_LENGTH"] == "2"
    assert env["HTTP_ACCEPT"] == "text/html, application/json"
    assert env["HTTP_COOKIE"] == "a=1; b=2"
    assert "HTTP_X_SPOOFED" not in env, "a header with _ could pose as one with -"
    # Who called and how is the mesh's word, not the forwarded headers' (a client's).
    assert (env["REMOTE_ADDR"], env["REMOTE_PORT"]) == ("192.0.2.44", "51000")
    assert env["wsgi.url_scheme"] == "http"
    assert env["dpumesh.caller_identity"] is None
    assert env["wsgi.input"].read() == b"{}"


def test_a_call_from_a_pod_names_its_workload():
    env = environ_for(
        "GET", "/", [], b"", "user", ("http", "127.0.0.1", 0, "spiffe://hotel/svc/frontend")
    )
    assert env["dpumesh.caller_identity"] == "spiffe://hotel/svc/frontend"


def test_flask_reads_args_headers_and_body_and_answers_with_headers():
    app = Flask(__name__)

    @app.route("/items/<int:n>", methods=["PUT"])
    def put(n):
        return {
            "n": n,
            "q": request.args.getlist("q"),
            "agent": request.headers.get("User-Agent"),
            "json": request.get_json(),
        }, 202, {"x-item": str(n)}

    r = TestMesh(app).request(
        "PUT",
        "/items/7?q=a&q=b",
        headers={"user-agent": "pytest", "content-type": "application/json"},
        body='{"k": [1, 2]}',
    )
    assert r.status == 202
    assert r.headers["x-item"] == "7"
    assert r.json() == {"n": 7, "q": ["a", "b"], "agent": "pytest", "json": {"k": [1, 2]}}


def test_a_bare_wsgi_app_works_too():
    def app(environ, start_response):
        start_response("418 I'm a teapot", [("x-kind", "bare")])
        return [b"short ", b"and stout"]

    r = TestMesh(app).get("/")
    assert (r.status, r.headers["x-kind"], r.text) == (418, "bare", "short and stout")


def test_a_generator_response_streams_and_a_sized_one_comes_whole():
    from dpumesh.wsgi import call_wsgi
    from flask import Response

    app = Flask(__name__)
    closed = []

    @app.route("/events")
    def events():
        def gen():
            try:
                for i in range(3):
                    yield f"data: {i}\n\n"
            finally:
                closed.append(True)

        return Response(gen(), mimetype="text/event-stream")

    @app.route("/whole")
    def whole():
        return "all at once"

    env = environ_for("GET", "/events", [], b"", "svc", None)
    status, headers, first, rest = call_wsgi(app, env)
    assert (status, first) == (200, b"data: 0\n\n")
    assert rest is not None, "a generator without a length streams"
    assert list(rest) == [b"data: 1\n\n", b"data: 2\n\n"]
    assert closed == [True], "the app's generator is closed at the end"

    # Dropped mid-stream (the client left): the app's generator is closed too.
    closed.clear()
    _, _, _, rest = call_wsgi(app, environ_for("GET", "/events", [], b"", "svc", None))
    rest.close()
    assert closed == [True]

    _, _, body, rest = call_wsgi(app, environ_for("GET", "/whole", [], b"", "svc", None))
    assert (body, rest) == (b"all at once", None), "a response with its length is whole"

    # Through the service loop: the streamed parts arrive as one body.
    r = TestMesh(app).get("/events")
    assert (r.status, r.text) == (200, "data: 0\n\ndata: 1\n\ndata: 2\n\n")
    assert r.headers["content-type"].startswith("text/event-stream")


def test_the_server_loads_module_colon_attribute_and_says_what_is_wrong(tmp_path):
    (tmp_path / "svc.py").write_text("def app(environ, start_response):\n    pass\nnot_an_app = 3\n")
    assert load("svc:app", str(tmp_path)).__name__ == "app"
    with pytest.raises(SystemExit, match="cannot import 'nosuch'"):
        load("nosuch:app", str(tmp_path))
    with pytest.raises(SystemExit, match="svc has no 'missing'"):
        load("svc:missing", str(tmp_path))
    with pytest.raises(SystemExit, match="is not a WSGI app"):
        load("svc:not_an_app", str(tmp_path))

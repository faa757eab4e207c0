"""The ASGI side: what a FastAPI app sees of a request from the data path, its
lifespan, and what it answers, served by the same event loop as a WSGI app."""

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse

from dpumesh.asgi import scope_for
from dpumesh.server import load
from dpumesh.testing import TestMesh


def test_the_scope_follows_the_asgi_spec_and_believes_the_mesh_only():
    scope = scope_for(
        "POST",
        "/caf%C3%A9/x?q=1&r=%20",
        [
            ("host", "frontend:8080"),
            ("content-length", "999"),
            ("x-forwarded-for", "10.0.0.7"),
            ("x-forwarded-proto", "https"),
        ],
        b"{}",
        "frontend",
        ("http", "192.0.2.44", 51000, "spiffe://hotel/ns/default/sa/user"),
    )
    assert scope["type"] == "http" and scope["asgi"]["version"] == "3.0"
    assert scope["path"] == "/café/x"
    assert scope["raw_path"] == b"/caf%C3%A9/x"
    assert scope["query_string"] == b"q=1&r=%20"
    assert scope["server"] == ("frontend", 8080)
    # Who called and how is the mesh's word, not the forwarded headers' (a client's).
    assert scope["client"] == ("192.0.2.44", 51000)
    assert scope["scheme"] == "http"
    assert scope["extensions"]["dpumesh"]["caller_identity"] == "spiffe://hotel/ns/default/sa/user"
    # The length of the body that arrived, not the header's claim.
    lengths = [v for k, v in scope["headers"] if k == b"content-length"]
    assert lengths == [b"2"]


def test_fastapi_reads_the_request_and_answers_with_status_headers_and_body():
    events = []
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        events.append("startup")
        yield {"greeting": "hello"}
        events.append("shutdown")

    app = FastAPI(lifespan=lifespan)

    @app.put("/items/{n}")
    async def put(n: int, request: Request):
        body = await request.json()
        return PlainTextResponse(
            f"{request.state.greeting} {n} {request.query_params.getlist('q')} {body['k']} "
            f"{request.headers['user-agent']} {request.client}",
            status_code=202,
            headers={"x-item": str(n)},
        )

    @app.get("/stream")
    async def stream():
        async def chunks():
            for part in (b"a", b"b", b"c"):
                yield part

        return StreamingResponse(chunks(), media_type="text/plain")

    @app.get("/boom")
    async def boom():
        raise ValueError("no luck")

    with TestMesh(app, asgi=True) as mesh:
        assert events == ["startup"]
        r = mesh.request(
            "PUT",
            "/items/7?q=a&q=b",
            headers={"user-agent": "pytest", "content-type": "application/json"},
            body='{"k": [1, 2]}',
        )
        assert r.status == 202, r.text
        assert r.headers["x-item"] == "7"
        assert r.text.startswith("hello 7 ['a', 'b'] [1, 2] pytest")
        r = mesh.get("/stream")
        assert (r.status, r.text) == (200, "abc")
        r = mesh.get("/nowhere")
        assert r.status == 404
        r = mesh.get("/boom")
        assert r.status == 500
        assert "ValueError" in r.text or "Internal" in r.text
    assert events == ["startup", "shutdown"]


def test_an_app_without_lifespan_is_served_and_a_bare_one_works():
    async def app(scope, receive, send):
        if scope["type"] != "http":
            raise RuntimeError("http only")
        message = await receive()
        await send({"type": "http.response.start", "status": 418, "headers": [(b"x-kind", b"bare")]})
        await send({"type": "http.response.body", "body": b"short ", "more_body": True})
        await send({"type": "http.response.body", "body": message["body"]})

    with TestMesh(app, asgi=True) as mesh:
        r = mesh.request("POST", "/", body="and stout")
        assert (r.status, r.headers["x-kind"], r.text) == (418, "bare", "short and stout")


def test_an_app_that_never_starts_its_response_gets_a_clear_500():
    async def app(scope, receive, send):
        if scope["type"] == "http":
            return

    with TestMesh(app, asgi=True) as mesh:
        r = mesh.get("/")
        assert r.status == 500
        assert "without http.response.start" in r.text


def test_the_server_says_which_kind_of_app_it_wanted(tmp_path):
    (tmp_path / "asvc.py").write_text("not_an_app = 3\n")
    with pytest.raises(SystemExit, match="is not a ASGI app|is not an ASGI app"):
        load("asvc:not_an_app", str(tmp_path), "ASGI")

"""A request from the data path handed to an ASGI app (FastAPI, Starlette), and what
the app answered: ``python -m dpumesh.server --asgi app:app``.

The server runs each request as a task of its own on one asyncio loop that also
drives the service's event loop (:mod:`dpumesh.asgi_serve`): requests are served
concurrently, streamed answers stream. Here are the scope, the lifespan (``startup``
before the first request, ``shutdown`` when the server stops) and the dispatcher that
``TestMesh(app, asgi=True)`` uses, which runs one request at a time to its end (the
request arrived whole; the answer is collected whole) on the virtual clock; there a
handler may still use ``get_context()`` to schedule a graph, as a WSGI handler does.
An app that calls other services uses :func:`call`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Optional
from urllib.parse import unquote_to_bytes

from .context import ExecutionContext, current
from .wsgi import split_host

__all__ = ["AsgiDispatcher", "call", "scope_for"]

log = logging.getLogger("dpumesh")

_TEXT = [("content-type", "text/plain; charset=utf-8")]


async def call(method: str, url: str, *, headers: Optional[dict] = None, body: Any = None) -> Any:
    """Calls another service through the mesh, as this service: ``await
    call("GET", "http://user/me")`` gives a result with ``status``, ``headers``,
    ``body``, ``text`` and ``json()``, or raises ``MeshCallError`` when no answer came.
    Only while ``python -m dpumesh.server --asgi`` serves the app."""
    from .asgi_serve import call as mesh_call

    return await mesh_call(method, url, headers=headers, body=body)


def scope_for(
    method: str,
    target: str,
    headers: list,
    body: bytes,
    server: str,
    caller: Optional[tuple] = None,
    state: Optional[dict] = None,
) -> dict:
    """The ASGI HTTP scope (spec 2.3) of a request: ``target`` is the path and query,
    ``headers`` ``(name, value)`` pairs with lower-case names, ``caller``
    ``(scheme, address, port, identity)`` as the mesh says it.

    ``client`` and ``scheme`` come from the mesh, never from ``X-Forwarded-For`` or
    ``X-Forwarded-Proto``; ``content-length`` is the body's own length when it arrived
    whole (``body`` is bytes), the client's when it streams (the ingress framed the
    body by it: one that does not match is cut, and the app sees a disconnect); ``extensions["dpumesh"]["caller_identity"]`` is the calling workload's
    SPIFFE ID when a pod of the mesh called."""
    path, _, query = target.partition("?")
    whole = isinstance(body, (bytes, bytearray))
    raw_headers = [
        (name.encode("latin-1"), value.encode("latin-1"))
        for name, value in headers
        if name != "content-length" or not whole
    ]
    if whole:
        raw_headers.append((b"content-length", str(len(body)).encode()))
    host, port = server, 80
    for name, value in headers:
        if name == "host":
            host, p = split_host(value)
            port = int(p) if p.isdigit() else 80
            break
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        # The decoded path as text (UTF-8, as uvicorn decodes it); the raw one beside.
        "path": unquote_to_bytes(path).decode("utf-8", "replace"),
        "raw_path": path.encode("latin-1", "replace"),
        "query_string": query.encode("latin-1", "replace"),
        "root_path": "",
        "headers": raw_headers,
        "client": None,
        "server": (host, port),
        "extensions": {"dpumesh": {"caller_identity": None}},
    }
    if state is not None:
        scope["state"] = dict(state)
    if caller is not None:
        scheme, address, cport, identity = caller
        scope["scheme"] = "https" if scheme == "https" else "http"
        scope["client"] = (address, int(cport))
        scope["extensions"]["dpumesh"]["caller_identity"] = identity
    return scope


class _Exchange:
    """``receive`` and ``send`` of one request: the body given at once, the answer
    collected."""

    __slots__ = ("body", "given", "status", "headers", "chunks", "done")

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.given = False
        self.status: Optional[int] = None
        self.headers: list = []
        self.chunks: list = []
        self.done = False

    async def receive(self) -> dict:
        if not self.given:
            self.given = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        # The whole request was given; after the answer the client is gone.
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        kind = message.get("type")
        if kind == "http.response.start":
            if self.status is not None:
                raise RuntimeError("the ASGI app started its response twice")
            self.status = int(message["status"])
            self.headers = [
                (_text(k).lower(), _text(v)) for k, v in message.get("headers", [])
            ]
        elif kind == "http.response.body":
            if self.status is None:
                raise RuntimeError("the ASGI app sent a body before http.response.start")
            if self.done:
                raise RuntimeError("the ASGI app sent a body after its last one")
            chunk = message.get("body", b"")
            if chunk:
                self.chunks.append(bytes(chunk))
            self.done = not message.get("more_body", False)
        else:
            raise RuntimeError(f"the ASGI app sent {kind!r} on an HTTP request")


def _text(v: Any) -> str:
    return v.decode("latin-1") if isinstance(v, (bytes, bytearray)) else str(v)


class AsgiDispatcher:
    """Calls the ASGI app for each request the event loop receives.

    Returns ``(status, headers, body)`` to answer at once, or a list of graph nodes
    (the handler used ``get_context()``) for the loop to run."""

    def __init__(self, app: Callable[..., Any], service: str) -> None:
        self.app = app
        self.service = service
        self.loop = asyncio.new_event_loop()
        self.state: dict = {}
        self._lifespan: Optional[asyncio.Task] = None
        self._events: Optional[asyncio.Queue] = None
        self._startup()

    def _startup(self) -> None:
        """Runs the app's lifespan startup; an app without lifespan support is served
        without it (as uvicorn's ``lifespan: auto``); a failed startup is an error."""
        self._events = asyncio.Queue()
        replies: asyncio.Queue = asyncio.Queue()

        async def receive() -> dict:
            return await self._events.get()

        async def send(message: dict) -> None:
            await replies.put(message)

        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": self.state}

        async def run() -> None:
            try:
                await self.app(scope, receive, send)
            except Exception as e:  # no lifespan support: the app raises on the scope
                await replies.put({"type": "lifespan.unsupported", "error": e})
            else:
                # Returned without a word (as uvicorn reads it: startup is over); after
                # a real startup this reply is never read.
                await replies.put({"type": "lifespan.unsupported", "error": "it returned"})

        async def start() -> dict:
            self._lifespan = asyncio.ensure_future(run())
            await self._events.put({"type": "lifespan.startup"})
            return await replies.get()

        reply = self.loop.run_until_complete(start())
        if reply["type"] == "lifespan.startup.failed":
            raise RuntimeError(f"the ASGI app's startup failed: {reply.get('message', '')}")
        if reply["type"] == "lifespan.unsupported":
            log.info("the ASGI app has no lifespan: served without it (%s)", reply["error"])
            self._lifespan = None

    def close(self) -> None:
        """Runs the app's lifespan shutdown and closes the loop."""
        if self._lifespan is not None and not self._lifespan.done():

            async def stop() -> None:
                await self._events.put({"type": "lifespan.shutdown"})
                try:
                    await asyncio.wait_for(self._lifespan, 10)
                except (asyncio.TimeoutError, Exception):
                    log.warning("the ASGI app's shutdown did not finish", exc_info=True)

            self.loop.run_until_complete(stop())
        self._lifespan = None
        if not self.loop.is_closed():
            self.loop.close()

    def __call__(
        self, method: str, target: str, headers: list, body: bytes, caller: Optional[tuple] = None
    ) -> Any:
        ctx = ExecutionContext()
        scope = scope_for(method, target, headers, body, self.service, caller, self.state)
        exchange = _Exchange(body)
        with current(ctx):
            try:
                self.loop.run_until_complete(self.app(scope, exchange.receive, exchange.send))
            except Exception as e:
                log.error("ASGI app (%s %s) raised", method, target, exc_info=True)
                if exchange.status is None:
                    text = f"the ASGI app raised {type(e).__name__}: {e}\n"
                    return (500, _TEXT, text.encode("utf-8", "replace"))
        if exchange.status is None:
            text = "the ASGI app returned without http.response.start\n"
            log.error("%s (%s %s)", text.strip(), method, target)
            return (500, _TEXT, text.encode())
        out_body = b"".join(exchange.chunks)
        if not ctx.used:
            return (exchange.status, exchange.headers, out_body)
        if out_body:
            text = (
                "the ASGI handler scheduled steps and also returned a response body; "
                "return an empty response to answer with the graph's result\n"
            )
            log.error("%s", text.strip())
            return (500, _TEXT, text.encode("utf-8", "replace"))
        return ctx.graph()

"""A request from the data path handed to a WSGI app (Flask or any other), and what the
app answered: a response served as is, or the graph its handler scheduled.

The app runs on the service's event-loop thread, as the seed's server does: a handler
only builds its graph and returns; work that takes time goes in ``run_internal``.
"""

from __future__ import annotations

import io
import logging
import sys
from typing import Any, Callable, Optional
from urllib.parse import unquote_to_bytes

from .context import ExecutionContext, current

__all__ = ["Dispatcher", "environ_for"]

log = logging.getLogger("dpumesh")

_TEXT = [("content-type", "text/plain; charset=utf-8")]


def environ_for(
    method: str,
    target: str,
    headers: list,
    body: bytes,
    server: str,
    caller: Optional[tuple] = None,
) -> dict:
    """The WSGI environ (PEP 3333) of a request: ``target`` is the path and query,
    ``headers`` ``(name, value)`` pairs with lower-case names, ``caller``
    ``(scheme, address, port, identity)`` as the mesh says it.

    ``REMOTE_ADDR``, ``REMOTE_PORT`` and ``wsgi.url_scheme`` come from the mesh, never
    from ``X-Forwarded-For`` or ``X-Forwarded-Proto`` (a client's word, which the
    ingress passes on after its own hop); ``dpumesh.caller_identity`` is the calling
    workload's SPIFFE ID when a pod of the mesh called."""
    path, _, query = target.partition("?")
    environ = {
        "REQUEST_METHOD": method,
        "SCRIPT_NAME": "",
        # PEP 3333: the decoded path as latin-1 code points of its bytes (a plain
        # ASCII path, the usual case, is that already).
        "PATH_INFO": path
        if path.isascii() and "%" not in path
        else unquote_to_bytes(path).decode("latin-1"),
        "QUERY_STRING": query,
        "RAW_URI": target,
        "REQUEST_URI": target,
        "SERVER_NAME": server,
        "SERVER_PORT": "80",
        "SERVER_PROTOCOL": "HTTP/1.1",
        "REMOTE_ADDR": "",
        "CONTENT_LENGTH": str(len(body)),
        "wsgi.version": (1, 0),
        "wsgi.url_scheme": "http",
        "wsgi.input": io.BytesIO(body),
        "wsgi.errors": sys.stderr,
        "wsgi.multithread": False,
        "wsgi.multiprocess": False,
        "wsgi.run_once": False,
    }
    for name, value in headers:
        if name == "content-type":
            environ["CONTENT_TYPE"] = value
            continue
        if name == "content-length":
            continue  # the body arrived whole; its length is what counts
        if "_" in name:
            # As gunicorn and nginx do: `x_user` would land on the same key as
            # `x-user`, a way to spoof a header the mesh set.
            continue
        key = "HTTP_" + name.upper().replace("-", "_")
        if key in environ:
            environ[key] += ("; " if key == "HTTP_COOKIE" else ", ") + value
        else:
            environ[key] = value
    host = environ.get("HTTP_HOST")
    if host:
        name, port = split_host(host)
        environ["SERVER_NAME"] = name
        if port.isdigit():
            environ["SERVER_PORT"] = port
    if caller is not None:
        scheme, address, port, identity = caller
        environ["wsgi.url_scheme"] = "https" if scheme == "https" else "http"
        environ["REMOTE_ADDR"] = address
        environ["REMOTE_PORT"] = str(port)
        environ["dpumesh.caller_identity"] = identity
    return environ


def split_host(host: str) -> tuple:
    """``Host`` as (name, port text): ``[::1]:8080`` → (``[::1]``, ``8080``); without a
    port, the port is ``""``."""
    name, _, port = host.rpartition(":") if host.rfind(":") > host.rfind("]") else (host, "", "")
    return (name or host, port)


class _Start:
    """``start_response``: keeps the status and headers; ``write`` appends."""

    __slots__ = ("status", "headers", "chunks")

    def __init__(self) -> None:
        self.status: Optional[str] = None
        self.headers: list = []
        self.chunks: list = []

    def __call__(self, status: str, headers: list, exc_info: Any = None) -> Callable[[bytes], None]:
        if exc_info is not None and self.status is not None and self.chunks:
            raise exc_info[1].with_traceback(exc_info[2])
        self.status = status
        self.headers = headers
        return self.chunks.append


def call_wsgi(app: Callable[..., Any], environ: dict) -> tuple:
    """Runs ``app``: ``(status, [(name, value)], body bytes, rest)``.

    ``rest`` is ``None`` when the body is whole: the app returned a list or tuple, or
    said its length (``Content-Length``). Otherwise (a generator: server-sent events, a
    large download) ``body`` is the first part and ``rest`` a generator of the parts
    that follow, which the mesh streams as they come and closes when the client
    leaves."""
    start = _Start()
    result = app(environ, start)
    if isinstance(result, (list, tuple)):
        try:
            start.chunks.extend(c for c in result if c)
        finally:
            _close(result)
        return _whole(start, None)
    it = iter(result)
    try:
        # The first part (start_response may be called only now, by a generator).
        for chunk in it:
            if chunk:
                start.chunks.append(chunk)
                break
        else:
            _close(result)
            return _whole(start, None)
        if any(n.lower() == "content-length" for n, _ in start.headers):
            for chunk in it:
                if chunk:
                    start.chunks.append(chunk)
            _close(result)
            return _whole(start, None)
    except BaseException:
        _close(result)
        raise
    return _whole(start, _rest(it, result))


def _close(result: Any) -> None:
    close = getattr(result, "close", None)
    if close is not None:
        close()


def _rest(it: Any, result: Any) -> Any:
    """The parts after the first; closing it (the client left) closes the app's."""
    try:
        for chunk in it:
            if chunk:
                yield bytes(chunk)
    finally:
        _close(result)


def _whole(start: _Start, rest: Any) -> tuple:
    if start.status is None:
        if rest is not None:
            rest.close()
        raise RuntimeError("the WSGI app returned without calling start_response")
    status = int(start.status.split(" ", 1)[0])
    return status, list(start.headers), b"".join(start.chunks), rest


class Dispatcher:
    """Calls the app for each request the event loop receives.

    Returns ``(status, headers, body)`` to answer at once, or a list of graph nodes
    (the handler used ``get_context()``) for the loop to run."""

    def __init__(self, app: Callable[..., Any], service: str) -> None:
        self.app = app
        self.service = service
        config = getattr(app, "config", None)
        if config is not None and config.get("PROPAGATE_EXCEPTIONS") is None:
            # Flask would answer an unhandled exception with a page that names nothing;
            # raised to here, the answer names the handler. The app's own error
            # handlers still run first.
            config["PROPAGATE_EXCEPTIONS"] = True

    def __call__(
        self, method: str, target: str, headers: list, body: bytes, caller: Optional[tuple] = None
    ) -> Any:
        ctx = ExecutionContext()
        environ = environ_for(method, target, headers, body, self.service, caller)
        with current(ctx):
            try:
                status, out_headers, out_body, rest = call_wsgi(self.app, environ)
            except Exception as e:
                name = self.handler_name(environ)
                log.error("handler %s (%s %s) raised", name, method, target, exc_info=True)
                text = f"handler {name} raised {type(e).__name__}: {e}\n"
                return (500, _TEXT, text.encode("utf-8", "replace"))
        if not ctx.used:
            if rest is not None:
                # Streamed: the first part now, the rest as the generator makes it.
                return (status, out_headers, out_body, rest)
            return (status, out_headers, out_body)
        if rest is not None:
            rest.close()
        if out_body or rest is not None:
            name = self.handler_name(environ)
            text = (
                f"handler {name} scheduled steps and also returned a response body; "
                "return \"\" to answer with the graph's result\n"
            )
            log.error("%s", text.strip())
            return (500, _TEXT, text.encode("utf-8", "replace"))
        return ctx.graph()

    def handler_name(self, environ: dict) -> str:
        """The view function serving ``environ`` (Flask), else the path."""
        url_map = getattr(self.app, "url_map", None)
        views = getattr(self.app, "view_functions", None)
        if url_map is not None and views is not None:
            try:
                endpoint, _ = url_map.bind_to_environ(environ).match()
                view = views.get(endpoint)
                if view is not None:
                    return f"{view.__module__}.{view.__qualname__}"
                return repr(endpoint)
            except Exception:
                pass
        return repr(environ.get("PATH_INFO", "?"))

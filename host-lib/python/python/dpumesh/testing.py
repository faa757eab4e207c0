"""Runs a WSGI app (Flask) on the Rust event loop over an in-memory transport with a
virtual clock, for tests: upstream services are Python functions with a latency, and
a test asserts concurrency from the clock (two 10 ms calls in parallel finish at
10 ms, one after the other at 20 ms), however fast the machine is.

::

    mesh = TestMesh(app, services={"user": lambda req: (200, '{"id": 1}', 10)})
    response = mesh.get("/profile")
    assert response.status == 200 and response.elapsed_ms == 10
"""

from __future__ import annotations

import atexit
import weakref
from typing import Any, Callable, Mapping, Optional

from . import _native
from .asgi import AsgiDispatcher
from .wsgi import Dispatcher

__all__ = ["TestMesh", "Response", "Request"]

# Meshes still open: their pool threads must end before the interpreter finalizes.
_open: "weakref.WeakSet[TestMesh]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for mesh in list(_open):
        mesh.close()


class Request:
    """What an upstream service function receives."""

    __slots__ = ("method", "url", "headers", "body")

    def __init__(self, method: str, url: str, headers: list, body: bytes) -> None:
        self.method = method
        self.url = url
        self.headers = dict(headers)
        self.body = body

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def __repr__(self) -> str:
        return f"Request({self.method} {self.url})"


class Response:
    """The answer to a request, and when it came (virtual milliseconds)."""

    __slots__ = ("status", "headers", "body", "elapsed_ms")

    def __init__(self, status: int, headers: list, body: bytes, elapsed_ms: float) -> None:
        self.status = status
        self.headers = dict(headers)
        self.body = body
        self.elapsed_ms = elapsed_ms

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def json(self) -> Any:
        import json

        return json.loads(self.body)

    def __repr__(self) -> str:
        return f"Response({self.status}, {self.text[:60]!r}, {self.elapsed_ms} ms)"


def _service(func: Callable[..., Any]) -> Callable[..., Any]:
    """Adapts ``func(request)`` returning ``(status, body[, latency_ms])`` (or ``None``:
    never answers) to what the native side expects."""

    def call(method: str, url: str, headers: list, body: bytes) -> Any:
        reply = func(Request(method, url, headers, body))
        if reply is None:
            return None
        if not isinstance(reply, tuple) or not 2 <= len(reply) <= 3:
            raise TypeError("a test service returns (status, body[, latency_ms]) or None")
        status, data = reply[0], reply[1]
        latency = reply[2] if len(reply) == 3 else 0
        if isinstance(data, str):
            data = data.encode("utf-8")
        return (int(status), bytes(data), float(latency))

    return call


class TestMesh:
    """``app`` served by the event loop; ``services`` maps a host name (the URL host
    egress calls name) to its function (or to a str: a 200 with that body at once).
    ``record=False`` keeps no log of sent requests (benchmarks)."""

    __test__ = False  # not a pytest test class

    def __init__(
        self,
        app: Callable[..., Any],
        services: Optional[Mapping[str, Callable[..., Any]]] = None,
        *,
        service: str = "app",
        threads: int = 2,
        record: bool = True,
        asgi: bool = False,
    ) -> None:
        # A str is a fixed 200 answer given by the Rust side (no Python per call).
        wrapped = {
            host: f if isinstance(f, str) else _service(f) for host, f in (services or {}).items()
        }
        self._asgi = AsgiDispatcher(app, service) if asgi else None
        dispatcher = self._asgi or Dispatcher(app, service)
        self._mesh = _native.TestMesh(dispatcher, wrapped, threads, record)
        _open.add(self)

    def close(self) -> None:
        """Ends the mesh's threads (after the steps they run), and an ASGI app's
        lifespan."""
        self._mesh.close()
        if self._asgi is not None:
            self._asgi.close()
            self._asgi = None
        _open.discard(self)

    def __del__(self) -> None:
        mesh = getattr(self, "_mesh", None)
        if mesh is not None:
            mesh.close()

    def __enter__(self) -> "TestMesh":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def request(
        self,
        method: str,
        target: str,
        *,
        headers: Optional[Mapping[str, str]] = None,
        body: Any = b"",
    ) -> Response:
        """Sends one request and runs the loop until it is answered."""
        if isinstance(body, str):
            body = body.encode("utf-8")
        status, out_headers, out_body, elapsed = self._mesh.request(
            method, target, list((headers or {}).items()), bytes(body)
        )
        return Response(status, out_headers, out_body, elapsed)

    def get(self, target: str, **kw: Any) -> Response:
        return self.request("GET", target, **kw)

    def post(self, target: str, body: Any = b"", **kw: Any) -> Response:
        return self.request("POST", target, body=body, **kw)

    def run_batch(self, target: str, n: int) -> float:
        """Runs ``n`` GETs of ``target`` (up to 1000 in flight at once); wall
        nanoseconds per request."""
        return self._mesh.run_batch(target, n)

    @property
    def sent(self) -> list:
        """Egress requests the app sent: ``(at_ms, method, url)``, in order."""
        return self._mesh.sent()

"""An ASGI app served concurrently on the mesh: ``python -m dpumesh.server --asgi``.

One thread runs an asyncio loop, and that loop drives the service's Rust event loop
(``_native.Reactor``): the pod's bell (an eventfd the node rings) is in asyncio's
selector beside the app's own sockets, and a driver task turns the Rust loop when it
rings, when one of its timers is due, or when a request was answered. Each request
is a task of its own, so a handler that awaits (a timer, a database, a call to
another service with :func:`call`) lets the others run, as under uvicorn.

- **Answers.** A response goes whole when the app's first body message is its last;
  otherwise its head leaves with the first part and the rest streams as the app sends
  it (``StreamingResponse``, server-sent events). Four parts wait at most: past that
  the app's ``send`` waits for its client (back-pressure), off the loop's thread.
- **Request bodies.** A body the node sends whole is given in one
  ``http.request``; an upload it sends in parts (any size) comes part by part as it
  arrives, the client slowed to the app's pace.
- **Disconnects.** ``receive()`` gives the body, then waits: it returns
  ``http.disconnect`` once the answer is complete, once a streamed body's client has
  gone (its next part finds no reader), or when the server stops. Later ``send`` calls
  are then ignored, as uvicorn does.
- **Calls.** ``await call("GET", "http://user/me")`` calls another service through
  the mesh, as this service (the node knows the pod).
- **Stopping.** SIGINT or SIGTERM stops taking turns once the requests in flight are
  answered (at most five seconds), then runs the lifespan's shutdown.
"""

from __future__ import annotations

import asyncio
import json as _json
import logging
import signal
from typing import Any, Callable, Optional

from . import _native
from . import context as _context
from .asgi import AsgiDispatcher, _text, scope_for

__all__ = ["ConcurrentDispatcher", "MeshCallError", "CallResult", "call"]

log = logging.getLogger("dpumesh")

_TEXT = [("content-type", "text/plain; charset=utf-8")]
#: How long stopping waits for the requests in flight.
_DRAIN = 5.0
#: The one reactor of this process, while it serves (for :func:`call`).
_serving: Optional["ConcurrentDispatcher"] = None


class MeshCallError(Exception):
    """A call through the mesh got no answer (no such service, the node refused it,
    its deadline passed): the reason the mesh gave."""


class CallResult:
    """The answer to :func:`call`: ``status``, ``headers`` (lower-case names),
    ``body`` (bytes), ``text`` and ``json()``."""

    __slots__ = ("status", "headers", "body")

    def __init__(self, status: int, headers: list, body: bytes) -> None:
        self.status = status
        self.headers = dict(headers)
        self.body = body

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def json(self) -> Any:
        return _json.loads(self.body)

    def __repr__(self) -> str:
        return f"CallResult({self.status}, {self.text[:60]!r})"


async def call(
    method: str,
    url: str,
    *,
    headers: Optional[dict] = None,
    body: Any = None,
) -> CallResult:
    """Calls another service through the mesh (``url`` names it:
    ``http://user/me``) and returns its answer, of any status. Raises
    :class:`MeshCallError` when there is none."""
    dispatcher = _serving
    if dispatcher is None:
        raise RuntimeError(
            "dpumesh.asgi.call() works while `python -m dpumesh.server --asgi` serves "
            "the app (TestMesh serves one request at a time and cannot wait for a call)"
        )
    return await dispatcher.call(method, url, headers or {}, body)


class _Exchange:
    """``receive`` and ``send`` of one request, answered through its ``Reply``."""

    __slots__ = (
        "body", "streamed", "reader", "readable", "given", "reply", "dispatcher", "status", "headers",
        "started", "ended", "gone",
    )

    def __init__(self, body: Any, reply: Any, dispatcher: "ConcurrentDispatcher") -> None:
        # Bytes (the body came whole), or a BodyReader (it streams).
        whole = isinstance(body, (bytes, bytearray))
        self.body = body if whole else b""
        self.streamed = not whole
        self.reader = None if whole else body
        self.readable: Optional[asyncio.Event] = None
        self.given = False
        self.reply = reply
        self.dispatcher = dispatcher
        self.status: Optional[int] = None
        self.headers: list = []
        # The head went to the mesh (with the first part); the last part went.
        self.started = False
        self.ended = False
        self.gone = dispatcher.loop.create_future()

    def leave(self) -> None:
        """The request is over for the app: ``receive`` says disconnected, and a body
        still streaming in is not wanted any more."""
        if not self.gone.done():
            self.gone.set_result(None)
        if self.reader is not None:
            self.reader.close()
            self.reader = None
            if self.readable is not None:
                self.readable.set()  # a reader waiting for a part sees the end

    async def receive(self) -> dict:
        if not self.given:
            if self.streamed:
                message = await self._read()
                self.given = message["type"] == "http.disconnect" or not message["more_body"]
                return message
            self.given = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.gone
        return {"type": "http.disconnect"}

    async def _read(self) -> dict:
        """The streamed body's next part, as it arrives."""
        loop = self.dispatcher.loop
        if self.readable is None:
            self.readable = asyncio.Event()
        readable = self.readable
        wake = lambda: loop.call_soon_threadsafe(readable.set)  # noqa: E731 (any thread)
        while True:
            if self.reader is None:
                # Closed before its end: the request is over.
                return {"type": "http.disconnect"}
            readable.clear()
            try:
                part = self.reader.poll(wake)
            except ConnectionError:
                # Cut: the client left or the mesh aborted it.
                self.reader = None
                self.leave()
                return {"type": "http.disconnect"}
            if part is None:
                self.reader = None
                return {"type": "http.request", "body": b"", "more_body": False}
            if part is False:
                await readable.wait()
                continue
            # Reading frees the pod's slots: the client sends on at the app's pace.
            self.dispatcher.kick()
            return {"type": "http.request", "body": part, "more_body": True}

    async def send(self, message: dict) -> None:
        kind = message.get("type")
        if kind == "http.response.start":
            if self.status is not None:
                raise RuntimeError("the ASGI app started its response twice")
            self.status = int(message["status"])
            self.headers = [(_text(k).lower(), _text(v)) for k, v in message.get("headers", [])]
            return
        if kind != "http.response.body":
            raise RuntimeError(f"the ASGI app sent {kind!r} on an HTTP request")
        if self.status is None:
            raise RuntimeError("the ASGI app sent a body before http.response.start")
        if self.ended:
            raise RuntimeError("the ASGI app sent a body after its last one")
        body = bytes(message.get("body", b""))
        more = bool(message.get("more_body", False))
        self.ended = not more
        if self.gone.done():
            return  # the client left: ignored, as uvicorn does
        if not self.started:
            # Raises on a header HTTP does not allow: the app's error, answered 500.
            sent = self.reply.start(self.status, self.headers, body, more)
            self.started = True
        else:
            outcome = self.reply.send(body, more)
            if outcome == "full":
                # Back-pressure: the client reads slower than the app writes. The wait
                # is off the loop's thread, so the other requests go on meanwhile.
                sent = await self.dispatcher.loop.run_in_executor(
                    None, self.reply.send_blocking, body, more
                )
            else:
                sent = outcome == "sent"
        self.dispatcher.kick()
        if not sent or self.ended:
            self.leave()

    def finish(self, method: str, target: str) -> None:
        """After the app returned: what it left unsaid is said."""
        if not self.started and self.gone.done():
            return  # the request is gone: nobody to answer
        if self.status is None:
            text = "the ASGI app returned without http.response.start\n"
            log.error("%s (%s %s)", text.strip(), method, target)
            self.reply.start(500, _TEXT, text.encode(), False)
        elif not self.started:
            self.reply.start(self.status, self.headers, b"", False)
        elif not self.ended:
            self.reply.send(b"", False)  # the body ends where the app stopped
        self.dispatcher.kick()
        self.leave()


class ConcurrentDispatcher(AsgiDispatcher):
    """Serves an ASGI app concurrently on the mesh (see the module's text)."""

    def __init__(self, app: Callable[..., Any], service: str) -> None:
        super().__init__(app, service)
        self._reactor: Any = None
        self._tasks: set = set()
        self._kick: Optional[asyncio.Event] = None
        self._stopping = False

    def kick(self) -> None:
        """A request was answered (or its body moved): the driver turns soon."""
        if self._kick is not None:
            self._kick.set()

    def stop(self) -> None:
        self._stopping = True
        self.kick()

    # The reactor's dispatch: called on the loop's thread, inside a turn.
    def __call__(  # type: ignore[override]
        self,
        method: str,
        target: str,
        headers: list,
        body: bytes,
        caller: Optional[tuple] = None,
        reply: Any = None,
    ) -> Any:
        if reply is None:
            return super().__call__(method, target, headers, body, caller)
        scope = scope_for(method, target, headers, body, self.service, caller, self.state)
        exchange = _Exchange(body, reply, self)
        reply.on_gone(exchange.leave)
        task = self.loop.create_task(self._run(scope, exchange, method, target))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return None

    async def _run(self, scope: dict, exchange: _Exchange, method: str, target: str) -> None:
        try:
            await self.app(scope, exchange.receive, exchange.send)
        except asyncio.CancelledError:
            # The server stops: the request is answered (500, or its body aborted),
            # never left waiting on a reply nobody fills.
            exchange.reply.fail("the server stopped before the ASGI app answered")
            self.kick()
            exchange.leave()
            raise
        except Exception as e:
            log.error("ASGI app (%s %s) raised", method, target, exc_info=True)
            if not exchange.started:
                text = f"the ASGI app raised {type(e).__name__}: {e}\n"
                exchange.reply.start(500, _TEXT, text.encode("utf-8", "replace"), False)
            else:
                # The head went: the client sees the body aborted, not ended.
                exchange.reply.fail(f"the ASGI app raised {type(e).__name__}")
            self.kick()
            exchange.leave()
        else:
            exchange.finish(method, target)

    async def call(self, method: str, url: str, headers: dict, body: Any) -> CallResult:
        answer = self.loop.create_future()

        def done(status, headers, data, why) -> None:
            # Maybe on another thread (a streamed answer collected whole).
            self.loop.call_soon_threadsafe(_settle, answer, status, headers, data, why)

        pairs = [(str(k).lower(), str(v)) for k, v in headers.items()]
        self._reactor.call(method, url, pairs, body, done)
        self.kick()
        return await answer

    def serve(self, control: str, pod: str, service: str) -> None:
        """Registers and serves until SIGINT or SIGTERM."""
        global _serving
        self._reactor = _native.Reactor(self, control, pod, service)
        signals = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self.loop.add_signal_handler(sig, self.stop)
                signals.append(sig)
            except (RuntimeError, ValueError):
                pass  # not the main thread: the embedding program stops it
        _serving = self
        _context._no_graphs = (
            "an ASGI app served by dpumesh.server answers by itself: it calls other "
            "services with `await dpumesh.asgi.call(...)` (get_context() graphs "
            "are for WSGI handlers)"
        )
        try:
            self.loop.run_until_complete(self._drive())
        finally:
            _serving = None
            _context._no_graphs = None
            for sig in signals:
                self.loop.remove_signal_handler(sig)
            for task in list(self._tasks):
                task.cancel()
            self._reactor.shutdown()

    async def _drive(self) -> None:
        loop = self.loop
        kick = self._kick = asyncio.Event()
        reactor = self._reactor
        fd: Optional[int] = None
        registration: Optional[int] = None
        deadline: Optional[float] = None
        try:
            while True:
                if self._stopping:
                    deadline = deadline or loop.time() + _DRAIN
                    if not self._tasks or loop.time() >= deadline:
                        # The last answers are in their replies: send them.
                        while reactor.turn() > 0:
                            pass
                        return
                # Cleared before the turn: a kick from here on (the app's tasks run
                # only while this task awaits) is seen by the next one.
                kick.clear()
                if reactor.turn() > 0:
                    # Let the app's tasks run and the selector look at the sockets
                    # (without waiting) before the next turn: a busy loop batches.
                    await asyncio.sleep(0)
                    continue
                wait = reactor.wait()
                if self._stopping:
                    wait = min(wait, 0.05)
                now = reactor.registration()
                if now != registration:
                    # A new registration brought a new bell (or the node is away).
                    if fd is not None:
                        loop.remove_reader(fd)
                    registration, fd = now, reactor.bell_fd()
                    if fd is not None:
                        loop.add_reader(fd, kick.set)
                if fd is None:
                    await _nap(loop, kick, wait)
                    continue
                if reactor.sleep_begins():
                    reactor.sleep_ends()
                    continue
                await _nap(loop, kick, wait)
                # Reads the bell: its next ring is a new edge.
                reactor.sleep_ends()
        finally:
            if fd is not None:
                loop.remove_reader(fd)
            self._kick = None


async def _nap(loop: asyncio.AbstractEventLoop, kick: asyncio.Event, wait: float) -> None:
    """Until `kick` is set or `wait` seconds pass."""
    timer = loop.call_later(wait, kick.set)
    try:
        await kick.wait()
    finally:
        timer.cancel()


def _settle(answer: asyncio.Future, status, headers, data, why) -> None:
    if answer.done():
        return
    if why is not None:
        answer.set_exception(MeshCallError(why))
    else:
        answer.set_result(CallResult(status, headers, data))

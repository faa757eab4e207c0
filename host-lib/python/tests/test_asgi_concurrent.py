"""The concurrent ASGI dispatcher (``dpumesh.asgi_serve``) against a stand-in for the
native reply: what an app's ``send`` and ``receive`` turn into, with several requests
in flight on one loop. The real loop and node are in cli/tests/python.rs."""

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse

from dpumesh.asgi_serve import ConcurrentDispatcher


class FakeReply:
    """Records what the dispatcher answers; ``room`` parts fit before ``send`` says
    full; ``reader_gone`` makes every send find no reader."""

    def __init__(self, room: int = 100) -> None:
        self.head = None
        self.parts: list = []
        self.ended = False
        self.failed = None
        self.room = room
        self.blocking = 0
        self.reader_gone = False
        self.gone_callback = None

    def on_gone(self, callback):
        self.gone_callback = callback

    def start(self, status, headers, body, more):
        assert self.head is None, "started twice"
        self.head = (status, headers)
        self.parts.append(body)
        self.ended = not more
        return True

    def send(self, body, more):
        if self.reader_gone:
            return "closed"
        if len(self.parts) >= self.room:
            return "full"
        self.parts.append(body)
        self.ended = not more
        return "sent"

    def send_blocking(self, body, more):
        self.blocking += 1
        self.parts.append(body)
        self.ended = not more
        return True

    def fail(self, why):
        self.failed = why

    @property
    def body(self) -> bytes:
        return b"".join(self.parts)


def serve(app, requests):
    """Dispatches ``requests`` (method, target, FakeReply) together on the
    dispatcher's loop and runs it until every app task is done."""
    dispatcher = ConcurrentDispatcher(app, "svc")

    async def main():
        for method, target, reply in requests:
            assert dispatcher(method, target, [("host", "svc")], b"", None, reply) is None
        while dispatcher._tasks:
            await asyncio.sleep(0.001)

    try:
        dispatcher.loop.run_until_complete(asyncio.wait_for(main(), 10))
    finally:
        dispatcher.close()


def test_requests_run_together_and_each_answer_goes_whole():
    app = FastAPI()
    released = asyncio.Event()

    @app.get("/wait")
    async def wait():
        await released.wait()
        return PlainTextResponse("released")

    @app.get("/release")
    async def release():
        released.set()
        return PlainTextResponse("releasing", headers={"x-kind": "r"})

    first, second = FakeReply(), FakeReply()
    serve(app, [("GET", "/wait", first), ("GET", "/release", second)])
    assert (second.head[0], second.body, second.ended) == (200, b"releasing", True)
    assert ("x-kind", "r") in second.head[1]
    assert (first.head[0], first.body, first.ended) == (200, b"released", True)


def test_a_streamed_answer_waits_for_its_client_off_the_loop_and_ends():
    app = FastAPI()

    @app.get("/stream")
    async def stream():
        async def parts():
            for i in range(10):
                yield f"part {i};".encode()

        return StreamingResponse(parts(), media_type="text/plain")

    reply = FakeReply(room=3)
    serve(app, [("GET", "/stream", reply)])
    assert reply.head[0] == 200
    assert reply.body == b"".join(f"part {i};".encode() for i in range(10))
    assert reply.ended
    assert reply.blocking > 0, "a full channel's parts went through send_blocking"


def test_receive_says_disconnected_only_when_the_answer_is_over():
    seen = []

    async def app(scope, receive, send):
        if scope["type"] != "http":
            raise RuntimeError("http only")
        seen.append((await receive())["type"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        listener = asyncio.ensure_future(receive())
        await asyncio.sleep(0.01)
        seen.append("waiting" if not listener.done() else "early")
        await send({"type": "http.response.body", "body": b"b"})
        seen.append((await listener)["type"])

    reply = FakeReply()
    serve(app, [("GET", "/", reply)])
    assert seen == ["http.request", "waiting", "http.disconnect"]
    assert reply.body == b"ab" and reply.ended


def test_a_client_that_left_ends_the_stream_and_later_sends_are_ignored():
    sends = []

    async def app(scope, receive, send):
        if scope["type"] != "http":
            raise RuntimeError("http only")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        reply.reader_gone = True
        for i in range(3):
            await send({"type": "http.response.body", "body": b"more", "more_body": True})
            sends.append(i)
        assert (await receive())["type"] == "http.request"
        assert (await receive())["type"] == "http.disconnect"

    reply = FakeReply()
    serve(app, [("GET", "/", reply)])
    assert sends == [0, 1, 2], "sends after the client left return at once"
    assert reply.body == b"first"


def test_failures_answer_500_or_abort_a_started_body():
    async def before(scope, receive, send):
        if scope["type"] != "http":
            raise RuntimeError("http only")
        raise ValueError("no luck")

    async def after(scope, receive, send):
        if scope["type"] != "http":
            raise RuntimeError("http only")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"half", "more_body": True})
        raise ValueError("mid-stream")

    async def silent(scope, receive, send):
        if scope["type"] != "http":
            raise RuntimeError("http only")

    r = FakeReply()
    serve(before, [("GET", "/", r)])
    assert r.head[0] == 500 and b"ValueError: no luck" in r.body
    r = FakeReply()
    serve(after, [("GET", "/", r)])
    assert r.body == b"half" and "ValueError" in r.failed
    r = FakeReply()
    serve(silent, [("GET", "/", r)])
    assert r.head[0] == 500 and b"without http.response.start" in r.body


def test_a_request_the_loop_dropped_disconnects_its_app():
    outcome = []

    async def app(scope, receive, send):
        if scope["type"] != "http":
            raise RuntimeError("http only")
        await receive()
        outcome.append((await receive())["type"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"late"})

    reply = FakeReply()
    dispatcher = ConcurrentDispatcher(app, "svc")

    async def main():
        dispatcher("GET", "/", [], b"", None, reply)
        await asyncio.sleep(0.01)
        reply.gone_callback()  # what the native side calls when it drops the request
        while dispatcher._tasks:
            await asyncio.sleep(0.001)

    try:
        dispatcher.loop.run_until_complete(main())
    finally:
        dispatcher.close()
    assert outcome == ["http.disconnect"]
    assert reply.head is None, "nothing is answered to a request that is gone"


class FakeReader:
    """A streamed request body: ``parts`` come one per poll, each after a wake-up;
    ``cut`` raises where the mesh would say the body was cut."""

    def __init__(self, parts, cut: bool = False) -> None:
        self.parts = list(parts)
        self.cut = cut
        self.pending = True
        self.closed = False

    def poll(self, wake):
        if self.closed:
            return None
        if self.pending:
            # Nothing yet: the next part arrives later, from another thread's wake.
            self.pending = False
            asyncio.get_event_loop().call_later(0.001, wake)
            return False
        self.pending = True
        if self.parts:
            return self.parts.pop(0)
        if self.cut:
            raise ConnectionError("the request's body was cut")
        return None

    def close(self):
        self.closed = True


def test_a_streamed_upload_reaches_the_app_part_by_part():
    app = FastAPI()

    @app.post("/up")
    async def up(request: Request):
        parts = [p async for p in request.stream() if p]
        return PlainTextResponse(f"{len(parts)} {b''.join(parts).decode()}")

    reply = FakeReply()
    reader = FakeReader([b"ab", b"cd", b"e"])
    dispatcher = ConcurrentDispatcher(app, "svc")

    async def main():
        dispatcher("POST", "/up", [("host", "svc"), ("content-length", "5")], reader, None, reply)
        while dispatcher._tasks:
            await asyncio.sleep(0.001)

    try:
        dispatcher.loop.run_until_complete(asyncio.wait_for(main(), 10))
    finally:
        dispatcher.close()
    assert (reply.head[0], reply.body) == (200, b"3 abcde")


def test_a_cut_upload_is_a_disconnect_and_an_early_answer_stops_the_upload():
    seen = []

    async def cut(scope, receive, send):
        if scope["type"] != "http":
            raise RuntimeError("http only")
        while True:
            message = await receive()
            seen.append(message["type"])
            if message["type"] == "http.disconnect":
                return

    async def early(scope, receive, send):
        if scope["type"] != "http":
            raise RuntimeError("http only")
        await send({"type": "http.response.start", "status": 413, "headers": []})
        await send({"type": "http.response.body", "body": b"too big"})

    r1, r2 = FakeReply(), FakeReply()
    reader = FakeReader([b"x"], cut=True)
    unread = FakeReader([b"never"] * 10)
    dispatcher = ConcurrentDispatcher(cut, "svc")
    other = ConcurrentDispatcher(early, "svc")

    async def run(d, reader, reply):
        d("POST", "/", [], reader, None, reply)
        while d._tasks:
            await asyncio.sleep(0.001)

    try:
        dispatcher.loop.run_until_complete(run(dispatcher, reader, r1))
        other.loop.run_until_complete(run(other, unread, r2))
    finally:
        dispatcher.close()
        other.close()
    assert seen == ["http.request", "http.disconnect"]
    assert r1.head is None, "a cut request is not answered"
    assert (r2.head[0], r2.body) == (413, b"too big")
    assert unread.closed, "answering ends the upload nobody reads"

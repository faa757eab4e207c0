"""A FastAPI app in place of the hotel's frontend, for cli/tests/python.rs: requests
that wait for each other (served concurrently or not at all), a call through the mesh
from an ASGI handler, streamed answers (server-sent events that wait for a request,
a download larger than the stream's buffers) and what a graph from ASGI gets."""

import asyncio
import zlib

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse

from dpumesh.asgi import call
from dpumesh.server import get_context

app = FastAPI()
released = asyncio.Event()
next_tick = asyncio.Event()


@app.get("/hotels/wait")
async def wait():
    # Answered only once /hotels/release has been served: one request at a time
    # would never get there.
    try:
        await asyncio.wait_for(released.wait(), 20)
    except asyncio.TimeoutError:
        return PlainTextResponse("never released\n", status_code=504)
    return PlainTextResponse("released\n")


@app.get("/hotels/release")
async def release():
    released.set()
    return PlainTextResponse("releasing\n")


@app.get("/hotels/user")
async def user(id: str = "0"):
    answer = await call("GET", f"http://user/user?id={id}")
    return {"status": answer.status, "user": answer.json()}


@app.get("/hotels/nowhere")
async def nowhere():
    answer = await call("GET", "http://no-such-service/")
    return PlainTextResponse(f"{answer.status}\n", status_code=answer.status)


@app.get("/hotels/graph")
async def graph():
    get_context()
    return PlainTextResponse("unreachable\n")


@app.get("/hotels/tick")
async def tick():
    next_tick.set()
    return PlainTextResponse("ticked\n")


@app.get("/events/ticks")
async def ticks():
    async def events():
        yield b"data: first\n\n"
        # The second event waits for a request: the first one is at the client
        # before the body's end exists.
        await asyncio.wait_for(next_tick.wait(), 20)
        yield b"data: second\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


@app.get("/download/big")
async def big(mib: int = 16):
    async def parts():
        block = bytes(i % 251 for i in range(65536))
        for _ in range(mib * 16):
            yield block

    return StreamingResponse(parts(), media_type="application/octet-stream")


@app.get("/hotels/badheader")
async def bad_header():
    # A value HTTP does not allow: the app's error, never a malformed head.
    return PlainTextResponse("x\n", headers={"x-bad": "split\r\nx-injected: 1"})


@app.post("/upload/count")
async def count(request: Request):
    # Read as it arrives: an upload past the loop's whole-body limit (8 MiB).
    size, parts, crc = 0, 0, 0
    async for part in request.stream():
        if part:
            size, parts, crc = size + len(part), parts + 1, zlib.crc32(part, crc)
    return {"bytes": size, "parts": parts, "crc32": crc}

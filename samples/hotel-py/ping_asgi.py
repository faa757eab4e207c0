"""The Flask frontend's `/ping` (a fixed answer) as a FastAPI (ASGI) app, for
bench/python.sh: served by uvicorn behind nginx, and on the mesh by
`python3 -m dpumesh.server --asgi ping_asgi:app`."""

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

app = FastAPI()


@app.get("/ping")
async def ping():
    return PlainTextResponse("pong\n")

"""The hotel sample's `user` service as a FastAPI (ASGI) app: the same answers as the
Rust one, served by `python3 -m dpumesh.server --asgi users_asgi:app`. The end-to-end
test runs the Rust hotel mesh with this in place of the Rust `user`."""

from fastapi import FastAPI, Request

app = FastAPI()


@app.get("/user")
async def user(id: str = "0", request: Request = None):
    caller = request.scope.get("extensions", {}).get("dpumesh", {}).get("caller_identity")
    return {"id": id, "name": f"guest-{id}", "served_by": "fastapi", "caller": caller}

"""API-key check in Python, the sample policy every language implements.

The key in the configured header must be one of the configured keys; the client's name
goes into `client_header` (replacing any forged value) and the key is removed before
the request goes upstream; otherwise 401. Denials are counted.

Build: `dpumesh filter build samples/filters/python` (componentize-py); test:
`dpumesh filter test samples/filters/python/build/apikey.wasm samples/filters/apikey.suite.yaml`.
"""

import json

import wit_world
from componentize_py_types import Err
from wit_world.imports import metrics, types

# One instance serves one request at a time; its state lives at module level so it
# survives from `configure` to every call.
HEADER = "x-api-key"
CLIENT_HEADER = "x-api-client"
CLIENTS: dict[str, str] = {}
DENIED = None


def unauthorized(why: str) -> types.Verdict:
    reply = types.LocalReply(
        status=401,
        headers=[("www-authenticate", "ApiKey"), ("content-type", "text/plain")],
        body=why + "\n",
    )
    return types.Verdict_Deny(reply)


class WitWorld(wit_world.WitWorld):
    def configure(self, config: str) -> None:
        global HEADER, CLIENT_HEADER, CLIENTS, DENIED
        try:
            parsed = json.loads(config) if config.strip() else {}
        except ValueError as e:
            raise Err(f"configuration is not JSON: {e}")
        if not isinstance(parsed, dict):
            raise Err("configuration must be a JSON object")
        unknown = set(parsed) - {"header", "client_header", "keys"}
        if unknown:
            raise Err(f"unknown field(s): {', '.join(sorted(unknown))}")
        keys = parsed.get("keys")
        if not isinstance(keys, dict) or not keys:
            raise Err("keys must name at least one client")
        clients: dict[str, str] = {}
        for client, key in keys.items():
            if not isinstance(key, str) or not key:
                raise Err(f"the key of {client} is empty")
            if key in clients:
                raise Err(f"{client} and {clients[key]} share a key")
            clients[key] = client
        HEADER = parsed.get("header", "x-api-key")
        CLIENT_HEADER = parsed.get("client_header", "x-api-client")
        CLIENTS = clients
        DENIED = metrics.counter("apikey_denied_total", [])

    def on_request(self, line: types.RequestLine, head: types.RequestHead) -> types.Verdict:
        key = head.header(HEADER) or ""
        if not key:
            metrics.increment(DENIED, 1)
            return unauthorized("missing API key")
        client = CLIENTS.get(key)
        if client is None:
            metrics.increment(DENIED, 1)
            return unauthorized("unknown API key")
        head.set_header(CLIENT_HEADER, client)
        head.remove_header(HEADER)
        return types.Verdict_Continue()

    def on_response(self, head: types.RequestHead, info: types.ResponseInfo) -> None:
        pass

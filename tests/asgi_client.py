"""One POST through the server's ASGI app, no network: the handlers, routing and JSON as a client
meets them, for tests on tiny models."""
from __future__ import annotations

import asyncio
import json

_LOOPS: dict = {}  # one event loop per app, as a server has (its shutdown event binds to it)


def post(app, path: str, body: dict) -> tuple[int, bytes]:
    """(status, the whole body as sent); the client stays connected until the answer ends."""
    raw = json.dumps(body).encode()
    sent, out = [False], {"status": 0, "body": b""}

    async def receive():
        if not sent[0]:
            sent[0] = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await asyncio.sleep(3600)

    async def send(message):
        if message["type"] == "http.response.start":
            out["status"] = message["status"]
        elif message["type"] == "http.response.body":
            out["body"] += message.get("body", b"")

    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json")], "scheme": "http", "server": ("test", 80), "client": ("test", 1),
             "http_version": "1.1"}
    loop = _LOOPS.setdefault(id(app), asyncio.new_event_loop())
    loop.run_until_complete(app(scope, receive, send))
    return out["status"], out["body"]

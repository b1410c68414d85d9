"""Runs inside vLLM's API server (``--middleware``), in vLLM's environment: the key on every route.

vLLM 0.32's ``--api-key`` (``VLLM_API_KEY``) guards only the paths under ``/v1``, ``/v2``, ``/inference`` and
``/cohere`` (``vllm.entrypoints.serve.middleware.authenticate``): the dev-mode endpoints a weight update and an
abort use (``/pause``, ``/collective_rpc``, ``/update_weight_version``, ``/abort_requests``, ...) stay open to
anyone who reaches the port. This middleware answers 401 to every request without the key but ``OPTIONS`` and
the probes SGLang leaves open too (``inference/auth.py``); the key comes from the file
``$MILES_ASYNC_ENGINE_API_KEY_FILE`` names, read when vLLM builds its middleware stack (before its first answer).
A pure ASGI class, so a client that disconnects still reaches vLLM (which aborts its request). Imports nothing
but ``inference/auth.py`` (the standard library only).
"""

from __future__ import annotations

import json
from typing import Any

from miles_async.inference.auth import authorized, is_exempt, read_key_file

UNAUTHORIZED = json.dumps({"error": "Unauthorized"}).encode()


class RequireApiKey:
    """vLLM adds it as ``app.add_middleware(RequireApiKey)``; the key is in ``$MILES_ASYNC_ENGINE_API_KEY_FILE``."""

    def __init__(self, app: Any):
        self.app = app
        self._key = read_key_file()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            path = scope["path"].removeprefix(scope.get("root_path", ""))
            header = dict(scope.get("headers") or ()).get(b"authorization", b"").decode("latin-1")
            if not is_exempt(scope.get("method", ""), path) and not authorized(header, self._key):
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                    return
                await send(
                    {
                        "type": "http.response.start",
                        "status": 401,
                        "headers": [(b"content-type", b"application/json")],
                    }
                )
                await send({"type": "http.response.body", "body": UNAUTHORIZED})
                return
        await self.app(scope, receive, send)

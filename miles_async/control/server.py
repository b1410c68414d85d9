"""The control API's HTTP server (aiohttp), on the driver's event loop beside the training loop.

GET /status and GET /metrics read; POST /save, /pause, /resume and /stop act (see ``control.Control``). With a
token every request needs ``Authorization: Bearer <token>`` (else 401). Once listening, the server writes its
address to ``<output-dir>/api.json`` (removed again when it closes), so a client of a run started with
``--api-server-port 0`` finds the port.
"""

from __future__ import annotations

import hmac
import logging
import os
from pathlib import Path

from aiohttp import web

from miles_async.control import metrics
from miles_async.control.control import Control
from miles_async.control.state import CommandRefused
from miles_async.utils.checkpoint import atomic_write_json, iteration_dir, latest_checkpointed_iteration

logger = logging.getLogger(__name__)

API_FILE = "api.json"


def last_save(save_dir: str | None) -> dict | None:
    """The latest complete checkpoint in --save (what a --load of it resumes from), read from its pointer file."""
    if save_dir is None:
        return None
    try:
        rollout_id = latest_checkpointed_iteration(save_dir)
    except (OSError, ValueError):  # a pointer naming a folder not complete (yet): no save to report
        return None
    return None if rollout_id is None else {"rollout_id": rollout_id, "path": str(iteration_dir(save_dir, rollout_id))}


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class ControlServer:
    def __init__(
        self,
        control: Control,
        host: str,
        port: int,
        token: str | None,
        output_dir: str,
        save_dir: str | None,
        num_rollout: int,
    ):
        self.control = control
        self.host, self.port = host, port
        self._token = token.encode() if token is not None else None
        self.api_path = Path(output_dir) / API_FILE
        self.save_dir = save_dir
        self.num_rollout = num_rollout
        self.url: str | None = None
        self._runner: web.AppRunner | None = None

    # -- lifecycle -------------------------------------------------------------------------------------
    async def start(self) -> str:
        app = web.Application(middlewares=[self._auth])
        app.add_routes(
            [
                web.get("/status", self._status),
                web.get("/metrics", self._metrics),
                web.post("/save", self._save),
                web.post("/pause", self._pause),
                web.post("/resume", self._resume),
                web.post("/stop", self._stop),
            ]
        )
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        try:
            await web.TCPSite(self._runner, self.host, self.port).start()
        except OSError as e:
            await self._runner.cleanup()
            raise OSError(f"--api-server-port: cannot listen on {self.host}:{self.port}: {e}") from e
        port = self._runner.addresses[0][1]
        self.url = _url(self.host, port)
        atomic_write_json(
            self.api_path,
            {"url": self.url, "host": self.host, "port": port, "pid": os.getpid(), "token": self._token is not None},
        )
        logger.info("control API at %s (address in %s)", self.url, self.api_path)
        return self.url

    async def close(self) -> None:
        self.api_path.unlink(missing_ok=True)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- requests --------------------------------------------------------------------------------------
    @web.middleware
    async def _auth(self, request: web.Request, handler) -> web.StreamResponse:
        if self._token is not None:
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, b"Bearer " + self._token):
                return web.json_response(
                    {"error": "missing or wrong bearer token (Authorization: Bearer <token>)"},
                    status=401,
                    headers={"WWW-Authenticate": 'Bearer realm="miles-async"'},
                )
        return await handler(request)

    async def status(self) -> dict:
        out = {**self.control.state.snapshot(), "num_rollout": self.num_rollout}
        try:
            out["engines"] = await self.control.engines.states()
        except Exception as e:  # noqa: BLE001 - /status must answer even when the controller does not
            out["engines"] = {"error": f"{type(e).__name__}: {e}"}
        out["last_save"] = last_save(self.save_dir)
        return out

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response(await self.status())

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=metrics.render(await self.status()), headers={"Content-Type": metrics.CONTENT_TYPE})

    async def _save(self, request: web.Request) -> web.Response:
        try:
            self.control.state.request_save()
        except CommandRefused as e:
            return web.json_response({"error": str(e)}, status=409)
        return web.json_response({"save_requested": True, "after_step": self.control.state.step + 1}, status=202)

    async def _pause(self, request: web.Request) -> web.Response:
        try:
            await self.control.pause()
        except Exception as e:  # noqa: BLE001 - the engines' failure, reported to the caller
            return web.json_response({"error": f"could not pause the engines: {e}"}, status=503)
        return web.json_response({"paused": True})

    async def _resume(self, request: web.Request) -> web.Response:
        try:
            await self.control.resume()
        except Exception as e:  # noqa: BLE001 - as /pause
            return web.json_response({"error": f"could not resume the engines: {e}"}, status=503)
        return web.json_response({"paused": False})

    async def _stop(self, request: web.Request) -> web.Response:
        try:
            await self.control.stop()
        except Exception as e:  # noqa: BLE001 - the stop stands; only the resume of a paused run failed
            logger.warning("stop: could not resume the paused engines: %r", e)
        return web.json_response({"stopping": True, "save": self.control.state.can_save}, status=202)

"""The control API's HTTP server (aiohttp), on the driver's event loop beside the training loop.

GET /status and GET /metrics read; POST /save, /pause, /resume and /stop act (see ``control.Control``). Every
request, on loopback too, passes three checks before any handler runs (docs/security.md):

- its ``Host`` is one the server answers to: the bound address, loopback's names, ``--api-server-allowed-hosts``
  (else 403), so a web page that rebinds its own DNS name to 127.0.0.1 reaches nothing;
- it carries ``Authorization: Bearer <token>`` (else 401): the user's token, or one made here at start and written
  to ``<output-dir>/api_token`` (0600, removed at close), whose path is logged, never the token;
- a POST declares ``Content-Type: application/json`` (else 415: what a cross-site form or ``text/plain`` post
  cannot declare without a CORS preflight, which is never granted) and its body, if any, is a JSON object (else
  400) of at most ``MAX_BODY_BYTES`` (else 413).

Off loopback it serves HTTPS given ``--api-server-ssl-certfile``/``--api-server-ssl-keyfile``, else warns that the
token travels in clear. Once listening, the server writes its address to ``<output-dir>/api.json`` (removed again
when it closes), so a client of a run started with ``--api-server-port 0`` finds the port and the token's file.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
import ssl
from pathlib import Path

from aiohttp import hdrs, web

import miles_async.control.metrics as metrics
from miles_async.config.control import TOKEN_ENV, ControlConfig, is_loopback
from miles_async.control.control import Control
from miles_async.control.state import CommandRefused
from miles_async.utils.checkpoint import atomic_write_json, iteration_dir, latest_checkpointed_iteration
from miles_async.utils.credentials import private_file

logger = logging.getLogger(__name__)

API_FILE = "api.json"
TOKEN_FILE = "api_token"  # the token the run made, when the user gave none
# The commands take no parameters; a body is at most a small JSON object.
MAX_BODY_BYTES = 64 * 1024
LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")


def last_save(save_dir: str | None) -> dict | None:
    """The latest complete checkpoint in --save (what a --load of it resumes from), read from its pointer file."""
    if save_dir is None:
        return None
    try:
        rollout_id = latest_checkpointed_iteration(save_dir)
    except (OSError, ValueError):  # a pointer naming a folder not complete (yet): no save to report
        return None
    return None if rollout_id is None else {"rollout_id": rollout_id, "path": str(iteration_dir(save_dir, rollout_id))}


def _url(scheme: str, host: str, port: int) -> str:
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def host_name(header: str) -> str:
    """The name in a ``Host`` header, without its port or an IPv6 address's brackets, lower-cased."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def _refusal(status: int, message: str, **headers: str) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers or None)


class ControlServer:
    def __init__(self, control: Control, api: ControlConfig, output_dir: str, save_dir: str | None, num_rollout: int):
        self.control = control
        self.host, self.port = api.host, api.port
        self.api = api
        self.api_path = Path(output_dir) / API_FILE
        self.token_path: Path | None = None  # the file of a token made here
        self._token = api.token.value.encode() if api.token is not None else None
        self.output_dir = Path(output_dir)
        self.allowed_hosts = frozenset(h.lower() for h in (api.host, *LOOPBACK_HOSTS, *api.allowed_hosts))
        self.save_dir = save_dir
        self.num_rollout = num_rollout
        self.url: str | None = None
        self._runner: web.AppRunner | None = None

    # -- lifecycle -------------------------------------------------------------------------------------
    def app(self) -> web.Application:
        """The routes and the checks every request passes first (``MAX_BODY_BYTES`` also caps what aiohttp
        reads of a body that declares no length)."""
        app = web.Application(middlewares=[self._host, self._auth, self._json_post], client_max_size=MAX_BODY_BYTES)
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
        return app

    def _ssl(self) -> ssl.SSLContext | None:
        if self.api.ssl_certfile is None:
            if not is_loopback(self.host):
                logger.warning(
                    "the control API listens on %s over plain HTTP: its bearer token travels in clear to anyone on "
                    "the network path; give --api-server-ssl-certfile and --api-server-ssl-keyfile to serve HTTPS",
                    self.host,
                )
            return None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            ctx.load_cert_chain(self.api.ssl_certfile, self.api.ssl_keyfile)
        except (OSError, ssl.SSLError) as e:
            raise OSError(
                f"--api-server-ssl-certfile {self.api.ssl_certfile} / --api-server-ssl-keyfile "
                f"{self.api.ssl_keyfile}: not a certificate and its key ({e})"
            ) from e
        return ctx

    async def start(self) -> str:
        ssl_context = self._ssl()
        if self._token is None:
            token = secrets.token_urlsafe(32)
            self.token_path = private_file(token + "\n", self.output_dir / TOKEN_FILE)
            self._token = token.encode()
            logger.info("control API token made for this run, in %s (readable by this user only)", self.token_path)
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        try:
            await web.TCPSite(self._runner, self.host, self.port, ssl_context=ssl_context).start()
        except OSError as e:
            await self._runner.cleanup()
            raise OSError(f"--api-server-port: cannot listen on {self.host}:{self.port}: {e}") from e
        port = self._runner.addresses[0][1]
        self.url = _url("https" if ssl_context else "http", self.host, port)
        info = {"url": self.url, "host": self.host, "port": port, "pid": os.getpid()}
        atomic_write_json(self.api_path, {**info, "token_file": str(self.token_path) if self.token_path else None})
        logger.info("control API at %s (address in %s)", self.url, self.api_path)
        return self.url

    async def close(self) -> None:
        self.api_path.unlink(missing_ok=True)
        if self.token_path is not None:
            self.token_path.unlink(missing_ok=True)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- the checks ------------------------------------------------------------------------------------
    @web.middleware
    async def _host(self, request: web.Request, handler) -> web.StreamResponse:
        name = host_name(request.headers.get(hdrs.HOST, ""))
        if name not in self.allowed_hosts:
            return _refusal(
                403,
                f"Host {name!r} is not one this API answers to ({', '.join(sorted(self.allowed_hosts))}); "
                "--api-server-allowed-hosts adds names it is reached by",
            )
        return await handler(request)

    @web.middleware
    async def _auth(self, request: web.Request, handler) -> web.StreamResponse:
        given = request.headers.get(hdrs.AUTHORIZATION, "").encode()
        if not hmac.compare_digest(given, b"Bearer " + self._token):
            where = f"in {self.token_path}" if self.token_path else f"${TOKEN_ENV}'s or --api-server-token-file's"
            return _refusal(
                401,
                f"missing or wrong bearer token (Authorization: Bearer <token>; the token is {where})",
                **{hdrs.WWW_AUTHENTICATE: 'Bearer realm="miles-async"'},
            )
        return await handler(request)

    @web.middleware
    async def _json_post(self, request: web.Request, handler) -> web.StreamResponse:
        if request.method != hdrs.METH_POST:
            return await handler(request)
        if request.content_type != "application/json" or hdrs.CONTENT_TYPE not in request.headers:
            declared = request.headers.get(hdrs.CONTENT_TYPE, "none")
            return _refusal(415, f"Content-Type {declared!r}: a POST to this API takes application/json")
        if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
            return _refusal(413, f"body: {request.content_length} bytes, over the limit of {MAX_BODY_BYTES}")
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _refusal(413, f"body: over the limit of {MAX_BODY_BYTES} bytes")
        try:
            body = json.loads(raw) if raw.strip() else {}
        except ValueError as e:
            return _refusal(400, f"body: invalid JSON ({e})")
        if not isinstance(body, dict):
            return _refusal(400, "body: must be a JSON object")
        if body:
            return _refusal(400, f"body: {request.path} takes no parameters ({sorted(body)[:5]}); send {{}} or no body")
        return await handler(request)

    # -- routes ----------------------------------------------------------------------------------------
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

"""HTTP front-end of the embedded CPU engine, speaking a subset of SGLang's native API.

Run as::

    python -m miles_async.inference.embedded.server --model-path DIR (--port N | --listen-fd FD) \
        [--host 127.0.0.1] [--dtype bfloat16|float32] [--max-running-requests 64] \
        [--num-threads T] [--seed S] [--weight-version V]

``--port 0`` takes a port the kernel picks; the line ``serving ... on http://HOST:PORT`` says which, once it
listens. ``--listen-fd`` listens on a socket its launcher bound and passed down (``EmbeddedEngineProcess``): the
port is the launcher's before the server starts, so no other process can take it in between.

Endpoints (JSON unless noted):

- ``GET  /health``                      200 when the model is loaded and the decode thread is alive, else 500
- ``GET  /get_model_info``              model_path, weight_version, is_generation
- ``GET  /get_load``                    running/waiting counts and batching counters
- ``POST /generate``                    SGLang-shaped single request (``input_ids`` only, no text prompts; a VLM's
  images as ``image_data``: paths, data: URIs or base64, the prompt's placeholders already expanded; an MoE
  model's experts per position with ``return_routed_experts`` / ``routed_experts_start_len``, answered in
  ``meta_info.routed_experts`` as SGLang does: ``inference/routed_experts.py``; a dense model answers 400)
- ``POST /pause_generation``            ``{"mode": "abort" | "in_place" | "retract"}``
- ``POST /continue_generation``
- ``POST /abort_request``               ``{"rid": str}`` or ``{"abort_all": true}``
- ``POST /flush_cache``                 (GET accepted too, as older SGLang did)
- ``POST /update_weights_from_disk``    ``{"model_path": str, "weight_version": int | null}``
- ``POST /update_weights_from_tensor?weight_version=V&flush=1``  body: raw safetensors bytes
- ``POST /stage_weights_from_shm``      ``{"weight_version": V, "segments": [{"path", "tensors": [[name, dtype,
  shape, offset]]}]}``: map the trainer's /dev/shm files and check them, while generating (same node only)
- ``POST /commit_staged_weights``       ``{"weight_version": V, "flush": bool}``: copy the staged update in
- ``POST /discard_staged_weights``      drop a staged update
- ``GET  /weights_checksum``            ``{"weight_version": V, "checksums": {name: {sha256, sum, shape, dtype}}}``
- ``GET  /get_weights``                 every parameter as a safetensors blob, ``weight_version`` in its metadata

The server requires an API key, read at start from the 0600 file ``$MILES_ASYNC_ENGINE_API_KEY_FILE`` names (the
launcher writes it; without one the server does not start): every request but ``OPTIONS`` and the probes
(``/health``; the paths SGLang leaves open, ``inference/auth.py``) needs ``Authorization: Bearer <key>`` and is
answered 401 without it. A POST body must be ``application/json`` (``application/octet-stream`` on the tensor
route), else 415, so a cross-site form or ``text/plain`` post never reaches a handler; a JSON body over
``MAX_JSON_BYTES`` is refused with 413, and one that is not a JSON object with 400, before any handler runs.

``$MILES_ASYNC_ENGINE_CLASS=module:Class`` runs an ``Engine`` subclass instead of ``Engine`` (the
plugin point for engine doubles: see ``ENGINE_CLASS_ENV``).

``/update_weights_from_tensor`` deliberately differs from SGLang (which takes pickled tensors in
JSON): a safetensors blob is safe to parse and cheap to produce.

``text`` in /generate responses is decoded only when the model folder has a
tokenizer; otherwise it is ``""`` and callers should use ``output_ids``.

``output_token_logprobs`` are log-probs of each sampled token under the
distribution it was drawn from (after temperature, top-k/top-p renormalised;
temperature-1 log-softmax for greedy rows), see ``sampling.sample_tokens``.
A stop token that ends generation is included in ``output_ids``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys
import uuid
from typing import Any

import torch
from aiohttp import web

from miles_async.inference.auth import authorized, is_exempt, read_key_file
from miles_async.inference.embedded.engine import Engine
from miles_async.inference.embedded.records import EngineDeadError, RequestRejectedError, UnknownParameterError
from miles_async.inference.embedded.schema import BadRequest, format_result, parse_generate, parse_version
from miles_async.inference.embedded.vision import ImageRequestError
from miles_async.utils.plugins import PluginError, load_function

logger = logging.getLogger("miles_async.inference.embedded.server")

ENGINE_KEY = web.AppKey("engine", Engine)

# The engine class the server runs, as ``module:Class`` (an ``Engine`` subclass importable from the
# server's PYTHONPATH); unset, ``Engine`` itself. Read once at start-up. Tests and benchmarks run
# engine doubles through it (tests/e2e/engine_doubles.py, benchmarks/engine_doubles.py): a timing a
# test checks made certain, a fixed cost per decode step. The variable reaches every engine a run
# starts, since engines inherit the environment of the process that launches them.
ENGINE_CLASS_ENV = "MILES_ASYNC_ENGINE_CLASS"

# Weight buckets can be large; aiohttp's 1 MiB default would reject them.
MAX_BODY_BYTES = 64 * 1024**3
# Every other body is a JSON object: a prompt, a staged update's layout. Far above any real one.
MAX_JSON_BYTES = 64 * 1024**2
# The routes whose body is raw bytes (a safetensors file), and the type they take.
RAW_BODY_ROUTES = frozenset({"/update_weights_from_tensor"})
RAW_TYPE = "application/octet-stream"
JSON_KEY = web.RequestKey("json", dict)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


async def _json_body(request: web.Request) -> dict[str, Any]:
    """The body ``_body_rules`` parsed: a JSON object, or ``{}`` without a body."""
    return request.get(JSON_KEY, {})


async def _read_json(request: web.Request) -> dict[str, Any]:
    raw = bytearray()
    async for chunk in request.content.iter_any():  # a chunked body has no Content-Length to check up front
        raw += chunk
        if len(raw) > MAX_JSON_BYTES:
            raise _TooLarge(MAX_JSON_BYTES)
    try:
        body = json.loads(raw) if raw.strip() else None
    except ValueError as exc:
        raise BadRequest("body", f"invalid JSON ({exc})") from exc
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise BadRequest("body", "must be a JSON object")
    return body


class _TooLarge(Exception):
    def __init__(self, limit: int):
        self.limit = limit
        super().__init__(f"body: larger than this route's limit of {limit} bytes")


def _engine(request: web.Request) -> Engine:
    return request.app[ENGINE_KEY]


async def _await(fut: Any) -> Any:
    return await asyncio.wrap_future(fut)


def _dead_response(exc: BaseException) -> web.Response:
    return _error(500, f"engine is dead: {exc}")


async def health(request: web.Request) -> web.Response:
    engine = _engine(request)
    if engine.alive:
        return web.Response(text="ok")
    return _dead_response(engine.dead_error or RuntimeError("decode thread not running"))


async def get_model_info(request: web.Request) -> web.Response:
    engine = _engine(request)
    return web.json_response(
        {
            "model_path": engine.model_path,
            "tokenizer_path": engine.model_path if engine.tokenizer is not None else None,
            "weight_version": engine.weight_version,
            "is_generation": True,
            "dtype": str(engine.dtype).removeprefix("torch."),
            "max_running_requests": engine.max_running_requests,
            "context_length": engine.context_len,
            "vocab_size": engine.vocab_size,
        }
    )


async def get_load(request: web.Request) -> web.Response:
    return web.json_response(_engine(request).load_snapshot())


async def generate(request: web.Request) -> web.Response:
    engine = _engine(request)
    req = parse_generate(await _json_body(request), engine.vocab_size, engine.context_len)
    images = None
    if req.image_data or engine.lm.is_vision:
        try:
            # Decoding and resizing images is CPU and IO work; keep it off the event loop. A text request to a
            # VLM only has its placeholders counted (none allowed): no thread for that.
            if req.image_data:
                images = await asyncio.to_thread(engine.prepare_images, req.image_data, req.input_ids)
            else:
                engine.prepare_images([], req.input_ids)
        except ImageRequestError as exc:
            raise BadRequest("image_data", str(exc)) from exc
    if req.return_routed_experts and not engine.supports_routed_experts:
        raise BadRequest("return_routed_experts", f"not available for {engine.model_path}: {engine.lm.routers.why_not}")
    # A server-side rid lets us abort the request if the client disconnects.
    rid = req.rid if req.rid is not None else uuid.uuid4().hex
    start = req.routed_experts_start_len if req.return_routed_experts else None
    fut = engine.submit(req.input_ids, req.params, rid, images, routed_experts_start=start)
    try:
        result = await _await(fut)
    except asyncio.CancelledError:
        # The client went away (or timed out): free the batch slot.
        try:
            engine.abort(rid)
        except EngineDeadError:
            pass
        raise
    except RequestRejectedError as exc:
        return _error(400, f"rid: {exc}")
    return web.json_response(format_result(result, req.return_logprob))


async def pause_generation(request: web.Request) -> web.Response:
    body = await _json_body(request)
    mode = body.get("mode", "abort")
    if mode not in ("abort", "in_place", "retract"):
        raise BadRequest("mode", "must be one of abort, in_place, retract")
    await _await(_engine(request).pause(mode))
    return web.json_response({"success": True, "message": f"paused ({mode})"})


async def continue_generation(request: web.Request) -> web.Response:
    await _await(_engine(request).resume())
    return web.json_response({"success": True, "message": "resumed"})


async def abort_request(request: web.Request) -> web.Response:
    body = await _json_body(request)
    rid = body.get("rid")
    abort_all = body.get("abort_all", False)
    if not isinstance(abort_all, bool):
        raise BadRequest("abort_all", "must be a bool")
    if rid is not None and not isinstance(rid, str):
        raise BadRequest("rid", "must be a string")
    if rid is None and not abort_all:
        raise BadRequest("rid", "give a rid or abort_all=true")
    n = await _await(_engine(request).abort(rid, abort_all))
    return web.json_response({"success": True, "num_aborted": n})


async def flush_cache(request: web.Request) -> web.Response:
    await _await(_engine(request).flush_cache())
    return web.json_response({"success": True, "message": "cache flushed"})


async def update_weights_from_disk(request: web.Request) -> web.Response:
    engine = _engine(request)
    body = await _json_body(request)
    path = body.get("model_path")
    if not isinstance(path, str) or not path:
        raise BadRequest("model_path", "is required and must be a string")
    version = parse_version(body.get("weight_version"), "weight_version")
    try:
        # Reading the checkpoint is slow IO; keep it off the event loop.
        fut = await asyncio.to_thread(engine.update_weights_from_disk, path, version)
        new_version = await _await(fut)
    except EngineDeadError:
        raise
    except Exception as exc:  # noqa: BLE001 - any load failure is reported to the caller
        logger.warning("update_weights_from_disk(%s) failed: %s", path, exc)
        return web.json_response(
            {"success": False, "message": f"model_path: {exc}", "weight_version": engine.weight_version}, status=400
        )
    logger.info("weights loaded from %s, weight_version=%d", path, new_version)
    return web.json_response({"success": True, "message": f"loaded {path}", "weight_version": new_version})


async def update_weights_from_tensor(request: web.Request) -> web.Response:
    from safetensors.torch import load as load_safetensors

    engine = _engine(request)
    version = parse_version(request.query.get("weight_version"), "weight_version")
    flush = request.query.get("flush", "0").lower() in ("1", "true", "yes")
    raw = await request.read()
    if not raw:
        raise BadRequest("body", "empty; expected a safetensors file")
    try:
        tensors = await asyncio.to_thread(load_safetensors, raw)
    except Exception as exc:  # noqa: BLE001 - safetensors raises assorted types on garbage
        raise BadRequest("body", f"not a valid safetensors file ({exc})") from exc
    try:
        new_version = await _await(engine.update_weights_from_tensors(tensors, version, flush))
    except UnknownParameterError as exc:
        return web.json_response(
            {"success": False, "message": str(exc), "weight_version": engine.weight_version}, status=400
        )
    except ValueError as exc:
        return web.json_response(
            {"success": False, "message": str(exc), "weight_version": engine.weight_version}, status=400
        )
    return web.json_response(
        {"success": True, "message": f"updated {len(tensors)} tensors", "weight_version": new_version}
    )


async def stage_weights_from_shm(request: web.Request) -> web.Response:
    """Map the trainer's shared-memory update and check it while generation goes on (``Engine.stage_weights``)."""
    engine = _engine(request)
    body = await _json_body(request)
    version = parse_version(body.get("weight_version"), "weight_version")
    if version is None:
        raise BadRequest("weight_version", "required: the version the staged weights become")
    try:
        nbytes = await asyncio.to_thread(engine.stage_weights, body.get("segments"), version)
    except (UnknownParameterError, ValueError, OSError) as exc:
        return web.json_response(
            {"success": False, "message": str(exc), "weight_version": engine.weight_version}, status=400
        )
    return web.json_response({"success": True, "message": f"staged {nbytes} bytes", "staged_bytes": nbytes})


async def commit_staged_weights(request: web.Request) -> web.Response:
    """Apply the staged update between two decode steps; ``{"weight_version": V, "flush": bool}``."""
    engine = _engine(request)
    body = await _json_body(request)
    version = parse_version(body.get("weight_version"), "weight_version")
    if version is None:
        raise BadRequest("weight_version", "required: the version that was staged")
    try:
        new_version = await _await(engine.commit_staged_weights(version, bool(body.get("flush", True))))
    except LookupError as exc:
        return web.json_response(
            {"success": False, "message": str(exc), "weight_version": engine.weight_version}, status=409
        )
    return web.json_response({"success": True, "message": "committed", "weight_version": new_version})


async def discard_staged_weights(request: web.Request) -> web.Response:
    dropped = _engine(request).discard_staged_weights()
    return web.json_response({"success": True, "discarded": dropped})


async def weights_checksum(request: web.Request) -> web.Response:
    """Checksums of every parameter in the engine's dtype (``--check-weight-update-equal``)."""
    checksums, version = await _await(_engine(request).weights_checksum())
    return web.json_response({"weight_version": version, "checksums": checksums})


async def get_weights(request: web.Request) -> web.Response:
    """The live weights, to seed a restarted engine from this one (``--use-fault-tolerance``)."""
    from safetensors.torch import save

    tensors, version = await _await(_engine(request).weights_snapshot())
    raw = await asyncio.to_thread(save, tensors, {"weight_version": str(version)})
    return web.Response(body=raw, content_type="application/octet-stream")


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except BadRequest as exc:
        return _error(400, str(exc))
    except EngineDeadError as exc:
        return _dead_response(exc)
    except web.HTTPException:
        raise
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - report, never leave the client hanging
        logger.exception("unhandled error on %s", request.path)
        return _error(500, f"{type(exc).__name__}: {exc}")


def _require_key(key: str) -> Any:
    @web.middleware
    async def _auth(request: web.Request, handler: Any) -> web.StreamResponse:
        if is_exempt(request.method, request.path) or authorized(request.headers.get("Authorization"), key):
            return await handler(request)
        return _error(401, "Unauthorized: this engine requires 'Authorization: Bearer <the run's engine API key>'")

    return _auth


@web.middleware
async def _body_rules(request: web.Request, handler: Any) -> web.StreamResponse:
    """A POST body of the route's type and within its size, a JSON one parsed here: a refusal (415, 413, 400)
    before any handler runs, so a refused request changes nothing."""
    if request.method != "POST" or not request.body_exists:
        return await handler(request)
    raw = request.path in RAW_BODY_ROUTES
    expected = RAW_TYPE if raw else "application/json"
    if request.content_type != expected:
        return _error(415, f"Content-Type {request.content_type!r}: {request.path} takes {expected}")
    limit = MAX_BODY_BYTES if raw else MAX_JSON_BYTES
    if request.content_length is not None and request.content_length > limit:
        return _error(413, f"body: {request.content_length} bytes, over this route's limit of {limit}")
    if not raw:
        try:
            request[JSON_KEY] = await _read_json(request)
        except _TooLarge as exc:
            return _error(413, str(exc))
        except BadRequest as exc:
            return _error(400, str(exc))
    return await handler(request)


# Every route, in one table: ``build_app`` serves it and tests/integration/test_red_team.py tries each.
ROUTES = (
    web.get("/health", health),
    web.get("/get_model_info", get_model_info),
    web.get("/get_load", get_load),
    web.post("/generate", generate),
    web.post("/pause_generation", pause_generation),
    web.post("/continue_generation", continue_generation),
    web.post("/abort_request", abort_request),
    web.post("/flush_cache", flush_cache),
    web.get("/flush_cache", flush_cache),
    web.post("/update_weights_from_disk", update_weights_from_disk),
    web.post("/update_weights_from_tensor", update_weights_from_tensor),
    web.post("/stage_weights_from_shm", stage_weights_from_shm),
    web.post("/commit_staged_weights", commit_staged_weights),
    web.post("/discard_staged_weights", discard_staged_weights),
    web.get("/weights_checksum", weights_checksum),
    web.get("/get_weights", get_weights),
)


def build_app(engine: Engine, api_key: str) -> web.Application:
    """The server's routes; every one but the probes requires ``api_key``."""
    if not api_key:
        raise ValueError("the embedded engine's server requires an API key")
    middlewares = [_require_key(api_key), _body_rules, _errors]
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares)
    app[ENGINE_KEY] = engine
    app.add_routes(ROUTES)
    return app


def engine_class(path: str | None) -> type[Engine]:
    """The class named by ``$MILES_ASYNC_ENGINE_CLASS`` (``module:Class``), or ``Engine`` when unset."""
    if not path:
        return Engine
    cls = load_function(path, f"${ENGINE_CLASS_ENV}")
    if not (isinstance(cls, type) and issubclass(cls, Engine)):
        raise PluginError(f"${ENGINE_CLASS_ENV}: {path!r} is not a subclass of {Engine.__module__}.Engine")
    return cls


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Embedded CPU inference server (SGLang-native API subset)")
    ap.add_argument("--model-path", required=True, help="HF model folder (config + safetensors)")
    ap.add_argument("--host", default="127.0.0.1")
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--port", type=int, help="port to listen on; 0: one the kernel picks (logged once listening)")
    where.add_argument("--listen-fd", type=int, help="listen on this inherited socket, bound by the launcher")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--max-running-requests", type=int, default=64)
    ap.add_argument("--max-prefill-tokens", type=int, default=16384, help="token budget of one prefill forward")
    ap.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--seed", type=int, default=0, help="seed of the sampling generator")
    ap.add_argument("--weight-version", type=int, default=0)
    ap.add_argument("--log-level", default="INFO")
    return ap.parse_args(argv)


def inherited_socket(fd: int) -> socket.socket:
    """The listening socket ``--listen-fd`` names; a clear error when this process holds no socket there."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError as e:
        raise SystemExit(f"--listen-fd {fd}: not a socket this server inherited ({e})") from e
    if sock.type != socket.SOCK_STREAM:
        raise SystemExit(f"--listen-fd {fd}: not a TCP socket")
    return sock


async def _serve(args: argparse.Namespace, engine: Engine, api_key: str, sock: socket.socket | None) -> None:
    app = build_app(engine, api_key)
    # handler_cancellation: a disconnected client cancels its handler, which
    # aborts its request instead of decoding for nobody.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    if sock is not None:
        site: web.BaseSite = web.SockSite(runner, sock)
    else:
        site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    logger.info(
        "serving %s on http://%s:%d (API key required)",
        args.model_path,
        args.host,
        runner.addresses[0][1],  # the port it got: --port 0's, or the launcher's socket's
    )

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("shutting down")
    # Aborting first lets in-flight /generate handlers answer (with partial
    # output) before the runner closes their connections.
    await asyncio.to_thread(engine.shutdown, 5.0)
    await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sock = inherited_socket(args.listen_fd) if args.listen_fd is not None else None  # before the model loads
    api_key = read_key_file()  # before the model loads: a server without its key never starts
    logging.basicConfig(
        stream=sys.stderr,
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    engine_cls = engine_class(os.environ.get(ENGINE_CLASS_ENV))
    if engine_cls is not Engine:
        logger.info("engine class %s.%s (from $%s)", engine_cls.__module__, engine_cls.__qualname__, ENGINE_CLASS_ENV)
    engine = engine_cls(
        args.model_path,
        dtype=dtype,
        max_running_requests=args.max_running_requests,
        seed=args.seed,
        weight_version=args.weight_version,
        max_prefill_tokens=args.max_prefill_tokens,
    )
    engine.start()
    try:
        asyncio.run(_serve(args, engine, api_key, sock))
    finally:
        engine.shutdown(5.0)
    logger.info("bye")


if __name__ == "__main__":
    main()
    # Interpreter teardown with torch + transformers loaded takes seconds of
    # pure destructor work; everything that matters is already flushed.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

"""The protocol every inference engine speaks to the rollout code: an async HTTP client per engine.

``EngineClient`` is the protocol and its default implementation: SGLang's native endpoints
(``/generate``, ``/pause_generation``, ...), which the embedded server speaks too. Each engine's
client (``<engine>/client.py``) subclasses it where that engine differs: the format of the tensor
weight route, the embedded engine's checksum and weight read-back, vLLM's endpoints under other
names. ``miles_async.inference.engines`` maps ``--rollout-backend`` to the client, the launcher and
the weight routes of each engine.

Every call has a timeout; failures raise ``EngineError`` naming the URL and endpoint, never a bare
aiohttp exception. What an engine cannot do raises ``EngineError`` too (``_unavailable``). Every request
carries the engines' API key when there is one (``inference/auth.py``); a 401 says whether the key was
missing or refused.

Where SGLang's answers differ from the embedded server's, this module maps them to one shape
(``normalize_meta``, ``model_info``, ``load``), so nothing else needs to know which engine answered:
SGLang reports weight versions as strings (numeric here: the launcher starts it with
``--weight-version 0`` and every update sends the next int), and per-token versions as spans
(``meta_info.weight_versions``: ``[{version, start, end}]``), expanded here into
``output_token_weight_versions``; it has no ``/get_load`` (``load`` answers ``{}``). Both take
``weight_version`` as a string in ``/update_weights_from_disk``.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

import aiohttp

from miles_async.inference.auth import auth_headers
from miles_async.utils.api_key import API_KEY_ENV, ApiKey

if TYPE_CHECKING:
    import torch


# How long an idle connection to an engine may be reused. aiohttp's pool would reuse one for 15 s, oldest first,
# while SGLang's and vLLM's servers (uvicorn) close one idle for 5 s by default: a request sent on a connection the
# server is closing fails with "Server disconnected". A new localhost connection costs well under a millisecond.
IDLE_CONNECTION_REUSE_S = 2.0
# How long SGLang's and vLLM's servers keep an idle connection open (their launchers set it). Far longer than the
# client's reuse, because the server's timer counts from when it answered: a server process starved of the CPU for
# longer than its keep-alive right after answering (seen at a load average of 60-118 on 2 cores) woke with the
# timer due and the client's next request unread, and closed that connection under a request it never saw (libuv,
# under uvloop, runs due timers before it polls sockets).
SERVER_KEEP_ALIVE_S = 60


class EngineError(RuntimeError):
    """An inference-engine call failed (HTTP error status, timeout or connection error)."""

    def __init__(self, url: str, endpoint: str, message: str, status: int | None = None):
        self.url = url
        self.endpoint = endpoint
        self.status = status
        self.message = message
        where = f"{url}{endpoint}"
        prefix = f"HTTP {status} from {where}" if status is not None else f"request to {where} failed"
        super().__init__(f"{prefix}: {message}")


# How a generation may end, in SGLang's meta_info.finish_reason.type (vLLM's answers are mapped to these).
FINISH_REASONS = ("stop", "length", "abort")


class EngineProtocolError(RuntimeError):
    """An engine answered in a shape the rollout code does not know (not retried: another engine of the same
    kind would answer the same)."""


def check_finish_reason(out: Any, url: str) -> dict[str, Any]:
    """``out`` (a /generate answer, SGLang-shaped) if its finish reason is one of ``FINISH_REASONS``; else
    ``EngineProtocolError`` naming the reason and the engine, instead of a sample silently marked failed."""
    meta = out.get("meta_info") if isinstance(out, dict) else None
    reason = meta.get("finish_reason") if isinstance(meta, dict) else None
    kind = reason.get("type") if isinstance(reason, dict) else None
    if kind not in FINISH_REASONS:
        raise EngineProtocolError(
            f"the engine at {url} ended a generation with an unknown finish reason {reason!r} "
            f"(expected a type of {', '.join(FINISH_REASONS)})"
        )
    return out


def check_routed_experts(out: dict[str, Any], url: str) -> None:
    """A /generate answer that was asked for its routed experts has them, unless it was aborted (SGLang leaves
    them out, silently, when its server was started without ``--enable-return-routed-experts``)."""
    meta = out["meta_info"]
    if "routed_experts" not in meta and meta["finish_reason"]["type"] != "abort":
        raise EngineProtocolError(
            f"the engine at {url} answered a request for routed experts without meta_info.routed_experts (an SGLang "
            f"server captures them only when started with --enable-return-routed-experts, which "
            f"--use-rollout-routing-replay adds on an MoE model)"
        )


class EngineClient:
    """Async client for one inference server.

    ``timeout`` (seconds) bounds every call; ``generate`` also takes a
    per-call override because a long generation legitimately outlives a
    control call.  Create and use the client inside a running event loop;
    ``close()`` (or ``async with``) releases the connection pool. ``api_key``: the engine's key
    (``EngineConfig.api_key``), sent as a bearer token with every request.
    """

    def __init__(
        self, base_url: str, timeout: float = 600.0, max_connections: int = 0, api_key: ApiKey | str | None = None
    ):
        self.base_url = base_url.rstrip("/")
        self.timeout = float(timeout)
        self._max_connections = max_connections
        self._headers = auth_headers(api_key)
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def _get_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        # A session is bound to the loop that created it; a client reused
        # from a new loop (e.g. successive asyncio.run calls) needs a new one.
        if self._session is None or self._session.closed or self._session_loop is not loop:
            # limit=0: rollouts keep hundreds of generations in flight, and
            # aiohttp's default cap of 100 would serialise them client-side.
            connector = aiohttp.TCPConnector(limit=self._max_connections, keepalive_timeout=IDLE_CONNECTION_REUSE_S)
            self._session = aiohttp.ClientSession(connector=connector, headers=self._headers)
            self._session_loop = loop
        return self._session

    async def close(self) -> None:
        if self._session is not None and not self._session.closed and self._session_loop is asyncio.get_running_loop():
            await self._session.close()
        self._session = None
        self._session_loop = None

    async def _request(
        self,
        method: str,
        endpoint: str,
        *,
        json_body: Any = None,
        data: bytes | None = None,
        params: dict[str, str] | None = None,
        timeout: float | None = None,
        raw: bool = False,
    ) -> Any:
        url = self.base_url + endpoint
        limit = self.timeout if timeout is None else timeout
        try:
            async with self._get_session().request(
                method,
                url,
                json=json_body,
                data=data,
                params=params,
                timeout=aiohttp.ClientTimeout(total=limit),
            ) as resp:
                if raw and resp.status < 400:
                    return await resp.read()
                text = await resp.text()
                if resp.status == 401:
                    raise EngineError(self.base_url, endpoint, self._refused(), status=401)
                if resp.status >= 400:
                    raise EngineError(self.base_url, endpoint, _error_message(text), status=resp.status)
                if not text:
                    return None
                try:
                    return json.loads(text)
                except ValueError:
                    return text
        except EngineError:
            raise
        except TimeoutError as exc:
            raise EngineError(self.base_url, endpoint, f"timed out after {limit:.1f}s") from exc
        except aiohttp.ClientError as exc:
            raise EngineError(self.base_url, endpoint, f"{type(exc).__name__}: {exc}") from exc

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        return_logprob: bool = True,
        rid: str | None = None,
        timeout: float | None = None,
        image_data: list[str] | None = None,
        return_routed_experts: bool = False,
        routed_experts_start_len: int = 0,
    ) -> dict[str, Any]:
        """POST /generate; returns SGLang's response dict (text, output_ids, meta_info). ``image_data``: a VLM
        prompt's images (paths, data: URIs or base64), as SGLang takes them. ``return_routed_experts``: an MoE
        model's experts for every position from ``routed_experts_start_len`` on, in ``meta_info["routed_experts"]``
        (``inference/routed_experts.py`` has the format; sent only when asked, so other requests are unchanged)."""
        body: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": sampling_params,
            "return_logprob": return_logprob,
        }
        if rid is not None:
            body["rid"] = rid
        if image_data:
            body["image_data"] = list(image_data)
        if return_routed_experts:
            body["return_routed_experts"] = True
            body["routed_experts_start_len"] = int(routed_experts_start_len)
        out = await self._request("POST", "/generate", json_body=body, timeout=timeout)
        if isinstance(out, dict) and isinstance(out.get("meta_info"), dict):
            normalize_meta(out["meta_info"], len(out.get("output_ids") or []))
        out = check_finish_reason(out, self.base_url)
        if return_routed_experts:
            check_routed_experts(out, self.base_url)
        return out

    async def health(self, timeout: float | None = None) -> bool:
        """True iff GET /health answers 200 within ``timeout`` (default: min(timeout, 10 s)); never raises."""
        try:
            await self._request("GET", "/health", timeout=timeout if timeout is not None else min(self.timeout, 10.0))
        except EngineError:
            return False
        return True

    async def model_info(self) -> dict[str, Any]:
        info = await self._request("GET", "/get_model_info")
        if isinstance(info, dict) and "weight_version" in info:
            info["weight_version"] = as_version(info["weight_version"])
        return info

    async def weights_checksum(self) -> dict[str, Any]:
        """GET /weights_checksum: ``{"weight_version": V, "checksums": {name: {...}}}`` (see
        ``miles_async.utils.weight_checksum``); ``--check-weight-update-equal`` compares them with the trainer's."""
        raise self._unavailable("/weights_checksum", "a per-tensor checksum of HF-named weights")

    async def get_weights(self) -> tuple[dict[str, torch.Tensor], int]:
        """Every parameter and the weight version they belong to (seeds a restarted engine from a healthy peer)."""
        raise self._unavailable("/get_weights", "reading the weights back")

    async def load(self) -> dict[str, Any]:
        """Running/waiting requests and the engine's counters (``/get_load``); ``{}`` from an engine without it."""
        try:
            return await self._request("GET", "/get_load")
        except EngineError as e:
            if e.status == 404:  # SGLang
                return {}
            raise

    async def pause(self, mode: str = "abort") -> dict[str, Any]:
        """POST /pause_generation; mode is "abort", "in_place" or "retract"."""
        return await self._request("POST", "/pause_generation", json_body={"mode": mode})

    async def resume(self) -> dict[str, Any]:
        return await self._request("POST", "/continue_generation", json_body={})

    async def abort(self, rid: str | None = None, abort_all: bool = False) -> Any:
        if rid is None and not abort_all:
            raise ValueError("abort() needs a rid or abort_all=True")
        body: dict[str, Any] = {"abort_all": abort_all}
        if rid is not None:
            body["rid"] = rid
        return await self._request("POST", "/abort_request", json_body=body)

    async def flush_cache(self) -> Any:
        return await self._request("POST", "/flush_cache")

    async def update_weights_from_disk(self, model_path: str, weight_version: int | None = None) -> dict[str, Any]:
        return await self._request(
            "POST",
            "/update_weights_from_disk",
            json_body={
                "model_path": model_path,
                "weight_version": None if weight_version is None else str(int(weight_version)),
            },
        )

    async def begin_weight_update(self) -> None:
        """Before the buckets of an update (SGLang needs it; nothing to do for the embedded engine)."""

    async def end_weight_update(self) -> None:
        """After the last bucket of an update."""

    async def update_weights_from_tensors(
        self,
        named_tensors: list[tuple[str, torch.Tensor]],
        weight_version: int | None = None,
        flush: bool = False,
    ) -> dict[str, Any]:
        """Send one bucket of HF-named tensors (the ``tensor`` weight route, in the engine's own format).

        Send ``weight_version`` (and usually ``flush=True``) with the last
        bucket only, so the version flips once every bucket has landed.
        """
        raise self._unavailable("/update_weights_from_tensor", "pushing tensors over HTTP (the tensor route)")

    def _refused(self) -> str:
        what = "the API key it was sent was refused" if self._headers else "no API key was sent"
        return (
            f"the engine requires an API key and {what} (every engine requires the run's key, "
            f"EngineConfig.api_key; ${API_KEY_ENV} sets it)"
        )

    def _unavailable(self, endpoint: str, what: str) -> EngineError:
        return EngineError(self.base_url, endpoint, f"{what} is not available from {type(self).__name__}")


def as_version(v: Any) -> Any:
    """A weight version as an int where it is one (SGLang sends strings)."""
    if isinstance(v, str):
        try:
            return int(v)
        except ValueError:
            return v
    return v


def normalize_meta(meta: dict[str, Any], num_output_tokens: int) -> None:
    """SGLang's ``meta_info`` in the shape the rollout code reads: int versions, one version per output token."""
    if "weight_version" in meta:
        meta["weight_version"] = as_version(meta["weight_version"])
    spans = meta.get("weight_versions")
    if "output_token_weight_versions" not in meta and spans:
        per_token: list[Any] = []
        for span in spans:
            per_token += [as_version(span["version"])] * max(0, int(span["end"]) - int(span["start"]))
        if len(per_token) < num_output_tokens:
            per_token += [meta.get("weight_version", per_token[-1] if per_token else 0)] * (
                num_output_tokens - len(per_token)
            )
        meta["output_token_weight_versions"] = per_token[:num_output_tokens]


def _error_message(text: str) -> str:
    try:
        body = json.loads(text)
    except ValueError:
        return text.strip()[:2000] or "(empty body)"
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "message" in body:
            return str(body["message"])
    return text.strip()[:2000]

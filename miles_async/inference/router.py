"""Spread /generate requests over engines: least outstanding requests first.

Without fault tolerance (``retry=False``) the engine set is fixed and a failed request fails
the rollout at once, with a message naming the engine.

With ``--use-fault-tolerance`` (``retry=True``):

- the set of engines changes at run time: the inference controller calls ``set_engines``
  whenever it quarantines an engine or brings a restarted one back (only once that engine
  holds the current weights), and engine URLs may change on restart;
- a request that fails because its engine died (connection error or a 5xx "engine is dead")
  is sent again, whole, to another engine. The caller's sample only changes when a response
  arrives, so nothing the dead engine produced leaks into it: the retry starts from the
  sample's current state. Requests still running on an engine that is taken out of the set
  (e.g. it hangs) are cancelled and retried the same way;
- an engine that just failed a request is skipped by new requests for ``cooldown`` seconds,
  long enough for the controller's health check to confirm or clear it;
- with no engine to send to, requests wait for one (until the controller reports that the
  run cannot go on, ``set_engines([], fatal=...)``, which fails them with its message).

``make_router`` picks SGLang's own router (``sglang_router``) when asked for and installed;
that path is untested here (the package is not installed in this environment).
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from miles_async.inference.client import EngineClient, EngineError
from miles_async.inference.engines import make_client
from miles_async.inference.launcher import await_health
from miles_async.utils.api_key import ApiKey
from miles_async.utils.credentials import without_secrets
from miles_async.utils.ports import free_port, start_again

logger = logging.getLogger(__name__)


class NoEngineError(RuntimeError):
    """No engine can take requests any more (the controller gave up)."""


def is_engine_failure(e: EngineError) -> bool:
    """A connection error or a 5xx: the engine (not the request) is at fault, so another may succeed."""
    if e.status is None:
        return "timed out" not in str(e)  # a slow answer is not a dead engine (the health check judges that)
    return e.status >= 500


class Router:
    def __init__(
        self,
        urls: list[str],
        timeout: float,
        retry: bool = False,
        cooldown: float = 5.0,
        max_attempts: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        client_factory: Callable[[str, float], Any] = lambda url, timeout: EngineClient(url, timeout=timeout),
    ):
        # ``urls`` may be empty: the rollout executor starts while the engines boot and is given them by
        # ``set_engines`` (the inference controller's ``attach``) before its first request.
        self.timeout = timeout
        self.retry = retry
        self.cooldown = cooldown
        self._max_attempts = max_attempts
        self.clock = clock
        self._client_factory = client_factory
        self.clients: dict[str, Any] = {u: client_factory(u, timeout) for u in urls}
        self.outstanding: dict[str, int] = {u: 0 for u in urls}
        self._cooling_until: dict[str, float] = {}
        self._inflight: dict[str, set[asyncio.Task]] = {u: set() for u in urls}
        self._evicted: set[asyncio.Task] = set()
        self._changed = asyncio.Event()
        self.fatal: str | None = None
        self.retries = 0  # requests sent again after their engine failed

    @property
    def urls(self) -> list[str]:
        return list(self.clients)

    @property
    def max_attempts(self) -> int:
        return self._max_attempts or max(3, 2 * len(self.clients))

    async def set_engines(self, urls: list[str], fatal: str | None = None) -> None:
        """The engines that may take traffic now; ``fatal``: none ever will again, fail every request."""
        old = set(self.clients)
        for u in urls:
            if u not in self.clients:
                self.clients[u] = self._client_factory(u, self.timeout)
                self.outstanding[u] = 0
                self._inflight[u] = set()
            self._cooling_until.pop(u, None)  # (re)admitted by the controller: it answers its health checks
        for u in old - set(urls):
            client = self.clients.pop(u)
            for task in self._inflight.pop(u, set()):
                self._evicted.add(task)
                task.cancel()
            self.outstanding.pop(u, None)
            await client.close()
        if fatal is not None:
            self.fatal = fatal
        if set(urls) != old or fatal is not None:
            # The first set is the run starting (info); later ones are engines failing or coming back.
            logger.log(
                logging.WARNING if old or fatal else logging.INFO,
                "router: engines now %s%s",
                urls,
                f" (fatal: {fatal.splitlines()[0]})" if fatal else "",
            )
        self._changed.set()
        self._changed = asyncio.Event()

    def _pick(self) -> str | None:
        now = self.clock()
        candidates = [u for u in self.clients if self._cooling_until.get(u, 0) <= now]
        if not candidates:
            return None
        return min(candidates, key=lambda u: self.outstanding[u])

    async def _acquire(self) -> str:
        while True:
            if self.fatal is not None:
                raise NoEngineError(self.fatal)
            url = self._pick()
            if url is not None:
                return url
            # Wait for the controller to change the set, or for a cooldown to end.
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=min(self.cooldown, 1.0))
            except TimeoutError:
                pass

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict,
        return_logprob: bool = True,
        rid: str | None = None,
        image_data: list[str] | None = None,
        return_routed_experts: bool = False,
        routed_experts_start_len: int = 0,
    ) -> dict[str, Any]:
        errors: list[str] = []
        # Only a VLM prompt's client needs to take images, only an R3 request's the routed-experts arguments.
        extra: dict[str, Any] = {"image_data": image_data} if image_data else {}
        if return_routed_experts:
            extra.update(return_routed_experts=True, routed_experts_start_len=routed_experts_start_len)
        if not self.clients and not self.retry:
            raise NoEngineError(self.fatal or "the router has no engine yet (set_engines gives it them)")
        for attempt in range(1, self.max_attempts + 1):
            url = await self._acquire() if self.retry else min(self.clients, key=lambda u: self.outstanding[u])
            self.outstanding[url] += 1
            task = asyncio.ensure_future(
                self.clients[url].generate(input_ids, sampling_params, return_logprob=return_logprob, rid=rid, **extra)
            )
            self._inflight[url].add(task)
            try:
                return await task
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if task not in self._evicted or (current is not None and current.cancelling()):
                    raise
                errors.append(f"{url}: taken out of rotation by the health check")
            except EngineError as e:
                if e.status == 401:
                    raise  # a missing or refused key: no engine will answer otherwise
                if not self.retry:
                    raise EngineError(
                        e.url,
                        e.endpoint,
                        f"{e.message} (the engine may have died; see its "
                        f"engine_<i>.log in the output folder; --use-fault-tolerance would retry "
                        f"the request on another engine)",
                        e.status,
                    ) from e
                if not is_engine_failure(e):
                    raise
                errors.append(str(e))
                self._cooling_until[url] = self.clock() + self.cooldown
            finally:
                self._evicted.discard(task)
                if url in self.outstanding:
                    self.outstanding[url] -= 1
                    self._inflight[url].discard(task)
            self.retries += 1
            logger.warning(
                "router: request failed on %s (attempt %d of %d), retrying on another engine: %s",
                url,
                attempt,
                self.max_attempts,
                errors[-1],
            )
        raise NoEngineError(
            f"a request failed on {self.max_attempts} engines in a row (is the request itself "
            f"killing them?): " + "; ".join(errors)
        )

    async def close(self) -> None:
        for c in self.clients.values():
            await c.close()


class SGLangRouter:
    """SGLang's router (the ``sglang_router`` package, a Rust load balancer) behind the same interface.

    UNTESTED: ``sglang_router`` is not installed in this project's test environment. It is
    launched as a child process with the engine URLs, its output in ``log_path``, and waited for until it answers
    ``/health`` (``startup_timeout``); one that exits at start-up because its port was taken is started again on
    a fresh port (``utils/ports.py``). Engines are added and removed through its ``/add_worker`` and
    ``/remove_worker`` endpoints; requests go to its ``/generate``. Retries of failed requests are then the SGLang
    router's business, not ours.
    """

    def __init__(
        self,
        urls: list[str],
        timeout: float,
        host: str = "127.0.0.1",
        policy: str = "cache_aware",
        api_key: ApiKey | str | None = None,
        startup_timeout: float = 60.0,
    ):
        self.timeout = timeout
        self.engines = list(urls)
        fd, log_path = tempfile.mkstemp(prefix="sglang_router_", suffix=".log")
        os.close(fd)
        self.log_path = Path(log_path)
        args = ["--policy", policy, *(["--worker-urls", *urls] if urls else [])]
        self.proc, self.url = _launch_router(args, host, self.log_path, startup_timeout)
        logger.info("sglang_router at %s, its log in %s", self.url, self.log_path)
        # The key reaches the router, not the engines behind it, which every one requires: sglang_router must be
        # given it as its own worker key too (untested, see above; docs/security.md).
        self.client = EngineClient(self.url, timeout=timeout, api_key=api_key)
        self.fatal: str | None = None
        self.retries = 0

    @property
    def urls(self) -> list[str]:
        return list(self.engines)

    async def set_engines(self, urls: list[str], fatal: str | None = None) -> None:
        for u in set(self.engines) - set(urls):
            await self.client._request("POST", "/remove_worker", params={"url": u})
        for u in set(urls) - set(self.engines):
            await self.client._request("POST", "/add_worker", params={"url": u})
        self.engines = list(urls)
        self.fatal = fatal or self.fatal

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict,
        return_logprob: bool = True,
        rid: str | None = None,
        image_data: list[str] | None = None,
        return_routed_experts: bool = False,
        routed_experts_start_len: int = 0,
    ) -> dict[str, Any]:
        if self.fatal is not None:
            raise NoEngineError(self.fatal)
        return await self.client.generate(
            input_ids,
            sampling_params,
            return_logprob=return_logprob,
            rid=rid,
            image_data=image_data,
            return_routed_experts=return_routed_experts,
            routed_experts_start_len=routed_experts_start_len,
        )

    async def close(self) -> None:
        await self.client.close()
        self.proc.terminate()


def _launch_router(args: list[str], host: str, log_path: Path, timeout: float) -> tuple[subprocess.Popen, str]:
    """sglang_router on a free port, once it answers /health; started again on a fresh port while its port was
    taken (``start_again``)."""
    attempt = 1
    while True:
        port = free_port(host)
        url = f"http://{host}:{port}"
        with log_path.open("ab") as log:
            begin = log.tell()
            command = [sys.executable, "-m", "sglang_router.launch_router", "--host", host, "--port", str(port)]
            proc = subprocess.Popen(
                command + args, stdout=log, stderr=subprocess.STDOUT, env=without_secrets(os.environ)
            )
        try:
            if await_health(proc, url, timeout):
                return proc, url
        except TimeoutError as e:
            proc.kill()
            raise RuntimeError(f"sglang_router: {e}; see {log_path}") from None
        with log_path.open("rb") as log:
            output = log.read()[begin:].decode(errors="replace")
        if not start_again(attempt, output):
            raise RuntimeError(
                f"sglang_router exited with code {proc.returncode} at start-up; see {log_path}:\n{output[-3000:]}"
            )
        attempt += 1
        logger.warning("sglang_router: port %d was taken; starting it again on a fresh port (start %d)", port, attempt)


def sglang_router_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("sglang_router") is not None


def make_router(
    urls: list[str],
    timeout: float,
    kind: str = "builtin",
    retry: bool = False,
    cooldown: float = 5.0,
    backend: str = "embedded",
    api_key: ApiKey | str | None = None,
) -> Router | SGLangRouter:
    """``kind``: "builtin" (this module's Router), "sglang" (SGLang's router; must be installed). ``backend``:
    the engines' --rollout-backend, which picks the client the builtin router talks to them with; ``api_key``:
    the engines' key (``EngineConfig.api_key``), sent with every request."""
    if kind == "sglang":
        if not sglang_router_available():
            raise RuntimeError("--rollout-router sglang needs the sglang_router package (pip install sglang-router)")
        return SGLangRouter(urls, timeout, api_key=api_key)
    return Router(
        urls,
        timeout,
        retry=retry,
        cooldown=cooldown,
        client_factory=lambda url, t: make_client(backend, url, t, api_key=api_key),
    )

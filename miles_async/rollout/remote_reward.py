"""A reward server over HTTP (``--rm-url``): samples go out in batches, rewards come back.

The request follows Miles/slime's ``--rm-type remote_rm``: each sample is the JSON object
``{"prompt", "response", "label", "metadata"}`` (Miles sends the first three; a server that
reads only those works unchanged). With ``--rm-batch-size 1`` (the default) one object is
POSTed per request and the reply is the reward: a number, or an object holding it under
``--reward-key`` -- exactly Miles' shape. With a larger batch size, or with ``--group-rm`` (one
request per group, for ranking reward models), the body is a JSON list of those objects and
the reply must be a list of as many rewards, in order.

Requests run at most ``--rm-max-concurrent-requests`` at a time, each bounded by
``--rm-timeout``; a refused or dropped connection, a timeout or a 5xx / 408 / 429 reply is
retried with exponential backoff (``reward_retry``) up to ``--rm-max-retries`` times, after
which the rollout fails with ``RemoteRewardError`` naming the URL and the last error. Any other
4xx or a malformed reply fails it at once. ``--reward-on-error zero`` does not apply: a reward
server that is down would otherwise turn a whole run's rewards into zeros.

Credentials: a bearer token (``--rm-token-file`` or ``$MILES_ASYNC_RM_TOKEN``) goes in the ``Authorization``
header. A redirect is never followed (it fails the rollout naming where it pointed): it could carry the token,
or the samples, to another host. Every message shows the URL redacted (``utils.urls``): no user, password or
query string, where an API key often sits.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import aiohttp

from miles_async.config.rollout import RemoteRewardConfig
from miles_async.rollout.reward_retry import GaveUp, Retryable, RetryPolicy, with_retries
from miles_async.rollout.sample import Sample
from miles_async.utils.urls import redact_url, scrub

T = TypeVar("T")
R = TypeVar("R")

# A batch goes out once full or this long after its first sample: long enough for the samples
# that finish together to share a request, short next to a generation.
BATCH_LINGER_S = 0.05
RETRY_STATUSES = frozenset({408, 429})
BACKOFF_CAP_S = 30.0


class RemoteRewardError(RuntimeError):
    """The reward server could not score a batch; the message names the URL."""


def payload(sample: Sample) -> dict[str, Any]:
    return {"prompt": sample.prompt, "response": sample.response, "label": sample.label, "metadata": sample.metadata}


def extract_reward(value: Any, reward_key: str | None) -> float:
    """A reward function's or server's answer as a float: a number, or an object holding it under ``reward_key``."""
    if isinstance(value, dict):
        if reward_key is None:
            raise ValueError(f"got an object {_short(value)}; give --reward-key naming the key that holds the reward")
        if reward_key not in value:
            raise ValueError(f"--reward-key {reward_key!r} is not in {_short(value)}")
        value = value[reward_key]
    try:
        reward = float(value)  # numpy and torch scalars too
    except (TypeError, ValueError):
        raise ValueError(f"a reward must be a number, got {_short(value)}") from None
    if not math.isfinite(reward):
        raise ValueError(f"a reward must be finite, got {reward}")
    return reward


def parse_rewards(reply: Any, count: int, as_list: bool, reward_key: str | None) -> list[float]:
    if not as_list:
        return [extract_reward(reply, reward_key)]
    if not isinstance(reply, list) or len(reply) != count:
        raise ValueError(
            f"sent a list of {count} samples, expected a list of {count} rewards back, got {_short(reply)}"
        )
    return [extract_reward(v, reward_key) for v in reply]


def _short(value: Any, limit: int = 200) -> str:
    try:
        text = json.dumps(value) if not isinstance(value, str) else repr(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


class MicroBatcher(Generic[T, R]):
    """Gathers single ``submit``s into calls of up to ``size`` items: a call goes out once ``size``
    items wait or ``linger`` seconds after the first. A failed call fails each of its submitters."""

    def __init__(self, size: int, linger: float, call: Callable[[list[T]], Awaitable[list[R]]]):
        self.size, self.linger, self._call = size, linger, call
        self._waiting: list[tuple[T, asyncio.Future]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._calls: set[asyncio.Task] = set()

    async def submit(self, item: T) -> R:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._waiting.append((item, future))
        if len(self._waiting) >= self.size:
            self._flush()
        elif self._timer is None:
            self._timer = loop.call_later(self.linger, self._flush)
        return await future

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._waiting = self._waiting, []
        if batch:
            task = asyncio.get_running_loop().create_task(self._run(batch))
            self._calls.add(task)
            task.add_done_callback(self._calls.discard)

    async def _run(self, batch: list[tuple[T, asyncio.Future]]) -> None:
        try:
            results = await self._call([item for item, _ in batch])
        except asyncio.CancelledError:
            for _, f in batch:
                f.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - handed to every submitter of the batch
            for _, f in batch:
                if not f.done():
                    f.set_exception(e)
            return
        for (_, f), result in zip(batch, results, strict=True):
            if not f.done():  # a submitter cancelled meanwhile (its group failed elsewhere)
                f.set_result(result)

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for _, f in self._waiting:
            f.cancel()
        self._waiting = []
        for task in list(self._calls):
            task.cancel()
        await asyncio.gather(*self._calls, return_exceptions=True)


class RemoteRewardClient:
    """Scores samples (batched) and whole groups (one request each) on the reward server at ``cfg.url``."""

    def __init__(
        self,
        cfg: RemoteRewardConfig,
        reward_key: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ):
        self.cfg = cfg
        self.reward_key = reward_key
        self.policy = RetryPolicy(cfg.max_retries, cfg.retry_backoff, BACKOFF_CAP_S)
        self._clock, self._sleep = clock, sleep
        self._limit = asyncio.Semaphore(cfg.max_concurrent_requests)
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None
        self._batcher = (
            MicroBatcher(cfg.batch_size, BATCH_LINGER_S, lambda samples: self._post(samples, as_list=True))
            if cfg.batch_size > 1
            else None
        )

    async def score(self, sample: Sample) -> float:
        if self._batcher is None:
            return (await self._post([sample], as_list=False))[0]
        return await self._batcher.submit(sample)

    async def score_group(self, group: list[Sample]) -> list[float]:
        return await self._post(group, as_list=True)

    async def close(self) -> None:
        if self._batcher is not None:
            await self._batcher.close()
        if self._session is not None and not self._session.closed and self._session_loop is asyncio.get_running_loop():
            await self._session.close()
        self._session = None

    def _get_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session_loop is not loop:
            # No connector cap: the semaphore is the limit, and a request queued for a connection
            # would spend its --rm-timeout waiting.
            headers = {"Authorization": f"Bearer {self.cfg.token.value}"} if self.cfg.token is not None else None
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=headers)
            self._session_loop = loop
        return self._session

    async def _post(self, samples: list[Sample], as_list: bool) -> list[float]:
        body = [payload(s) for s in samples] if as_list else payload(samples[0])
        what = f"reward server --rm-url {redact_url(self.cfg.url)}"
        try:
            reply = await with_retries(lambda: self._attempt(body), self.policy, what, self._clock, self._sleep)
        except GaveUp as e:
            raise RemoteRewardError(
                f"{e} (--rm-timeout {self.cfg.timeout:g}s, --rm-max-retries {self.cfg.max_retries})"
            ) from e
        try:
            return parse_rewards(reply, len(samples), as_list, self.reward_key)
        except ValueError as e:
            raise RemoteRewardError(f"{what} answered badly: {e}") from e

    async def _attempt(self, body: Any) -> Any:
        url = self.cfg.url
        where = f"reward server --rm-url {redact_url(url)}"
        async with self._limit:
            try:
                async with self._get_session().post(
                    url, json=body, timeout=aiohttp.ClientTimeout(total=self.cfg.timeout), allow_redirects=False
                ) as resp:
                    text = await resp.text()
                    status, location = resp.status, resp.headers.get("Location", "")
            except TimeoutError as e:
                raise Retryable(f"no reply within {self.cfg.timeout:g}s") from e
            except (aiohttp.ClientError, OSError) as e:
                # Not chained where its text holds the URL's secrets: a traceback would print them.
                cause = None if _leaks(e, url) else e
                raise Retryable(scrub(f"{type(e).__name__}: {e}", url)) from cause
        text = scrub(text, url)
        if 300 <= status < 400:
            raise RemoteRewardError(
                f"{where} answered HTTP {status}, a redirect to {redact_url(location) or '(no Location)'}; redirects "
                "are not followed (they could take the token or the samples elsewhere): give the final URL as --rm-url"
            )
        if status >= 500 or status in RETRY_STATUSES:
            raise Retryable(f"HTTP {status}: {text[:200]}")
        if status >= 400:
            raise RemoteRewardError(f"{where} refused the request: HTTP {status}: {text[:500]}")
        try:
            return json.loads(text)
        except ValueError:
            raise RemoteRewardError(f"{where} answered with something other than JSON: {text[:200]!r}") from None


def _leaks(error: BaseException, url: str) -> bool:
    """Whether ``error``'s message or its causes' would show what ``redact_url`` hides of ``url``."""
    seen: BaseException | None = error
    while seen is not None:
        if scrub(str(seen), url) != str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False

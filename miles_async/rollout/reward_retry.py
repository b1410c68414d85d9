"""Retries with bounded exponential backoff for calls to a remote reward server: pure policy.

Time comes from an injected clock and the waiting from an injected ``sleep``, so the policy is
unit-tested without sleeping; ``remote_reward`` supplies the HTTP attempt. A failure the attempt
marks ``Retryable`` (a refused or dropped connection, a timeout, a 5xx / 408 / 429 reply) is
tried again after ``backoff_base * 2**(retry - 1)`` seconds, capped at ``backoff_cap``, at most
``max_retries`` times; then ``GaveUp`` names what was called, the attempts, the time spent and
the last error. Any other exception (a 4xx, a malformed reply) is the caller's bug or the
server's and propagates at once: trying again would get the same answer.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Retryable(Exception):
    """An attempt failed in a way another attempt may not (the message says how)."""


class GaveUp(RuntimeError):
    """Every allowed attempt failed with a retryable error."""


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int = 3  # attempts after the first (--rm-max-retries)
    backoff_base: float = 1.0  # seconds before the first retry; doubles with each further one
    backoff_cap: float = 30.0

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (1 for the first retry)."""
        return min(self.backoff_cap, self.backoff_base * 2 ** (retry - 1))


async def with_retries(
    attempt: Callable[[], Awaitable[T]],
    policy: RetryPolicy,
    what: str,
    clock: Callable[[], float],
    sleep: Callable[[float], Awaitable[None]],
) -> T:
    """``await attempt()`` until it returns, raises a non-retryable error, or the retries run out (``GaveUp``)."""
    start = clock()
    for retry in range(policy.max_retries + 1):
        if retry:
            await sleep(policy.delay(retry))
        try:
            return await attempt()
        except Retryable as e:
            last = e
            if retry < policy.max_retries:
                logger.warning(
                    "%s failed (%s); retry %d of %d in %.1fs",
                    what,
                    e,
                    retry + 1,
                    policy.max_retries,
                    policy.delay(retry + 1),
                )
    attempts = policy.max_retries + 1
    raise GaveUp(
        f"{what}: gave up after {attempts} attempt{'s' if attempts > 1 else ''} over {clock() - start:.1f}s; "
        f"last error: {last}"
    ) from last

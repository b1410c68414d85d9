"""The driver's side of a staged weight update (``shared_memory.py`` writes it; the embedded engine maps it while
it generates): which engines stage, and the calls that have them apply or drop the update.

Kept apart from the writing side so the driver, which only makes these calls, does not import torch.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from miles_async.inference.client import EngineClient
from miles_async.inference.engines import engine_spec, make_client
from miles_async.utils.api_key import ApiKey

logger = logging.getLogger(__name__)


def stages(engine: str) -> bool:
    """Whether ``engine`` takes this route as a staged update (the embedded engine) rather than handles."""
    return hasattr(engine_spec(engine).client, "stage_weights_from_shm")


async def each_engine(
    urls: list[str], timeout: float, engine: str, api_key: ApiKey | None, call: Callable[[EngineClient], Awaitable[Any]]
) -> list:
    clients = [make_client(engine, u, timeout, api_key) for u in urls]
    try:
        return await asyncio.gather(*[call(c) for c in clients])
    finally:
        for c in clients:
            await c.close()


async def commit(
    urls: list[str], weight_version: int, timeout: float, engine: str, flush: bool, api_key: ApiKey | None = None
) -> None:
    """The staged engines copy the update of ``weight_version`` into their parameters (they should be paused)."""
    await each_engine(urls, timeout, engine, api_key, lambda c: c.commit_staged_weights(weight_version, flush))


async def discard(urls: list[str], timeout: float, engine: str, api_key: ApiKey | None = None) -> None:
    """Best effort, after a failure: the engines drop a staged update (and their mappings of its files)."""

    async def one(c: EngineClient) -> None:
        try:
            await c.discard_staged_weights()
        except Exception as e:  # noqa: BLE001 - the failure being handled is the one to report
            logger.warning("could not discard the staged weights of %s: %s", c.base_url, e)

    await each_engine(urls, min(timeout, 10.0), engine, api_key, one)

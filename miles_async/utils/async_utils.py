"""Waiting that never hangs silently: every wait has a deadline or races what it depends on."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Coroutine, Iterable
from typing import TypeVar

T = TypeVar("T")


class WaitTimeout(TimeoutError):
    pass


async def wait_for(aw: Awaitable[T], timeout: float | None, what: str) -> T:
    """``asyncio.wait_for`` whose timeout error says what was being waited for."""
    try:
        return await asyncio.wait_for(aw, timeout)
    except TimeoutError as e:
        raise WaitTimeout(f"timed out after {timeout:.0f}s waiting for {what}") from e


async def race(aw: Awaitable[T], watched: Iterable[asyncio.Future], timeout: float | None, what: str) -> T:
    """Await ``aw`` but fail as soon as any watched task fails (its exception propagates)."""
    main = asyncio.ensure_future(aw)
    watched = [w for w in watched if w is not None]
    pending = {main, *watched}
    try:
        while True:
            done, pending = await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                raise WaitTimeout(f"timed out after {timeout:.0f}s waiting for {what}")
            for d in done:
                if d is main:
                    return main.result()
                if d.exception() is not None:
                    raise d.exception()
            if main not in pending:
                return main.result()
    finally:
        if not main.done():
            main.cancel()


async def gather_fail_fast(coros: Iterable[Coroutine[object, object, T]]) -> list[T]:
    """Run all, cancel the rest as soon as one fails, and raise that failure itself
    (not an ExceptionGroup), so the error a user sees names the real cause."""
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(c) for c in coros]
    except ExceptionGroup as group:
        first = group.exceptions[0]
        while isinstance(first, ExceptionGroup):
            first = first.exceptions[0]
        raise first from None
    return [t.result() for t in tasks]

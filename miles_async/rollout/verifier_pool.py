"""Reward verifiers in worker processes, each call under a deadline.

math-verify guards itself with SIGALRM, which works only on a process's main thread. The rollout
executor scores samples on a Ray actor's event-loop thread, where that guard is off, and one
pathological answer (``9^{9^{9}}``) then computes for hours while generation waits. Here the
verifier runs on the main thread of a persistent worker process; the caller awaits the answer
without blocking its event loop and, past the deadline, kills the worker, which also stops work
stuck inside C code that no signal interrupts. The next call starts a fresh worker.
"""

from __future__ import annotations

import asyncio
import importlib
import multiprocessing
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

# Starting a worker (a fresh interpreter importing sympy) is not the verifier's time.
STARTUP_TIMEOUT_S = 120.0


class VerifierTimeout(Exception):
    pass


class VerifierError(RuntimeError):
    pass


def _serve(conn: Connection, preload: tuple[str, ...]) -> None:
    for module in preload:
        importlib.import_module(module)
    conn.send("ready")
    while True:
        try:
            fn, args = conn.recv()
        except EOFError:  # the owner closed its end, or died
            return
        try:
            reply = (True, fn(*args))
        except Exception:  # noqa: BLE001 - the caller's error policy decides, with the traceback
            reply = (False, traceback.format_exc())
        conn.send(reply)


async def _receive(conn: Connection, timeout: float) -> Any:
    """The next message on ``conn``, awaited without a thread; ``asyncio.TimeoutError`` past ``timeout``."""
    loop = asyncio.get_running_loop()
    readable = loop.create_future()
    loop.add_reader(conn.fileno(), lambda: readable.done() or readable.set_result(None))
    try:
        await asyncio.wait_for(readable, timeout)
    finally:
        loop.remove_reader(conn.fileno())
    return conn.recv()


class _Worker:
    def __init__(self, preload: tuple[str, ...]):
        ctx = multiprocessing.get_context("spawn")  # no fork of a threaded Ray worker
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, preload), name="miles-async-verifier", daemon=True)
        self.process.start()
        child.close()
        self.ready = False

    def stop(self) -> None:
        self.process.kill()
        self.process.join(5)
        self.conn.close()


class VerifierPool:
    """At most ``size`` calls at once, each in its own worker process and limited to ``deadline`` seconds."""

    def __init__(self, size: int, deadline: float, preload: tuple[str, ...] = ()):
        self.size = size
        self.deadline = deadline
        self.preload = preload
        self._idle: list[_Worker] = []
        self._slots: asyncio.Semaphore | None = None

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in a worker (both picklable); ``VerifierTimeout`` past the deadline, ``VerifierError``
        with the worker's traceback if it raised or died."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.size)
        async with self._slots:
            worker = self._idle.pop() if self._idle else _Worker(self.preload)
            try:
                ok, value = await self._call(worker, fn, args)
            except BaseException:
                worker.stop()  # a worker that did not answer may still be computing: never reuse it
                raise
            self._idle.append(worker)
        if not ok:
            raise VerifierError(f"verifier raised in its worker process:\n{value}")
        return value

    async def _call(self, worker: _Worker, fn: Callable[..., Any], args: tuple) -> tuple[bool, Any]:
        try:
            if not worker.ready:
                await _receive(worker.conn, STARTUP_TIMEOUT_S)
                worker.ready = True
            worker.conn.send((fn, args))
            return await _receive(worker.conn, self.deadline)
        except TimeoutError:
            what = "call" if worker.ready else "start"
            raise VerifierTimeout(
                f"verifier {what} took longer than {self.deadline if worker.ready else STARTUP_TIMEOUT_S:.0f} s"
            ) from None
        except EOFError:
            worker.process.join(5)
            raise VerifierError(f"verifier worker exited with code {worker.process.exitcode}") from None

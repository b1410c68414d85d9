"""Reward verifiers in worker processes, each call under a deadline.

math-verify guards itself with SIGALRM, which works only on a process's main thread. The rollout
executor scores samples on a Ray actor's event-loop thread, where that guard is off, and one
pathological answer (``9^{9^{9}}``) then computes for hours while generation waits. Here the
verifier runs on the main thread of a persistent worker process; the caller awaits the answer
without blocking its event loop and, past the deadline, kills the worker, which also stops work
stuck inside C code that no signal interrupts. The next call starts a fresh worker.

Workers start like tool workers (``rollout.sandbox``, without resource limits: the verifier is our code): an
allowlisted environment, their own session and folder, a parent-death signal, no inherited descriptors.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from miles_async.rollout.sandbox import Sandboxed

# Starting a worker (a fresh interpreter importing sympy) is not the verifier's time.
STARTUP_TIMEOUT_S = 120.0


class VerifierTimeout(Exception):
    pass


class VerifierError(RuntimeError):
    pass


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
        from miles_async.config.tools import SandboxConfig

        ours, theirs = socket.socketpair()
        try:
            argv = [sys.executable, "-m", "miles_async.rollout.verifier_worker", *preload]
            self.box = Sandboxed(argv, SandboxConfig(mode="none"), stdio=theirs)
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        self.ready = False

    def stop(self) -> int | None:
        self.conn.close()  # first: an idle worker ends at the end of its input
        return self.box.kill()


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

    def close(self) -> None:
        """Kill the idle workers (a call in flight kills its own on the way out)."""
        idle, self._idle = self._idle, []
        for worker in idle:
            worker.stop()

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
            try:
                code = worker.box.proc.wait(5)
            except subprocess.TimeoutExpired:
                code = None
            raise VerifierError(f"verifier worker exited with code {code}") from None

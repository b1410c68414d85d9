"""Ports for tests, without races: nothing here picks a port number that another process could take first.

- ``refused_port``: a port held bound but never listening, so connections to it are refused and no other
  process can take it while the test runs (the ``refused_port`` fixture in tests/conftest.py).
- ``spawn_ranks``: workers in spawned processes that join a torch.distributed store this process serves on a port
  the kernel picked (``miles_async.utils.ports.hosted_store``): the training workers as clients
  (``join_process_group``), a ``tcp://`` init of their own through ``AGENT_STORE_ENV`` (benchmarks/train_memory.py
  starts its own such workers).

Our servers in tests bind port 0 themselves (tests/reward_server.py) or listen on a socket bound for them
(``miles_async.utils.ports.bound_socket``; tests/integration/embedded/helpers.py).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator

from miles_async.utils.ports import bound_socket, hosted_store

# torch's tcp:// rendezvous: with this set, every rank (rank 0 too) joins the store at the address as a client
# (torch.distributed.rendezvous._create_c10d_store), instead of rank 0 binding the port itself.
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"


@contextlib.contextmanager
def refused_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A port on ``host`` that refuses connections while the block runs."""
    with bound_socket(host) as s:
        yield s.getsockname()[1]


def _join_store(env: dict[str, str], target: Callable, rank: int, world: int, port: int, *args) -> None:
    os.environ.clear()  # the caller's environment, not the one the fork server started with
    os.environ.update(env, **{AGENT_STORE_ENV: "True"})
    target(rank, world, port, *args)


# Imported once, in the fork server each rank is forked from, instead of once per rank: torch with megatron-core
# costs about 7 s of CPU to import, and the suite starts ranks dozens of times.
_PRELOAD = ("torch", "torch.distributed", "megatron.core", "transformers", "miles_async.backends.megatron.actor")


def _rank_context(target: Callable):
    """A ``forkserver`` context whose server (one per test process, started on first use) has the heavy modules
    and ``target``'s module imported. Only imports happen there, so no thread or process group is forked."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([*_PRELOAD, target.__module__])  # no effect once the server runs
    return ctx


def spawn_ranks(target: Callable, world: int, *args, timeout: float = 240) -> list[int]:
    """Run ``target(rank, world, port, *args)`` in ``world`` spawned processes, whose process group at
    ``127.0.0.1:port`` joins a store hosted here; their exit codes, once all exited or ``timeout`` seconds passed
    (those still running then are killed: -9). ``target`` must be importable (a module-level function)."""
    store = hosted_store("127.0.0.1", timeout)  # served until the ranks are done
    ctx = _rank_context(target)
    procs = [
        ctx.Process(target=_join_store, args=(dict(os.environ), target, rank, world, store.port, *args))
        for rank in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(10)
    return [p.exitcode for p in procs]

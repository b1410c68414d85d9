"""Ports without races.

A port number picked here and handed to another process can be taken by any process on the machine before that
process binds it. So our own servers never take a number picked for them: they bind port 0 and say which port
the kernel gave them, or listen on a socket their launcher bound and hands them (``bound_socket``), so the port is
theirs before they start; a torch.distributed rendezvous is a store its host serves on port 0 (``hosted_store``),
which the ranks join as clients. Servers we start but do not write (SGLang, vLLM, SGLang's router, ``ray start``) take a
port number on their command line, and open more ports derived from it; for them ``free_port`` picks one, and a
start that fails because a port was taken is started again on a fresh one, a bounded number of times
(``start_again``); any other failure is not.

``port_clash`` and ``start_again`` are the pure policy; the launchers (``inference/launcher.py``,
``inference/router.py``) do the starting, waiting and logging.
"""

from __future__ import annotations

import re
import socket
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed import TCPStore

PORT_ATTEMPTS = 3  # starts of a server, the first included, before a port clash fails it

# What servers print when a port they bind is taken: the OS's EADDRINUSE (Python, uvicorn, asyncio, gRPC: Ray,
# vLLM, SGLang's HTTP port), and SGLang's own checks of the ports it derives from --port.
_CLASH = re.compile(
    r"address already in use|EADDRINUSE|errno 98\b|port is already in use|\bport \d+ is in use"
    r"|\w+port\w* at \d+ is not available",
    re.IGNORECASE,
)


def port_clash(output: str) -> bool:
    """Whether a server's output says it could not bind a port because another process holds it."""
    return _CLASH.search(output) is not None


def start_again(attempt: int, output: str, attempts: int = PORT_ATTEMPTS) -> bool:
    """Whether a server whose ``attempt``-th start (1 for the first) failed with ``output`` is started again on a
    fresh port: only after a port clash, and at most ``attempts`` starts in all."""
    return attempt < attempts and port_clash(output)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, for a server that cannot bind port 0 itself; another process may take it
    before that server binds it (see ``start_again``)."""
    with socket.socket(_family(host)) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def bound_socket(host: str = "127.0.0.1") -> socket.socket:
    """A TCP socket bound to a port the kernel picked on ``host``, not yet listening, for a child server to listen
    on: connections are refused until the server listens, and no other process can bind the port meanwhile
    (no SO_REUSEADDR, so even a process that sets it cannot share the port)."""
    s = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        s.bind((host, 0))
    except BaseException:
        s.close()
        raise
    return s


def hosted_store(host: str, timeout: float, world_size: int | None = None) -> TCPStore:
    """A ``torch.distributed.TCPStore`` this process serves, on every interface, on a port the kernel picked
    (``.port``), while it is referenced: the ranks it is a rendezvous for are told that port once it is theirs,
    and join as clients (``is_master=False``). ``host`` is where this process's own client reaches it."""
    import torch.distributed as dist

    return dist.TCPStore(
        host, 0, world_size, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout)
    )


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET

"""The embedded engine's server (``python -m miles_async.inference.embedded.server``) as a child process.

It listens on a socket bound here, on a port the kernel picked (``--listen-fd``): the port is known before the
server starts and no other process can take it meanwhile, so it never needs starting again on another."""

from __future__ import annotations

import socket
import sys

from miles_async.inference.launcher import EngineProcess
from miles_async.utils.ports import bound_socket


class EmbeddedEngineProcess(EngineProcess):
    """One embedded engine server, run by this interpreter."""

    _socket: socket.socket | None = None  # bound here until the server it is handed to has started

    def pick_port(self) -> int:
        self._close_socket()
        self._socket = bound_socket(self.cfg.host)
        return self._socket.getsockname()[1]

    def pass_fds(self) -> tuple[int, ...]:
        return (self._socket.fileno(),)

    def start(self) -> None:
        if self._socket is None:  # handed to an earlier server: a fresh one, on a new port
            self.use_port(self.pick_port())
        try:
            super().start()
        finally:
            self._close_socket()  # the server holds its own copy

    def stop(self, grace: float = 5.0) -> None:
        self._close_socket()  # never started: the port goes back
        super().stop(grace)

    def _close_socket(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "miles_async.inference.embedded.server",
            "--model-path",
            self.model_path,
            "--host",
            self.cfg.host,
            "--listen-fd",
            str(self._socket.fileno()),
            "--dtype",
            self.cfg.dtype,
            "--max-running-requests",
            str(self.cfg.max_running_requests),
            "--num-threads",
            str(self.cfg.num_threads),
            "--seed",
            str(self.cfg.seed + self.index),
        ]

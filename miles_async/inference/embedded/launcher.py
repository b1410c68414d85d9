"""The embedded engine's server (``python -m miles_async.inference.embedded.server``) as a child process."""

from __future__ import annotations

import sys

from miles_async.inference.launcher import EngineProcess


class EmbeddedEngineProcess(EngineProcess):
    """One embedded engine server, run by this interpreter."""

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "miles_async.inference.embedded.server",
            "--model-path",
            self.model_path,
            "--host",
            self.cfg.host,
            "--port",
            str(self.port),
            "--dtype",
            self.cfg.dtype,
            "--max-running-requests",
            str(self.cfg.max_running_requests),
            "--num-threads",
            str(self.cfg.num_threads),
            "--seed",
            str(self.cfg.seed + self.index),
        ]

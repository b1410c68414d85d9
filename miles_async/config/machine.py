"""What only the machine that runs the job can tell: the packages installed there (megatron-core, Transformer
Engine, sglang-router, wandb, an engine's interpreter) and its GPUs.

Every check that looks at the local machine goes through one ``Machine``. On a run a missing requirement fails
like any other check. Under ``--check-config``, which may run anywhere (a login node, a laptop), it is a warning
naming what the job's machine must have, and the check goes on.
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

from miles_async.config.declare import ConfigError, module_installed

# Present wherever an NVIDIA driver is loaded (the second on some containers that mount only the devices).
NVIDIA_DRIVER_FILES = ("/proc/driver/nvidia/version", "/dev/nvidiactl")


class Machine:
    def __init__(self, check_config: bool = False):
        self.check_config = check_config
        self.warnings: list[str] = []

    def require(self, ok: bool, problem: str) -> None:
        """A requirement of the run on this machine: an error, or under --check-config a warning."""
        if ok:
            return
        if not self.check_config:
            raise ConfigError(problem)
        self.warnings.append(f"{problem} (missing on this machine; the machine that runs the job needs it)")

    def expect(self, ok: bool, problem: str) -> None:
        """Something the run finds out for itself later (with a better message), said now as a warning."""
        if not ok:
            self.warnings.append(problem)

    @staticmethod
    def has_module(module: str) -> bool:
        return module_installed(module)

    @staticmethod
    def cuda_devices() -> int:
        """CUDA devices visible here (0 without a CUDA build of torch)."""
        if not any(Path(p).exists() for p in NVIDIA_DRIVER_FILES):
            return 0  # no NVIDIA driver: no need to import torch (seconds of start-up on a laptop) to know
        try:
            import torch
        except ImportError:
            return 0
        return torch.cuda.device_count() if torch.cuda.is_available() else 0

    @staticmethod
    @functools.cache
    def python_has(python: str, module: str) -> bool:
        """Whether ``python`` (an engine's interpreter) exists and finds ``module``, without importing it."""
        if not Path(python).exists():
            return False
        code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
        try:
            return subprocess.run([python, "-c", code], capture_output=True, timeout=60).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False

"""The processes that never touch a tensor start without torch: the driver (``train_async.py`` and its
``--check-config``), the inference controller and the rollout executor. Importing torch costs
each process seconds of CPU, which every run pays at start-up and a laptop's two cores feel."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.scripts.helpers import ROOT

TORCH_FREE = (
    "train_async",
    "miles_async.run",
    "miles_async.ray.inference_controller",
    "miles_async.ray.rollout_executor",
)


@pytest.mark.parametrize("module", TORCH_FREE)
def test_the_processes_that_never_touch_a_tensor_import_no_torch(module):
    probe = f"import sys, {module}; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", f"importing {module} imports {proc.stdout.strip()}"


def test_parsing_and_checking_a_run_imports_no_torch(tiny_model, tiny_task, tmp_path):
    """``--check-config`` and the driver's own start: building the config needs no torch on a machine without an
    NVIDIA driver and whose CPU flags rule out bf16 arithmetic (elsewhere torch is asked, and must be)."""
    from miles_async.config import precision
    from miles_async.config.machine import NVIDIA_DRIVER_FILES
    from tests.e2e.runner import tiny_args

    if any(Path(f).exists() for f in NVIDIA_DRIVER_FILES):
        pytest.skip("an NVIDIA driver is loaded here: torch counts the GPUs")
    flags = precision._cpu_flags()
    if flags is None or any(f.startswith(precision._BF16_CAPABLE_FLAGS) for f in flags):
        pytest.skip("this CPU may compute bf16: torch's own check decides")

    run_flags = [*tiny_args(tiny_model, tiny_task, tmp_path / "out"), "--num-rollout", "2", "--check-config"]
    probe = (
        "import sys, train_async; rc = train_async.cli(sys.argv[1:]); "
        "print('LOADED', sorted(m for m in ('torch', 'transformers') if m in sys.modules)); sys.exit(rc)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe, *run_flags], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "LOADED []", proc.stdout[-2000:]

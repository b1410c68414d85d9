"""The processes that never touch a tensor start without torch: the driver (``train_async.py``, its
``--check-config`` and ``--help`` too), the inference controller and the rollout executor. Importing torch costs
each process seconds of CPU, which every run pays at start-up and a laptop's two cores feel."""

from __future__ import annotations

import subprocess
import sys

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
    """``--check-config`` and the driver's own start: building the config (GPU count included, on a machine
    without an NVIDIA driver) needs no torch."""
    from tests.e2e.runner import tiny_args

    flags = [*tiny_args(tiny_model, tiny_task, tmp_path / "out"), "--num-rollout", "2", "--check-config"]
    probe = (
        "import sys, train_async; rc = train_async.cli(sys.argv[1:]); "
        "print('LOADED', sorted(m for m in ('torch', 'transformers') if m in sys.modules)); sys.exit(rc)"
    )
    proc = subprocess.run([sys.executable, "-c", probe, *flags], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "LOADED []", proc.stdout[-2000:]

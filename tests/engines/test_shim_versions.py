"""The engines' start-up shims in the engines' own environments: each patch's package is installed there at the
version the patch was written against (utils/upstream_patches.py), and the shims apply without a word on stderr."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from miles_async.utils.upstream_patches import PATCHES, base_version

ROOT = Path(__file__).resolve().parents[2]

_VERSIONS = "import importlib.metadata as m, json, sys; print(json.dumps({p: m.version(p) for p in sys.argv[1:]}))"


def test_each_shim_is_applied_on_the_version_it_was_written_against(backend, engine_python):
    patches = [p for p in PATCHES if p.env == backend]
    packages = sorted({p.package for p in patches})
    assert packages, f"no patch is registered for {backend}'s environment"
    shims = ROOT / "miles_async" / "inference" / backend / "cpu_shims"
    # As the launcher starts the engine on a CPU: its shims and the checkout on PYTHONPATH, SGLang's CPU engine on.
    env = dict(os.environ, PYTHONPATH=f"{shims}{os.pathsep}{ROOT}", SGLANG_USE_CPU_ENGINE="1")
    code = f"{_VERSIONS}\nimport torch; print([hasattr(torch.ops.torchvision, op) for op in ('nms', 'qnms')])"
    run = subprocess.run([engine_python, "-c", code, *packages], env=env, capture_output=True, text=True, timeout=90)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "miles-async" not in run.stderr, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    installed = json.loads(lines[0])
    assert {p: base_version(v) for p, v in installed.items()} == {p.package: p.version for p in patches}
    assert lines[1] == "[True, True]"  # declared by the shim at start-up

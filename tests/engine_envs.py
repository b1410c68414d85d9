"""The real engines' own environments (SGLang's, vLLM's), built before the first test that needs them.

``scripts/setup_<engine>_env.sh`` builds each once into the cache (minutes and gigabytes on a fresh machine) and
then only prints its path. The root conftest calls :func:`prepare` once the tests are collected, for the engines
the selected tests are marked with, building them side by side and outside every test's time cap. A test that
needs an engine then gets its interpreter from :func:`engine_python`, which fails (never skips) with the build
log's tail where the build failed.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENGINES = ("sglang", "vllm")
BUILD_TIMEOUT_S = 2400  # SGLang's from nothing: 3-8 minutes here, far longer on a slow mirror

_pythons: dict[str, str] = {}
_failures: dict[str, str] = {}


def prepare(engines: set[str], report=print) -> None:
    """Build (or find) each of ``engines``' environments, all at once; remember each interpreter or failure."""
    todo = sorted(e for e in engines if e not in _pythons and e not in _failures)
    if not todo:
        return
    started = time.monotonic()
    procs = {
        e: subprocess.Popen(
            ["bash", str(ROOT / "scripts" / f"setup_{e}_env.sh")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for e in todo
    }
    for engine, proc in procs.items():
        script = f"scripts/setup_{engine}_env.sh"
        try:
            out, err = proc.communicate(timeout=max(1.0, BUILD_TIMEOUT_S - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            _failures[engine] = f"{script} did not finish in {BUILD_TIMEOUT_S} s:\n{err[-4000:]}"
            continue
        if proc.returncode != 0:
            _failures[engine] = f"{script} failed (exit {proc.returncode}):\n{err[-4000:]}"
            continue
        python = Path(out.strip().splitlines()[-1]) / "bin" / "python"
        if not python.exists():
            _failures[engine] = f"{script} printed {out.strip()!r}, which has no bin/python"
            continue
        _pythons[engine] = str(python)
    took = time.monotonic() - started
    report(
        f"engine environments: {', '.join(todo)} ready or failed in {took:.0f} s"
        + "".join(f"; {e} FAILED" for e in todo if e in _failures)
    )


def engine_python(engine: str) -> str:
    """The interpreter of ``engine``'s environment (built now if collection did not ask for it)."""
    if engine not in _pythons and engine not in _failures:
        prepare({engine}, report=lambda line: print(line, file=sys.stderr))
    if engine in _failures:
        pytest.fail(_failures[engine], pytrace=False)
    return _pythons[engine]

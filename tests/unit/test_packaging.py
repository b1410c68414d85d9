"""What an installed miles_async holds: a wheel built from this checkout, as `pip install .` builds it."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.scripts.helpers import ROOT

# Standard-library names that first appeared in Python 3.11.
PY311_NAMES = {"TaskGroup", "ExceptionGroup", "BaseExceptionGroup", "cancelling", "tomllib"}


def _production_files() -> list[Path]:
    return [ROOT / "train_async.py", *sorted((ROOT / "miles_async").rglob("*.py"))]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    # Built from a copy of the files git would commit, so the build leaves nothing in the checkout.
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = out.glob("miles_async-*.whl")
    return zipfile.ZipFile(path)


def test_the_wheel_ships_the_engines_cpu_stand_ins(wheel) -> None:
    from miles_async.inference.sglang.launcher import cpu_shims_dir
    from miles_async.inference.vllm.launcher import CPU_SHIMS as VLLM_SHIMS

    names = set(wheel.namelist())
    shims = cpu_shims_dir().relative_to(ROOT).as_posix()
    assert f"{shims}/sitecustomize.py" in names and f"{shims}/sgl_kernel/__init__.py" in names
    assert f"{VLLM_SHIMS.relative_to(ROOT).as_posix()}/sitecustomize.py" in names
    assert not any(n.startswith("tests/") for n in names)


def test_requires_python_covers_what_the_code_uses(wheel) -> None:
    (meta,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    required = re.search(r"^Requires-Python: >=(\d+)\.(\d+)$", wheel.read(meta).decode(), re.M)
    assert required, "no Requires-Python in the wheel's metadata"
    used = set()
    for path in _production_files():
        for node in ast.walk(ast.parse(path.read_text())):
            name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
            if name in PY311_NAMES:
                used.add(f"{path.relative_to(ROOT)}: {name}")
    assert used, "the scan found no 3.11 name: the table above is out of date"
    assert (int(required[1]), int(required[2])) >= (3, 11), sorted(used)[:5]


def test_production_code_never_reaches_into_tests() -> None:
    offenders = []
    for path in _production_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tests":
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {node.module}")
            elif isinstance(node, ast.Import) and any(a.name.split(".")[0] == "tests" for a in node.names):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} imports tests")
            elif isinstance(node, ast.Constant) and node.value == "tests":
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} names the tests folder")
    assert offenders == []

"""The patches of other packages' code (utils/upstream_patches.py) know the version they were written against.

The versions the engines' environments install are checked in tests/engines/test_shim_versions.py (those
environments are built before the engine tests only), cpu_compat's replacements and their undoing in
tests/unit/test_cpu_compat.py; this file checks the pins and the project's own environment, and that a stale or
failing patch is reported.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from miles_async.utils import upstream_patches
from miles_async.utils.upstream_patches import PATCHES, WRITTEN_AGAINST, base_version

ROOT = Path(__file__).resolve().parents[2]


def _pin(path: str, package: str) -> str:
    found = re.findall(rf"^\s*{re.escape(package)}==([\w.]+)", (ROOT / path).read_text(), flags=re.MULTILINE)
    assert len(found) == 1, f"{path} pins {package} {len(found)} times"
    return found[0]


def test_every_patched_package_is_pinned_and_installed_at_the_version_its_patches_were_written_against():
    pinned = {
        "torch": re.search(r"torch==([\w.]+)", (ROOT / "scripts/lib/torch_install.sh").read_text()).group(1),
        "megatron-core": _pin("requirements-megatron.txt", "megatron-core"),
        "sglang": _pin("requirements-sglang.txt", "sglang"),
        "torchvision": _pin("requirements-sglang.txt", "torchvision"),
    }
    assert {p.package for p in PATCHES} == set(pinned) == set(WRITTEN_AGAINST)
    assert pinned == WRITTEN_AGAINST, "a pin moved: review the patches of utils/upstream_patches.py, then record it"
    installed = {p.package: importlib.metadata.version(p.package) for p in PATCHES if p.env == "main"}
    assert {k: base_version(v) for k, v in installed.items()} == {k: WRITTEN_AGAINST[k] for k in installed}


def test_each_registered_patch_is_applied_where_the_registry_says():
    for p in PATCHES:
        source = (ROOT / p.by).read_text()
        assert p.target.rsplit(".", 1)[-1] in source, f"{p.by} does not name {p.target}"


def test_a_patch_applied_on_another_version_says_so_on_stderr(monkeypatch, capsys):
    """The installed torch against a registry that recorded another version (as after an upgrade)."""
    monkeypatch.setitem(WRITTEN_AGAINST, "torch", "2.0.0")
    monkeypatch.setattr(upstream_patches, "_warned", set())
    upstream_patches.check("torch.cuda.current_device", "main")
    upstream_patches.check("torch.cuda.synchronize", "main")
    err = capsys.readouterr().err
    assert err.count("\n") == 1  # once per package
    assert f"torch.cuda.current_device ({'miles_async/backends/megatron/cpu_compat.py'}) was written against " in err
    assert f"torch 2.0.0, but torch {torch.__version__} is installed" in err


def test_a_failing_engine_shim_is_written_to_stderr_naming_it(tmp_path):
    """SGLang's start-up shims in a process whose ``sglang.srt.mem_cache.pool_host.common`` lacks the table the shim
    patches (as a later SGLang might): a stand-in module of that name, since SGLang is not installed here."""
    module = tmp_path / "sglang" / "srt" / "mem_cache" / "pool_host" / "common.py"
    module.parent.mkdir(parents=True)
    module.write_text("LOADED = True\n")
    shims = ROOT / "miles_async" / "inference" / "sglang" / "cpu_shims"
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_USE_CPU_ENGINE"}
    env["PYTHONPATH"] = os.pathsep.join([str(shims), str(ROOT), str(tmp_path)])
    code = "import sglang.srt.mem_cache.pool_host.common as m; print(m.LOADED)"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "True", run.stderr
    assert (
        "miles-async CPU shim 'sglang.srt.mem_cache.pool_host.common (after import)' failed: PatchTargetMissing: "
        "sglang.srt.mem_cache.pool_host.common.ALLOC_MEMORY_FUNCS, patched by "
        "miles_async/inference/sglang/cpu_shims/sitecustomize.py (written against sglang 0.5.23): module "
        "sglang.srt.mem_cache.pool_host.common has no ALLOC_MEMORY_FUNCS"
    ) in run.stderr, run.stderr
    assert "written against sglang 0.5.23, but sglang is not installed" in run.stderr

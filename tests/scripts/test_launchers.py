"""Every launcher's --dry-run output against a stored expected command (tests/scripts/golden),
and the printed command is exactly the one the launcher runs without --dry-run.

Regenerate the golden files after an intended change with:
    UPDATE_GOLDEN=1 python -m pytest tests/scripts/test_launchers.py
"""

from __future__ import annotations

import difflib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.scripts.helpers import GOLDEN, ROOT, STUBS

# name -> (launcher, environment, extra arguments). Paths in the environment are fixed
# strings (they need not exist for a dry run); the repository path is normalised to <repo>.
CASES = {
    "run-smollm2-cpu-async": (
        "scripts/run-smollm2-cpu-async.sh",
        {"MODEL": "/models/SmolLM2-135M-Instruct", "DATA": "/data/mul", "OUT": "/runs/smollm2-mul"},
        [],
    ),
    "run-smollm2-cpu-async-overrides": (
        "scripts/run-smollm2-cpu-async.sh",
        {
            "MODEL": "/models/SmolLM2-135M-Instruct",
            "DATA": "/data/mul",
            "OUT": "/runs/with space",
            "RAY_ADDRESS": "head-node:6379",
        },
        ["--num-rollout", "5", "--eval-prompt-data", "my eval", "/data/e v.jsonl"],
    ),
    "run-qwen3-4B-async": (
        "scripts/run-qwen3-4B-async.sh",
        {
            "HF_CHECKPOINT": "/models/Qwen3-4B",
            "DATA_DIR": "/data",
            "SAVE_DIR": "/ckpt/qwen3-4B",
            "OUT": "/runs/qwen3-4B",
        },
        [],
    ),
}
# The Slurm script's dry run: scontrol (stubbed here) expands the node list; nothing starts.
SBATCH_CASES = {
    "slurm-train-async": (
        "scripts/slurm/train-async.sbatch",
        {
            "SLURM_JOB_NODELIST": "gpu1,gpu2,gpu3",
            "SLURM_JOB_NAME": "qwen3",
            "SAVE_DIR": "/ckpt/qwen3",
            "PATH": f"{STUBS}{os.pathsep}{os.environ.get('PATH', '')}",
        },
        [],
    ),
    "slurm-train-async-command": (
        "scripts/slurm/train-async.sbatch",
        {
            "SLURM_JOB_NODELIST": "gpu1",
            "SAVE_DIR": "/ckpt/q",
            "GPUS_PER_NODE": "4",
            "HEAD_NODE_IP": "10.1.2.3",
            "RAY_INCLUDE_DASHBOARD": "false",
            "PATH": f"{STUBS}{os.pathsep}{os.environ.get('PATH', '')}",
        },
        ["bash", "scripts/run-qwen3-4B-async.sh", "--num-rollout", "500"],
    ),
}


def _env(extra: dict) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "RAY_ADDRESS",
            "MODEL",
            "DATA",
            "OUT",
            "HF_CHECKPOINT",
            "DATA_DIR",
            "SAVE_DIR",
            "HEAD_NODE_IP",
            "GPUS_PER_NODE",
            "MILES_ASYNC_ROOT",
        )
        and not k.startswith(("SLURM_", "RAY_"))
    }
    return {**env, "PYTHON": "python3", **extra}


def _run(script: str, env: dict, args: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ROOT / script), *args], env=env, cwd="/", capture_output=True, text=True, timeout=timeout
    )


def _words(command: str) -> list[str]:
    """Split a printed command the way bash does (quotes, escapes, line continuations)."""
    proc = subprocess.run(
        ["bash", "-c", 'eval "words=( $1 )" && printf "%s\\0" "${words[@]}"', "_", command],
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    )
    return proc.stdout.split("\0")[:-1]


def _normalise(text: str) -> str:
    return text.replace(str(ROOT), "<repo>")


# The Qwen3 launcher's command is checked by running it through train_async.py --check-config with its model's
# published config.json (test_check_config.py), not by a golden file.
GOLDEN_CASES = sorted(set(CASES) - {"run-qwen3-4B-async"} | set(SBATCH_CASES))


@pytest.mark.parametrize("name", GOLDEN_CASES)
def test_dry_run_matches_golden(name):
    script, env, args = {**CASES, **SBATCH_CASES}[name]
    proc = _run(script, _env(env), ["--dry-run", *args])
    assert proc.returncode == 0, proc.stderr
    got = _normalise(proc.stdout)
    golden = GOLDEN / f"{name}.txt"
    if os.environ.get("UPDATE_GOLDEN") == "1":
        golden.write_text(got)
    assert golden.exists(), f"no golden file {golden}; run with UPDATE_GOLDEN=1 to create it"
    want = golden.read_text()
    diff = "".join(difflib.unified_diff(want.splitlines(True), got.splitlines(True), "golden", "dry-run"))
    assert got == want, f"--dry-run output of {script} changed (UPDATE_GOLDEN=1 accepts it):\n{diff}"
    # A dry run starts nothing and writes nothing.
    assert not Path(env.get("OUT") or env["SAVE_DIR"]).exists()


@pytest.mark.parametrize("name", sorted(CASES))
def test_dry_run_prints_exactly_what_runs(name, tmp_path):
    """Run the launcher for real with PYTHON pointing at a recorder: the argv it receives must
    equal the dry-run text split by bash, so quoting and order survive the printing."""
    script, env, args = CASES[name]
    record = tmp_path / "argv.json"
    recorder = tmp_path / "python3"
    recorder.write_text(
        f"#!{sys.executable}\nimport json, sys\nopen({str(record)!r}, 'w').write(json.dumps(sys.argv[1:]))\n"
    )
    recorder.chmod(0o755)
    dry = _run(script, _env({**env, "PYTHON": str(recorder)}), ["--dry-run", *args])
    assert dry.returncode == 0, dry.stderr
    assert not record.exists()
    real = _run(script, _env({**env, "PYTHON": str(recorder)}), args)
    assert real.returncode == 0, real.stderr
    printed = _words(dry.stdout)
    # The launcher may wrap python in `env VAR=...`; the recorder sees what follows python.
    assert printed[printed.index(str(recorder)) + 1 :] == json.loads(record.read_text())
    if printed[0] == "env":
        assert all("=" in word for word in printed[1 : printed.index(str(recorder))])


def test_cpu_launcher_flags_are_all_known_to_train_async():
    from miles_async.arguments import build_parser

    script, env, args = CASES["run-smollm2-cpu-async"]
    words = _words(_run(script, _env(env), ["--dry-run"]).stdout)
    assert words[:2] == ["python3", str(ROOT / "train_async.py")]
    _, unknown = build_parser().parse_known_args(words[2:])
    assert unknown == []


def test_extra_flags_override_the_defaults():
    from miles_async.arguments import build_parser

    script, env, args = CASES["run-smollm2-cpu-async-overrides"]
    words = _words(_run(script, _env(env), ["--dry-run", *args]).stdout)
    ns = build_parser().parse_args(words[2:])
    assert ns.num_rollout == 5 and ns.ray_address == "head-node:6379"
    assert ns.eval_prompt_data == ["my eval", "/data/e v.jsonl"]
    assert ns.save == "/runs/with space/ckpt"


def test_qwen3_launcher_resumes_when_a_checkpoint_exists(tmp_path):
    script, env, _ = CASES["run-qwen3-4B-async"]
    save = tmp_path / "ckpt"
    words = _words(_run(script, _env({**env, "SAVE_DIR": str(save)}), ["--dry-run"]).stdout)
    assert "--load" not in words
    save.mkdir()
    (save / "latest_checkpointed_iteration.txt").write_text("3")
    words = _words(_run(script, _env({**env, "SAVE_DIR": str(save)}), ["--dry-run"]).stdout)
    assert words[words.index("--load") + 1] == str(save)


def test_launchers_name_what_is_missing():
    proc = _run("scripts/run-smollm2-cpu-async.sh", _env({"DATA": "/data"}), ["--dry-run"])
    assert proc.returncode != 0 and "set MODEL" in proc.stderr

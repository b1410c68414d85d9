"""The quickstart side-by-side benchmark's pure parts: the older launcher made float32, the medians it reports."""

import subprocess

import pytest

from benchmarks.common import ROOT, ensure_commit
from benchmarks.quickstart_speed import DEFAULT_BASELINE, float32_launcher, summarize


def test_the_baseline_launcher_asks_for_float32_and_keeps_every_other_flag():
    """The baseline's launcher is read from git: a shallow clone fetches the commit (ensure_commit) or fails
    saying how to get it, never skips."""
    text = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{ensure_commit(DEFAULT_BASELINE)}:scripts/run-smollm2-cpu-async.sh"],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout  # fmt: skip
    assert "--bf16" in text.split() and "bfloat16" in text
    out = float32_launcher(text)
    assert "--bf16" not in out.split() and "bfloat16" not in out
    assert "--rollout-dtype float32" in out
    dropped = set(text.splitlines()) - set(out.splitlines())
    assert {line.strip() for line in dropped} == {"--bf16", "--rollout-dtype bfloat16"}


def test_a_launcher_without_a_rollout_dtype_gets_float32_for_the_embedded_engine():
    out = float32_launcher("ENGINE_ARGS=(\n  --rollout-backend embedded\n)\nOPT=(\n  --bf16\n)")
    assert "--rollout-backend embedded\n  --rollout-dtype float32" in out and "--bf16" not in out


def test_summary_leaves_out_the_first_step_and_takes_medians():
    rows = [
        {"time/step_seconds": 100.0, "train/seconds": 90.0, "weights/update_seconds": 5.0},
        {"time/step_seconds": 10.0, "train/seconds": 8.0, "weights/update_seconds": 1.0},
        {"time/step_seconds": 14.0, "train/seconds": 9.0, "weights/update_seconds": 3.0},
        {"time/step_seconds": 12.0, "train/seconds": 30.0, "weights/update_seconds": 2.0},
    ]
    s = summarize(rows)
    assert s == {"steps": 3, "step": 12.0, "train": 9.0, "weight update": 2.0}
    assert summarize([{"time/step_seconds": 1.0}, {"time/step_seconds": 2.0}])["weight update"] is None


def test_a_shallow_clone_fetches_the_baseline_or_says_how_to_get_it(tmp_path):
    clone = tmp_path / "clone"
    source = f"file://{ROOT}"
    subprocess.run(["git", "clone", "-q", "--depth", "1", source, str(clone)], check=True, timeout=120)
    assert ensure_commit(DEFAULT_BASELINE, clone) == DEFAULT_BASELINE
    subprocess.run(["git", "-C", str(clone), "cat-file", "-e", f"{DEFAULT_BASELINE}^{{commit}}"], check=True)
    missing = "0123456789abcdef0123456789abcdef01234567"
    with pytest.raises(RuntimeError, match=f"(?s)commit {missing} is not in .*git fetch --unshallow"):
        ensure_commit(missing, clone)

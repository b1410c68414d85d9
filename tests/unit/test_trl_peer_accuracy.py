"""Time to TRL's accuracy at a second shape: both sides get the shape's group, answer cap and prompts with the README
row's loop and schedule; kept seeds are read back only for their own flags and step count, and the entry names the
shape and the machine the seeds ran on (not the one summing them up)."""

import json

import pytest

from benchmarks import common, trl_peer
from benchmarks import trl_peer_accuracy as acc
from tests.unit.test_trl_peer import SEED_A, SEED_B

ELSEWHERE = {"cpu_model": "Other CPU", "cores": 64, "memory_gib": 512.0, "cpu_bf16": False, "torch": "2.13.0+cpu"}


def test_both_sides_run_the_shape_with_the_readme_rows_loop():
    env = {"MODEL": "/m", "DATA": "/d", "OUT": "/o", "PATH": "/usr/bin:/bin"}
    ns = trl_peer.launcher_namespace(acc.launcher_args(acc.SHAPE) + trl_peer.seed_args(2), env)
    assert trl_peer.loop_mode(ns) == "synchronous" and ns.lr_decay_iters == 60 and ns.seed == 2
    flags = dict(zip(*[iter(trl_peer.peer_args(ns))] * 2, strict=True))
    assert flags["--num-generations"] == "4" and flags["--max-completion-length"] == "32"
    # the quickstart's held-out eval (4 samples a prompt), at the shape's answer cap
    assert flags["--eval-samples"] == "4" and flags["--eval-max-new-tokens"] == "32"
    assert "'Explain your steps, then give the number.' asked" in acc.task(acc.SHAPE)


def _seed(raw: dict, seed: int, machine: dict) -> dict:
    ran = {"commit": "abc1234", "date": f"2026-12-0{seed}T00:00:00+00:00", "machine": machine, "load": [0.1, 2.0]}
    return {**raw, "launcher_args": [*acc.launcher_args(acc.SHAPE), *trl_peer.seed_args(seed)], "ran": ran}


def test_kept_seeds_are_read_back_for_their_flags_and_steps_and_keep_their_machine(tmp_path):
    folder = tmp_path / acc.SHAPE.name
    folder.mkdir()
    for seed, raw in ((1, SEED_A), (2, SEED_B)):
        (folder / f"seed-{seed}.json").write_text(json.dumps(_seed(raw, seed, ELSEWHERE)))
    entry = acc.measure(acc.SHAPE, tmp_path, (2, 1), (1, 2), run_missing=False)
    assert entry is not None and entry["seeds"] == ["1", "2"] and entry["comparison"]["trl"]["median"] == 41.0
    assert entry["task"].startswith("SmolLM2-135M at shape 32x4x40") and "2 steps of 8 prompts x 4" in entry["task"]
    # the seeds' machine, not this one's; the first date they ran at
    assert {k: entry["machine"][k] for k in ELSEWHERE} == ELSEWHERE and entry["machine"]["date"].startswith(
        "2026-12-01"
    )
    assert acc.headline(entry)[1][0].startswith("TRL GRPOTrainer peer, SmolLM2-135M at shape 32x4x40")
    # a seed cut short, a seed of other flags, a missing seed: not kept
    assert acc.measure(acc.SHAPE, tmp_path, (3, 1), (1, 2), run_missing=False) is None
    assert acc.measure(acc.SHAPE, tmp_path, (2, 1), (1, 3), run_missing=False) is None
    (folder / "seed-2.json").write_text(json.dumps({**_seed(SEED_B, 2, ELSEWHERE), "launcher_args": ["--synchronous"]}))
    assert acc.measure(acc.SHAPE, tmp_path, (2, 1), (1, 2), run_missing=False) is None


def test_runs_kept_on_two_machines_do_not_add_up():
    one = {"commit": "a", "date": "2026-12-01T00:00:00+00:00", "machine": ELSEWHERE}
    with pytest.raises(ValueError, match="different machines"):
        common.kept_machine([one, {**one, "machine": {**ELSEWHERE, "cpu_bf16": True}}])
    assert set(common.STAMPED_MACHINE) <= set(common.ran_stamp()["machine"])


def test_the_headline_gives_both_sides_accuracy_when_our_run_ends(tmp_path):
    assert acc.accuracy_at([(0, 0.2, 0.0), (1, 0.6, 40.0), (2, 1.0, 80.0)], 60.0) == pytest.approx(0.8)
    assert acc.accuracy_at([(0, 0.2, 0.0), (1, 0.6, 40.0)], 41.0) is None
    folder = tmp_path / acc.SHAPE.name
    folder.mkdir()
    for seed, raw in ((1, SEED_A), (2, SEED_B)):
        (folder / f"seed-{seed}.json").write_text(json.dumps(_seed(raw, seed, ELSEWHERE)))
    entry = acc.measure(acc.SHAPE, tmp_path, (2, 1), (1, 2), run_missing=False)
    # ours ends at 22 s (mean of 20 and 24) with 0.9; TRL's mean curve is 0.15 at 0 s and 0.6 at 42 s: 0.39 at 22 s
    what, result = acc.headline(entry)[-1]
    assert "when our 2 steps end (22 s)" in what and result == "0.90 vs 0.39"

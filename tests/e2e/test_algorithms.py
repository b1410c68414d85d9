"""Each advantage estimator learns the tiny task end to end; stale data is trained with truncated importance weights.

GRPO's learning run is test_train_async.py::test_reward_increases.
"""

from __future__ import annotations

import re

import pytest

from tests.e2e.runner import run_train, tiny_args, without_rm_type

LEARN = ["--custom-rm-path", "tests.e2e.rewards:starts_with_digit", "--rollout-max-response-len", "2", "--lr", "1e-2"]


def _args(tiny_model, tiny_task, out, *extra):
    return without_rm_type(tiny_args(tiny_model, tiny_task, out, *LEARN, *extra))


def _rises(rewards: list[float]) -> bool:
    return sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.3


def test_reinforce_plus_plus_raises_the_reward(tiny_model, tiny_task, tmp_path):
    run = run_train(
        _args(tiny_model, tiny_task, tmp_path, "--num-rollout", "12", "--advantage-estimator", "reinforce_plus_plus"),
        tmp_path,
    )
    assert run.returncode == 0, run.output[-3000:]
    rewards = [m["rollout/reward_mean"] for m in run.metrics]
    assert len(rewards) == 12 and _rises(rewards), rewards
    assert all("critic/vf_loss" not in m for m in run.metrics)


def test_ppo_with_its_critic_raises_the_reward_and_resumes(tiny_model, tiny_task, tmp_path):
    ckpt = tmp_path / "ckpt"
    ppo = [
        "--advantage-estimator",
        "ppo",
        "--critic-lr",
        "1e-3",
        "--num-critic-only-steps",
        "2",
        "--save",
        str(ckpt),
        "--save-interval",
        "6",
    ]
    run = run_train(_args(tiny_model, tiny_task, tmp_path / "a", "--num-rollout", "12", *ppo), tmp_path / "a")
    assert run.returncode == 0, run.output[-3000:]
    m = run.metrics
    rewards = [r["rollout/reward_mean"] for r in m]
    assert len(rewards) == 12 and _rises(rewards), rewards
    # The critic trains on every rollout, the actor only after the critic-only warm-up.
    assert all("critic/vf_loss" in r for r in m)
    assert [("train/pg_loss" in r) for r in m] == [False, False] + [True] * 10
    # The critic's loss falls over the run. Averaged over a few steps: one step's loss follows that batch's
    # reward spread and failed the single-step comparison in about 1 of 8 runs (0.078 -> 0.158 once).
    vf = [r["critic/vf_loss"] for r in m]
    assert sum(vf[-4:]) / 4 < sum(vf[:2]) / 2, vf
    assert (ckpt / "iter_0000005" / "critic" / "dcp" / ".metadata").exists()
    assert (ckpt / "iter_0000005" / "critic" / "train_state.pt").exists()
    resumed = run_train(
        _args(tiny_model, tiny_task, tmp_path / "b", "--num-rollout", "14", *ppo, "--load", str(ckpt)), tmp_path / "b"
    )
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert [r["step"] for r in resumed.metrics] == [13, 14]
    # The critic came back trained: its loss continues near where it was, not at the untrained start.
    assert resumed.metrics[0]["critic/vf_loss"] < m[0]["critic/vf_loss"]


@pytest.mark.parametrize(
    "old_policy", [[], ["--keep-old-actor", "--pause-generation-mode", "abort"]], ids=["recomputed", "kept"]
)
def test_stale_data_is_trained_with_truncated_importance_weights(old_policy, tiny_model, tiny_task, tmp_path):
    """Staleness up to 3 with --use-tis (clip [0.5, 1.5]). Recomputed: the trainer's old policy drifts from the
    engine's as the data ages, and TIS measures that gap and truncates it. Kept (--keep-old-actor): every stale
    version is still kept when its data trains, so the ratio to the engine stays 1. A run where TIS did not
    act has no tis_* metrics, or ratios that do not follow the staleness."""
    run = run_train(
        _args(
            tiny_model,
            tiny_task,
            tmp_path,
            "--num-rollout",
            "10",
            "--fully-async",
            "--max-staleness-steps",
            "3",
            "--tis-clip",
            "1.5",
            "--tis-clip-low",
            "0.5",
            *old_policy,
        ),
        tmp_path,
    )
    assert run.returncode == 0, run.output[-3000:]
    m = run.metrics
    assert len(m) == 10 and max(r["async/staleness_max"] for r in m) >= 2
    stale = [r for r in m if r["async/staleness_min"] >= 1]
    assert len(stale) >= 5, [r["async/staleness_min"] for r in m]
    if old_policy:
        # The kept copy *is* the generating policy (fp32 engine): the ratio to the engine is 1, and the
        # staleness shows up in PPO's ratio to the current weights instead.
        assert all(abs(r["train/tis_max"] - 1) < 1e-3 and r["train/tis_clipfrac"] == 0 for r in m)
        assert max(r["train/ratio_max"] for r in stale) > 1.01
        return
    # Step 1 trains fresh data: engine and trainer score it alike, so the ratio is measured against the
    # engine's own log-probs (zeros in their place would put it far from 1).
    assert m[0]["async/staleness_max"] == 0 and abs(m[0]["train/tis_mean"] - 1) < 1e-3, m[0]
    assert m[0]["train/train_rollout_logprob_abs_diff"] < 1e-3 and m[0]["train/tis_clipfrac"] == 0
    # Stale data: the engine's log-probs lag the recomputed old policy, and TIS truncates what leaves the band.
    assert all(r["train/train_rollout_logprob_abs_diff"] > 1e-2 for r in stale), stale
    assert max(r["train/tis_clipfrac"] for r in stale) > 0.2
    for r in m:
        if r["train/tis_clipfrac"] > 0:  # the applied weights are not the raw ratios ...
            # by as little as one token's overshoot past the band over the step's tokens (9.7e-5 once,
            # 2026-12-07); where nothing left it they agree to 1e-6 (below)
            assert abs(r["train/tis_weight_mean"] - r["train/tis_mean"]) > 1e-6, r
            if r["train/tis_max"] > 1.5:
                assert r["train/tis_weight_max"] == pytest.approx(1.5), r
        else:  # ... and are exactly them where nothing left the band
            assert r["train/tis_weight_mean"] == pytest.approx(r["train/tis_mean"], abs=1e-6), r
            assert r["train/tis_weight_max"] == pytest.approx(r["train/tis_max"], abs=1e-6), r


def test_a_sample_without_rollout_logprobs_fails_the_run_naming_it(tiny_model, tiny_task, tmp_path):
    """A generate function that loses the engine's log-probs: --use-tis used to switch itself off for that
    micro-batch; now the run stops at the first step with the sample's uid."""
    marker = tmp_path / "stripped_uids"
    run = run_train(
        _args(
            tiny_model,
            tiny_task,
            tmp_path,
            "--num-rollout",
            "3",
            "--custom-generate-function-path",
            "tests.e2e.rewards:drops_rollout_logprobs",
        ),
        tmp_path,
        extra_env={"MILES_ASYNC_TEST_MARKER": str(marker)},
    )
    assert run.returncode != 0
    named = re.search(
        r"--use-tis: sample uid=(\S+) \(index \d+ of the rollout\) has 0 rollout log-probs for "
        r"\d+ response tokens",
        run.output,
    )
    assert named, run.output[-3000:]
    assert named.group(1) in marker.read_text().split()
    assert run.metrics == []  # no step was trained

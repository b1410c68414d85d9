"""train_async.py with --train-backend megatron on the tiny task: GRPO learns, checkpoints resume, HF export loads."""

from __future__ import annotations

import pytest
import torch

from tests.e2e.runner import run_train, tiny_args, without_rm_type

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -r requirements-megatron.txt)")

LEARN = [
    "--custom-rm-path",
    "tests.e2e.rewards:starts_with_digit",
    "--rollout-max-response-len",
    "2",
    "--lr",
    "1e-2",
    "--train-backend",
    "megatron",
]


def test_grpo_with_megatron_learns_saves_and_resumes(tiny_model, tiny_task, tmp_path):
    out, ckpt, hf = tmp_path / "run", tmp_path / "ckpt", tmp_path / "hf"
    run = run_train(
        without_rm_type(
            tiny_args(
                tiny_model,
                tiny_task,
                out,
                "--num-rollout",
                "12",
                "--save",
                str(ckpt),
                "--save-interval",
                "6",
                "--save-hf",
                str(hf),
                *LEARN,
            )
        ),
        out,
    )
    assert run.returncode == 0, run.output[-4000:]
    rewards = [m["rollout/reward_mean"] for m in run.metrics]
    assert len(rewards) == 12
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.3, rewards
    assert sum(rewards[-3:]) / 3 > 0.7, rewards
    assert (ckpt / "iter_0000011" / "actor" / "megatron" / ".metadata").is_file()

    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).state_dict()
    initial = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).state_dict()
    assert sorted(trained) == sorted(initial)
    assert any(not torch.equal(trained[k], initial[k]) for k in initial)

    out2 = tmp_path / "resumed"
    resumed = run_train(
        without_rm_type(tiny_args(tiny_model, tiny_task, out2, "--num-rollout", "14", "--load", str(ckpt), *LEARN)),
        out2,
    )
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert [m["step"] for m in resumed.metrics] == [13, 14]
    # The resumed policy is the trained one, not the initial model.
    assert resumed.metrics[0]["rollout/reward_mean"] > 0.6, resumed.metrics

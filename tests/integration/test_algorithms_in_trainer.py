"""The torch backend's critic, PPO's data flow and --keep-old-actor on a tiny real model (no Ray)."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from miles_async.arguments import parse_args
from miles_async.backends.data_parallel import shard
from miles_async.backends.fsdp.actor import FSDPTrainActor
from miles_async.backends.fsdp.critic import FSDPCritic
from miles_async.rollout.batch import RolloutBatch, to_train_batch
from miles_async.rollout.sample import Sample
from miles_async.weights.update import WeightUpdate
from tests.tolerance import (
    StepBounds,
    assert_rejected,
    assert_within,
    forward_tolerance,
    gamma,
    transformer_depth,
)


def _batch(seed: int = 0, version: int = 0) -> RolloutBatch:
    rng = random.Random(seed)
    groups = []
    for g in range(4):
        prompt = [rng.randrange(6, 40) for _ in range(rng.randrange(3, 7))]
        group = []
        for i in range(4):
            n = rng.randrange(1, 6)
            group.append(
                Sample(
                    uid=f"{g}-{i}",
                    group_index=g,
                    index=i,
                    prompt="",
                    prompt_tokens=prompt,
                    response_tokens=[rng.randrange(6, 40) for _ in range(n)],
                    rollout_logprobs=[-3.0] * n,
                    weight_versions=[version] * n,
                    reward=float(rng.random() < 0.5),
                )
            )
        groups.append(group)
    return to_train_batch(groups)


def _cfg(tiny_model, tiny_task, tmp_path, *extra):
    train, _ = tiny_task
    return parse_args(
        [
            "--hf-checkpoint",
            str(tiny_model),
            "--prompt-data",
            str(train),
            "--rollout-batch-size",
            "4",
            "--n-samples-per-prompt",
            "4",
            "--num-rollout",
            "4",
            "--rm-type",
            "integer",
            "--lr",
            "1e-2",
            "--max-tokens-per-gpu",
            "40",
            "--output-dir",
            str(tmp_path),
            *extra,
        ]
    )


def test_critic_values_sit_where_the_policy_predicts_each_response_token(tiny_model, tiny_task, tmp_path):
    """Packed, left-padded micro-batches give every sample the values of its own unpadded forward pass: within the
    float32 bound of two orders of the same sums (tests/tolerance.py; terms the size of the largest value, at least
    1); the values one token off are not."""
    from transformers import AutoConfig

    cfg = _cfg(tiny_model, tiny_task, tmp_path, "--use-tis", "--advantage-estimator", "ppo")
    critic = FSDPCritic(cfg.critic, 0, 1, total_optimizer_steps=4)
    batch = _batch()
    values = critic.compute_values(0, batch)
    got, want = {}, {}
    with torch.no_grad():
        for i in (0, 5, 11):
            p, n = batch.prompt_lengths[i], batch.response_lengths[i]
            out = critic.module(input_ids=torch.tensor([batch.tokens[i]])).logits[0, :, 0]
            got[i], want[i] = torch.tensor(values[i]), out[p - 1 : p - 1 + n]
    depth = transformer_depth(AutoConfig.from_pretrained(tiny_model), max(len(t) for t in batch.tokens))
    tol = forward_tolerance(depth, max(1.0, max(float(w.abs().max()) for w in want.values())))
    assert_within(got, want, tol, "packed values vs each sample's own forward pass")
    off = {i: torch.tensor(values[i][1:]) for i in want if len(values[i]) > 1}
    assert_rejected(off, {i: want[i][:-1] for i in off}, tol, "values one token off")
    assert [len(v) for v in values] == batch.response_lengths


def test_ppo_returns_are_the_outcome_and_the_critic_fits_them(tiny_model, tiny_task, tmp_path):
    cfg = _cfg(
        tiny_model,
        tiny_task,
        tmp_path,
        "--use-tis",
        "--advantage-estimator",
        "ppo",
        "--critic-lr",
        "1e-3",
        "--value-clip",
        "0",
    )
    critic = FSDPCritic(cfg.critic, 0, 1, total_optimizer_steps=20)
    actor = FSDPTrainActor(cfg.train, 0, 1, total_optimizer_steps=20)
    batch = _batch()
    losses = []
    for step in range(6):
        values = critic.compute_values(step, batch)
        returns = actor.prepare(step, batch, 1.0, values)
        # gamma = lambda = 1: the return of every token is the sequence's outcome reward, up to float32 rounding:
        # GAE's n deltas (3 roundings each) sum the reward and each value twice, and the return adds the value back.
        tol = [gamma(3 * len(v) + 1) * (1 + 3 * len(v) * max(map(abs, v))) for v in values]
        rewards = {i: [r] * len(ret) for i, (r, ret) in enumerate(zip(batch.rewards, returns))}
        assert_within(dict(enumerate(returns)), rewards, dict(enumerate(tol)), "returns")
        as_advantages = {i: [x - v for x, v in zip(ret, values[i])] for i, ret in enumerate(returns)}
        assert_rejected(as_advantages, rewards, dict(enumerate(tol)), "returns without the values added back")
        # ... and the advantage is that reward minus the token's value (and not the next token's).
        adv = actor._prepared.advantages
        for i in (0, 7):
            n = batch.response_lengths[i]
            want = batch.rewards[i] - torch.tensor(values[i])
            assert_within(adv[i, :n], want, tol[i], f"advantages of sample {i}")
            assert_rejected(adv[i, : n - 1], want[1:], tol[i], f"advantages of sample {i} one token off")
        losses.append(critic.train(step, batch, values, returns)["critic/vf_loss"])
    assert losses[-1] < 0.5 * losses[0], losses
    metrics = actor.train(5, batch, 1.0, values)
    assert metrics["train/optimizer_steps"] == 1 and "train/pg_loss" in metrics


def test_critic_checkpoint_round_trips(tiny_model, tiny_task, tmp_path):
    cfg = _cfg(tiny_model, tiny_task, tmp_path, "--use-tis", "--advantage-estimator", "ppo")
    critic = FSDPCritic(cfg.critic, 0, 1, total_optimizer_steps=4)
    batch = _batch()
    values = critic.compute_values(0, batch)
    critic.train(0, batch, values, [[1.0] * len(v) for v in values])
    critic.save(str(tmp_path / "ckpt"), 0)
    assert (tmp_path / "ckpt" / "iter_0000000" / "critic" / "dcp" / ".metadata").exists()
    restored = FSDPCritic(cfg.critic, 0, 1, 4, str(tmp_path / "ckpt"), 0)
    assert restored.state_checksum() == critic.state_checksum()
    assert restored.optimizer_steps == 1
    assert restored.compute_values(1, batch) == critic.compute_values(1, batch)
    with pytest.raises(RuntimeError, match="holds no actor weights"):
        FSDPTrainActor(cfg.train, 0, 1, 4, str(tmp_path / "ckpt"), 0)


def _no_engines(version: int) -> WeightUpdate:
    return WeightUpdate(version=version, route="http", dtype="float32", timeout=10)


def test_keep_old_actor_scores_each_sample_under_the_weights_that_generated_it(tiny_model, tiny_task, tmp_path):
    cfg = _cfg(tiny_model, tiny_task, tmp_path, "--keep-old-actor", "--use-tis")
    actor = FSDPTrainActor(cfg.train, 0, 1, total_optimizer_steps=10)
    initial = FSDPTrainActor(cfg.train, 0, 1, total_optimizer_steps=10)  # stays at version 0
    actor.push_weights(_no_engines(0))  # only the kept copy matters here
    actor.train(0, _batch(0))
    actor.push_weights(_no_engines(1))
    actor.train(1, _batch(1, version=1))
    stale = _batch(2, version=0)
    actor.prepare(2, stale, 1.0)
    idx = list(range(len(stale)))
    want = initial._logprobs_of(initial.module, stale, idx, 1.0)
    current = actor._logprobs_of(actor.module, stale, idx, 1.0)
    # The kept version 0 and the untrained actor are the same weights: their log-probs agree within float32
    # rounding (tests/tolerance.py); the trained weights' log-probs do not.
    tol = StepBounds.of(tiny_model, stale.tokens).logprob
    assert_within(actor._prepared.old, want, tol, "log-probs under the kept version 0")
    assert_rejected(current, want, tol, "log-probs under the trained weights")
    # Only the versions still in flight are kept (one-step-off: the newest two, then a third).
    actor.push_weights(_no_engines(2))
    actor.push_weights(_no_engines(3))
    with pytest.raises(RuntimeError, match=r"weight version 0 .* no longer kept; kept versions: \[1, 2, 3\]"):
        actor.prepare(3, stale, 1.0)


def _logged_token_mean(actor: FSDPTrainActor, batch: RolloutBatch, value) -> float:
    """What a rollout's train/ metric of the loss logs for a per-token quantity ``value(sample, token)``: the mean
    over its micro-batches (each optimizer step's, as the actor packs them) of each one's mean over its response
    tokens."""
    steps, _ = shard(len(batch), actor.cfg.global_batch_size, actor.dp)
    means = []
    for step in steps:
        for rows in actor._micro_batches(batch, step):
            values = [value(i, k) for i in rows for k in range(batch.response_lengths[i])]
            means.append(sum(values) / len(values))
    return sum(means) / len(means)


@pytest.mark.parametrize("level,mode", [("token", "truncate"), ("token", "mask"), ("sequence", "truncate")])
def test_stale_batch_importance_weights_are_bounded_by_the_clip(level, mode, tiny_model, tiny_task, tmp_path):
    """Rollout log-probs 2 nats off the trainer's, alternating in sign: the ratios are truncated (or masked) to the
    clip, and the applied weights, not the raw ratios, reach the loss."""
    cfg = _cfg(
        tiny_model,
        tiny_task,
        tmp_path,
        "--use-tis",
        "--tis-clip",
        "1.5",
        "--tis-clip-low",
        "0.5",
        "--tis-level",
        level,
        "--tis-mode",
        mode,
        "--global-batch-size",
        "8",
    )
    actor = FSDPTrainActor(cfg.train, 0, 1, total_optimizer_steps=10)
    batch = _batch()
    trainer_lp = actor._logprobs_of(actor.module, batch, list(range(16)), 1.0)
    batch = dataclasses.replace(
        batch,
        rollout_logprobs=[[lp + (2.0 if k % 2 else -2.0) for k, lp in enumerate(trainer_lp[i])] for i in range(16)],
    )
    m = actor.train(0, batch)
    assert m["train/optimizer_steps"] == 2
    # Truncation lands exactly on the upper bound; masking (token level, every ratio outside) leaves no weight.
    masked_out = level == "token" and mode == "mask"
    assert m["train/tis_weight_max"] == (0.0 if masked_out else pytest.approx(1.5))
    if masked_out:  # nothing is left to train on: the weights reached the gradient
        assert m["train/pg_loss"] == 0 and m["train/grad_norm"] == 0
    else:  # the same batch without the gap (every weight 1) gives another loss
        plain = FSDPTrainActor(cfg.train, 0, 1, total_optimizer_steps=10)
        unweighted = plain.train(0, dataclasses.replace(batch, rollout_logprobs=[trainer_lp[i] for i in range(16)]))
        assert unweighted["train/tis_clipfrac"] == 0
        assert abs(unweighted["train/pg_loss"] - m["train/pg_loss"]) > 1e-3, (unweighted, m)
    # Old log-probs are recomputed once before both steps (the same passes as trainer_lp's), so the logged gap is
    # the one planted, up to float32 rounding: of each planted log-prob (|lp +- 2| < 16: 2^-20), of the difference
    # and of the mean over at most 24 tokens (24 u relative), 4e-6 in all.
    assert m["train/train_rollout_logprob_abs_diff"] == pytest.approx(2.0, abs=1e-5)
    # A raw ratio is exp(+-2) of that log-ratio: relative error the log-ratio's 2e-6 (sequence level: the sum of at
    # most 5 of them) and exp's rounding.
    assert m["train/tis_max"] == pytest.approx(math.exp(2), rel=1e-5)
    if level == "token":
        # Every token's ratio leaves [0.5, 1.5]: e^2 on even tokens, truncated to 1.5, e^-2 on odd ones, to 0.5; or
        # masked to 0. A micro-batch's mean of those weights is exact but for its division (u relative).
        assert m["train/tis_clipfrac"] == 1.0
        truncated = _logged_token_mean(actor, batch, lambda i, k: 1.5 if k % 2 == 0 else 0.5)
        assert m["train/tis_weight_mean"] == (0.0 if mode == "mask" else pytest.approx(truncated, rel=1e-6))
    else:
        # Per sequence the signs cancel on even lengths (ratio 1 up to rounding, kept) and leave e^2 on odd ones
        # (truncated to 1.5), for each of the sequence's tokens.
        odd = [n % 2 == 1 for n in batch.response_lengths]
        clipfrac = _logged_token_mean(actor, batch, lambda i, k: float(odd[i]))
        assert 0 < clipfrac < 1  # the batch has both
        assert m["train/tis_clipfrac"] == pytest.approx(clipfrac, rel=1e-6)
        raw = _logged_token_mean(actor, batch, lambda i, k: math.exp(2) if odd[i] else 1.0)
        assert m["train/tis_mean"] == pytest.approx(raw, rel=1e-5)
        weight = _logged_token_mean(actor, batch, lambda i, k: 1.5 if odd[i] else 1.0)
        assert m["train/tis_weight_mean"] == pytest.approx(weight, rel=1e-5)


@pytest.mark.parametrize("flag", ["--use-tis", "--use-rollout-logprobs"])
def test_a_trained_token_without_a_rollout_logprob_fails_the_step_naming_the_sample(
    flag, tiny_model, tiny_task, tmp_path
):
    """Missing engine log-probs used to switch TIS off for the micro-batch (--use-tis) or read as log-prob 0
    (--use-rollout-logprobs); now the step fails before any weight moves, naming the sample."""
    actor = FSDPTrainActor(_cfg(tiny_model, tiny_task, tmp_path, flag).train, 0, 1, total_optimizer_steps=10)
    before = actor.state_checksum()
    short = _batch()
    short.rollout_logprobs[5] = short.rollout_logprobs[5][:-1]  # e.g. a custom generate function's tail
    with pytest.raises(
        ValueError,
        match=rf"{flag}: sample uid=1-1 \(index 5 of the rollout\) has "
        rf"{short.response_lengths[5] - 1} rollout log-probs for "
        rf"{short.response_lengths[5]} response tokens",
    ):
        actor.train(0, short)
    nan = _batch()
    nan.rollout_logprobs[5][0] = float("nan")
    with pytest.raises(ValueError, match=r"sample uid=1-1 .* has rollout log-prob nan at trained response token 0"):
        actor.train(0, nan)
    assert actor.optimizer_steps == 0 and actor.state_checksum() == before
    # Only trained tokens need one: a sample that trains nothing, or a NaN under a loss-mask 0, is fine.
    untrained = _batch()
    untrained.rollout_logprobs[5], untrained.loss_masks[5] = [], [0] * untrained.response_lengths[5]
    masked = _batch()
    masked.rollout_logprobs[6][0], masked.loss_masks[6][0] = float("nan"), 0
    for ok in (untrained, masked):
        assert math.isfinite(actor.train(0, ok)["train/pg_loss"])
    assert actor.optimizer_steps == 2


def test_the_logged_lr_is_the_one_each_step_took(tiny_model, tiny_task, tmp_path):
    """``train/lr`` is the learning rate of the rollout's (last) optimizer step, the one Megatron-LM and TRL log: the
    first step trains at the peak. (It was the next step's, as the scheduler reports once stepped.) The Megatron
    backend's is compared with this one's in tests/integration/test_megatron_backend.py."""
    schedule = ("--lr-decay-style", "cosine", "--min-lr", "1e-3", "--lr-decay-iters", "4", "--use-tis")
    actor = FSDPTrainActor(_cfg(tiny_model, tiny_task, tmp_path, *schedule).train, 0, 1, total_optimizer_steps=4)
    lrs = [actor.train(i, _batch(i))["train/lr"] for i in range(3)]
    assert actor.optimizer_steps == 3
    expected = [1e-3 + (1e-2 - 1e-3) * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(3)]
    assert lrs == pytest.approx(expected, rel=1e-9), (lrs, expected)
    assert lrs[0] == pytest.approx(1e-2)

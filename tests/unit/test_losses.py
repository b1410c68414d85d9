"""Masked statistics, KL, aggregation, TIS and the policy and value losses against numpy references
(tests/unit/numpy_reference.py), values and gradients."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from miles_async.algorithms.advantages import (
    broadcast_to_tokens,
)
from miles_async.algorithms.losses import (
    aggregate_loss,
    compute_approx_kl,
    compute_tis_weights,
    entropy_from_logits,
    logprobs_from_logits,
    masked_mean,
    masked_whiten,
    policy_loss,
    ppo_clipped_surrogate,
    value_loss,
)
from tests.unit.numpy_reference import (
    AGG_MODES,
    SEEDS,
    central_diff,
    make_mask,
    np_agg,
    np_entropy,
    np_kl,
    np_logprobs,
    np_policy,
    np_tis,
    np_value_loss,
    np_whiten_list,
    t64,
    valid_positions,
)

# ---------------------------------------------------------------------------
# Masked statistics, KL, aggregation
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_masked_mean_and_whiten_match_numpy(seed):
    rng = np.random.default_rng(seed)
    mask = make_mask(rng, 5, 7)
    x = rng.normal(size=(5, 7)) * 3 + 1
    x[mask == 0] = np.inf  # padding garbage
    vals = [x[b, t] for b in range(5) for t in valid_positions(mask[b])]
    assert float(masked_mean(t64(x), t64(mask))) == pytest.approx(sum(vals) / len(vals), rel=1e-12)
    for b in range(5):
        row = [x[b, t] for t in valid_positions(mask[b])]
        assert float(masked_mean(t64(x), t64(mask), dim=-1)[b]) == pytest.approx(sum(row) / len(row), rel=1e-12)
    white = masked_whiten(t64(x), t64(mask)).numpy()
    want = np_whiten_list(vals, 1e-8)
    got = [white[b, t] for b in range(5) for t in valid_positions(mask[b])]
    np.testing.assert_allclose(got, want, rtol=1e-10)
    assert np.all(white[mask == 0] == 0)
    assert float(masked_mean(torch.ones(3), torch.zeros(3))) == 0.0


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl"])
def test_approx_kl_matches_numpy(kind):
    rng = np.random.default_rng(3)
    lp = rng.normal(size=(4, 6)) * 2 - 2
    ref = rng.normal(size=(4, 6)) * 2 - 2
    got = compute_approx_kl(t64(lp), t64(ref), kind)
    np.testing.assert_allclose(got.numpy(), np_kl(lp, ref, kind), rtol=1e-10, atol=1e-12)
    if kind in ("k2", "k3", "low_var_kl"):
        assert torch.all(got >= 0)


def test_low_var_kl_bounded_with_finite_gradient():
    lp = torch.tensor([0.0, -800.0, 0.0, -1.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-800.0, 0.0, 0.0, -1.5], dtype=torch.float64)
    kl = compute_approx_kl(lp, ref, "low_var_kl")
    assert torch.all(kl <= 10.0) and torch.all(kl >= -10.0)
    assert kl[0] == 10.0 and kl[1] == 10.0 and kl[2] == 0.0
    kl.sum().backward()
    assert torch.isfinite(lp.grad).all()
    with pytest.raises(ValueError):
        compute_approx_kl(lp, ref, "k4")  # type: ignore[arg-type]


def test_aggregation_modes_differ_on_unequal_lengths():
    per_token = torch.tensor([[1.0, 1.0, 1.0, 1.0], [3.0, 99.0, 99.0, 99.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    # token_mean: (1+1+1+1+3)/5; seq_mean_token_mean: (1 + 3)/2; seq_mean_token_sum: (4 + 3)/2
    assert float(aggregate_loss(per_token, mask, "token_mean")) == pytest.approx(1.4)
    assert float(aggregate_loss(per_token, mask, "seq_mean_token_mean")) == pytest.approx(2.0)
    assert float(aggregate_loss(per_token, mask, "seq_mean_token_sum")) == pytest.approx(3.5)
    # With equal lengths the two mean modes coincide and token_sum scales by length.
    eq = torch.ones(2, 4)
    a = aggregate_loss(per_token, eq, "token_mean")
    assert float(a) == pytest.approx(float(aggregate_loss(per_token, eq, "seq_mean_token_mean")))
    assert float(aggregate_loss(per_token, eq, "seq_mean_token_sum")) == pytest.approx(4 * float(a))
    with pytest.raises(ValueError):
        aggregate_loss(per_token, mask, "sum")  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregation_matches_numpy(seed, mode):
    rng = np.random.default_rng(seed)
    mask = make_mask(rng, 6, 7, empty_row=True)
    x = rng.normal(size=(6, 7))
    x[mask == 0] = np.nan
    got = aggregate_loss(t64(x), t64(mask), mode)
    assert float(got) == pytest.approx(np_agg(x, mask, mode), rel=1e-12)
    assert float(aggregate_loss(t64(x), torch.zeros(6, 7), mode)) == 0.0


# ---------------------------------------------------------------------------
# Logits helpers
# ---------------------------------------------------------------------------


def test_entropy_and_logprobs_match_numpy():
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(3, 4, 11)) * 3
    labels = rng.integers(0, 11, size=(3, 4))
    np.testing.assert_allclose(entropy_from_logits(t64(logits)).numpy(), np_entropy(logits), rtol=1e-10)
    np.testing.assert_allclose(
        logprobs_from_logits(t64(logits), torch.tensor(labels)).numpy(), np_logprobs(logits, labels), rtol=1e-10
    )


def test_entropy_and_logprobs_stable_for_extreme_logits():
    logits = torch.tensor([[1e4, -1e4, 0.0, 1e4], [-1e30, 0.0, -1e30, -1e30]], dtype=torch.float32)
    ent = entropy_from_logits(logits)
    assert torch.isfinite(ent).all()
    np.testing.assert_allclose(ent.numpy(), [math.log(2), 0.0], atol=1e-5)
    lp = logprobs_from_logits(logits, torch.tensor([0, 1]))
    assert torch.isfinite(lp).all()
    # No max-shift copy is made (memory), so the error is ~ulp(max logit) = 1e-3 here.
    np.testing.assert_allclose(lp.numpy(), [-math.log(2), 0.0], atol=2e-3)
    realistic = torch.tensor([[40.0, 38.0, -25.0, 12.0]])
    want = np_logprobs(realistic.double().numpy(), np.array([1]))
    np.testing.assert_allclose(logprobs_from_logits(realistic, torch.tensor([1])).numpy(), want, atol=1e-5)


def test_logprobs_gradient_is_onehot_minus_softmax():
    rng = np.random.default_rng(6)
    logits = t64(rng.normal(size=(2, 5))).requires_grad_()
    labels = torch.tensor([3, 0])
    logprobs_from_logits(logits, labels).sum().backward()
    z = logits.detach().numpy()
    for b in range(2):
        m = max(z[b])
        tot = sum(math.exp(v - m) for v in z[b])
        for v in range(5):
            want = (1.0 if v == labels[b] else 0.0) - math.exp(z[b, v] - m) / tot
            assert float(logits.grad[b, v]) == pytest.approx(want, abs=1e-12)


# ---------------------------------------------------------------------------
# TIS / IcePop weights
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_tis_weights_match_numpy_and_are_bounded(seed, level, mode):
    rng = np.random.default_rng(seed)
    B, T = 6, 8
    mask = make_mask(rng, B, T)
    old = rng.normal(size=(B, T)) - 2
    roll = old + rng.normal(size=(B, T)) * (0.3 if level == "sequence" else 1.0)
    lo, hi = 0.5, 2.0
    w, raw, clipped = compute_tis_weights(
        t64(old), t64(roll), t64(mask), tis_clip=hi, tis_clip_low=lo, tis_level=level, tis_mode=mode
    )
    np.testing.assert_allclose(w.numpy(), np_tis(old, roll, mask, lo, hi, level, mode), rtol=1e-10)
    valid = t64(mask) == 1
    if mode == "truncate":
        assert torch.all(w[valid] >= lo) and torch.all(w[valid] <= hi)
    else:
        inside = (w[valid] >= lo) & (w[valid] <= hi)
        assert torch.all(inside | (w[valid] == 0))
        assert torch.all((w[valid] == 0) == (clipped[valid] == 1))
    assert torch.all(w[~valid] == 0)
    if level == "sequence":
        for b in range(B):
            pos = valid_positions(mask[b])
            assert len(set(w[b, pos].tolist())) == 1


# ---------------------------------------------------------------------------
# Policy losses: values and gradients
# ---------------------------------------------------------------------------


def policy_inputs(seed, B=6, T=8, spread=0.4):
    rng = np.random.default_rng(seed)
    mask = make_mask(rng, B, T)
    old = rng.normal(size=(B, T)) - 2.0
    lp = old + rng.normal(size=(B, T)) * spread
    roll = old + rng.normal(size=(B, T)) * 0.5
    seq_adv = rng.normal(size=B)
    adv = np.repeat(seq_adv[:, None], T, axis=1) + rng.normal(size=(B, T)) * 0.3
    # Garbage in padding must change neither loss nor gradient.
    lp_pad = lp.copy()
    lp_pad[mask == 0] = np.nan
    old_pad = old.copy()
    old_pad[mask == 0] = -np.inf
    return rng, mask, lp, old, roll, adv, lp_pad, old_pad


def run_policy(lp_pad, old_pad, adv, mask, roll=None, **kw):
    lp_t = t64(lp_pad).requires_grad_()
    loss, metrics = policy_loss(
        lp_t, t64(old_pad), t64(adv), t64(mask), rollout_logprobs=None if roll is None else t64(roll), **kw
    )
    loss.backward()
    return loss, metrics, lp_t.grad


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("loss_type", ["ppo", "gspo", "cispo"])
@pytest.mark.parametrize("use_tis", [False, True])
def test_policy_loss_value_and_gradient_match_numpy(seed, mode, loss_type, use_tis):
    _, mask, lp, old, roll, adv, lp_pad, old_pad = policy_inputs(seed, spread=0.4 if loss_type != "gspo" else 0.05)
    eps_lo, eps_hi = (0.2, 0.28) if loss_type != "gspo" else (3e-3, 4e-3)
    c = 3.0 if loss_type != "cispo" else None
    tis_w = np_tis(old, roll, mask, 0.0, 2.0, "token", "truncate") if use_tis else np.ones_like(lp)
    loss, metrics, grad = run_policy(
        lp_pad, old_pad, adv, mask, roll if use_tis else None,
        eps_clip=eps_lo, eps_clip_high=eps_hi, eps_clip_c=c, use_tis=use_tis,
        tis_clip=2.0, tis_clip_low=0.0, agg_mode=mode, loss_type=loss_type,
    )  # fmt: skip
    want_loss, want_grad = np_policy(
        lp, old, adv, mask, loss_type=loss_type, eps_lo=eps_lo, eps_hi=eps_hi, c=c, tis_w=tis_w, mode=mode
    )
    assert float(loss.detach()) == pytest.approx(want_loss, rel=1e-10, abs=1e-12)
    assert torch.isfinite(grad).all()
    np.testing.assert_allclose(grad.numpy(), want_grad, rtol=1e-9, atol=1e-12)
    assert torch.all(grad[t64(mask) == 0] == 0)
    assert float(metrics["pg_loss"]) == pytest.approx(want_loss, rel=1e-10, abs=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_ppo_gradient_matches_finite_differences(seed, mode):
    _, mask, lp, old, roll, adv, lp_pad, old_pad = policy_inputs(seed)
    tis_w = np_tis(old, roll, mask, 0.0, 1.5, "sequence", "truncate")
    kw = dict(eps_lo=0.2, eps_hi=0.3, c=2.0, tis_w=tis_w, mode=mode)
    _, _, grad = run_policy(
        lp_pad, old_pad, adv, mask, roll, eps_clip=0.2, eps_clip_high=0.3, eps_clip_c=2.0,
        use_tis=True, tis_clip=1.5, tis_level="sequence", agg_mode=mode,
    )  # fmt: skip
    fd = central_diff(lambda x: np_policy(x, old, adv, mask, loss_type="ppo", **kw)[0], lp, mask)
    np.testing.assert_allclose(grad.numpy(), fd, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("seed", SEEDS)
def test_gspo_gradient_equals_sequence_objective_finite_differences(seed):
    """Token-level GSPO with seq_mean_token_mean is the paper's sequence objective."""
    rng, mask, lp, old, _, _, lp_pad, old_pad = policy_inputs(seed, spread=0.05)
    B, T = mask.shape
    seq_adv = rng.normal(size=B)
    adv = np.repeat(seq_adv[:, None], T, axis=1)
    eps_lo, eps_hi = 4e-3, 5e-3

    def seq_objective(x):
        tot, n = 0.0, 0
        for b in range(B):
            pos = valid_positions(mask[b])
            s = math.exp(sum(x[b, t] - old[b, t] for t in pos) / len(pos))
            tot += max(-seq_adv[b] * s, -seq_adv[b] * min(max(s, 1 - eps_lo), 1 + eps_hi))
            n += 1
        return tot / n

    loss, _, grad = run_policy(
        lp_pad, old_pad, adv, mask, eps_clip=eps_lo, eps_clip_high=eps_hi,
        agg_mode="seq_mean_token_mean", loss_type="gspo",
    )  # fmt: skip
    assert float(loss.detach()) == pytest.approx(seq_objective(lp), rel=1e-10)
    np.testing.assert_allclose(grad.numpy(), central_diff(seq_objective, lp, mask), rtol=1e-5, atol=1e-8)


def test_cispo_keeps_gradient_on_clipped_tokens():
    # ratio e^1 is far above 1 + eps_high; PPO zeroes the gradient, CISPO does not.
    lp = torch.tensor([[0.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0]], dtype=torch.float64)
    mask = torch.ones(1, 1)
    loss, m = policy_loss(lp, old, adv, mask, eps_clip=0.2, eps_clip_high=0.28, loss_type="cispo")
    loss.backward()
    assert float(lp.grad) == pytest.approx(-1.28)
    assert float(m["clipfrac"]) == 1.0
    lp.grad = None
    loss, _ = policy_loss(lp, old, adv, mask, eps_clip=0.2, eps_clip_high=0.28, loss_type="ppo")
    loss.backward()
    assert float(lp.grad) == 0.0
    with pytest.raises(ValueError):
        policy_loss(lp, old, adv, mask, eps_clip_c=3.0, loss_type="cispo")


def test_dual_clip_bound_holds():
    rng = np.random.default_rng(7)
    ratio = t64(np.exp(rng.normal(size=2000) * 2.0))
    adv = t64(rng.normal(size=2000))
    c = 3.0
    pg, _, dual = ppo_clipped_surrogate(ratio, adv, 0.2, 0.28, c)
    pg_plain, _, _ = ppo_clipped_surrogate(ratio, adv, 0.2, 0.28, None)
    neg = adv < 0
    assert torch.all(pg[neg] <= -adv[neg] * c + 1e-12)
    assert torch.all(pg[~neg] == pg_plain[~neg])
    assert torch.all(dual[~neg] == 0) and dual[neg].sum() > 0
    # Through policy_loss: one exploded token with A = -1 costs exactly c and has no gradient.
    lp = torch.tensor([[5.0]], dtype=torch.float64, requires_grad=True)
    loss, metrics = policy_loss(lp, torch.zeros(1, 1, dtype=torch.float64), -torch.ones(1, 1, dtype=torch.float64),
                                torch.ones(1, 1), eps_clip=0.2, eps_clip_c=c)  # fmt: skip
    loss.backward()
    assert float(loss.detach()) == pytest.approx(c)
    assert float(lp.grad) == 0.0 and float(metrics["dual_clipfrac"]) == 1.0
    with pytest.raises(ValueError):
        ppo_clipped_surrogate(ratio, adv, 0.2, 0.2, 0.9)


@pytest.mark.parametrize("seed", SEEDS)
def test_policy_metrics_match_numpy(seed):
    _, mask, lp, old, roll, adv, lp_pad, old_pad = policy_inputs(seed, spread=0.5)
    lo, hi = 0.5, 1.5
    _, metrics, _ = run_policy(
        lp_pad, old_pad, adv, mask, roll, eps_clip=0.2, use_tis=True, tis_clip=hi, tis_clip_low=lo,
        tis_mode="mask",
    )  # fmt: skip
    toks = [(b, t) for b in range(mask.shape[0]) for t in valid_positions(mask[b])]
    n = len(toks)
    assert float(metrics["train_rollout_kl"]) == pytest.approx(sum(roll[i] - old[i] for i in toks) / n, rel=1e-10)
    assert float(metrics["approx_kl"]) == pytest.approx(sum(old[i] - lp[i] for i in toks) / n, rel=1e-10)
    raws = [math.exp(old[i] - roll[i]) for i in toks]
    assert float(metrics["tis_mean"]) == pytest.approx(sum(raws) / n, rel=1e-10)
    assert float(metrics["tis_max"]) == pytest.approx(max(raws), rel=1e-12)
    assert float(metrics["tis_clipfrac"]) == pytest.approx(sum(1 for r in raws if not lo <= r <= hi) / n)
    clipped = 0
    for i in toks:
        ratio = math.exp(lp[i] - old[i])
        a = adv[i]
        if -a * min(max(ratio, 0.8), 1.2) > -a * ratio:
            clipped += 1
    assert float(metrics["clipfrac"]) == pytest.approx(clipped / n)
    for v in metrics.values():
        assert isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad


def test_policy_loss_accepts_sequence_advantages_and_validates():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    lp = torch.randn(2, 3, dtype=torch.float64)
    seq_adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    a, _ = policy_loss(lp, lp - 0.1, seq_adv, mask)
    b, _ = policy_loss(lp, lp - 0.1, broadcast_to_tokens(seq_adv, mask), mask)
    assert float(a) == pytest.approx(float(b))
    with pytest.raises(ValueError):
        policy_loss(lp, lp, seq_adv, mask, use_tis=True)
    with pytest.raises(ValueError):
        policy_loss(lp, lp, seq_adv, mask, loss_type="dpo")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# Value loss
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("clip", [None, 0.2])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_value_loss_matches_numpy_and_finite_differences(seed, clip, mode):
    rng = np.random.default_rng(seed)
    B, T = 5, 7
    mask = make_mask(rng, B, T)
    old_v = rng.normal(size=(B, T))
    values = old_v + rng.normal(size=(B, T)) * 0.4
    returns = rng.normal(size=(B, T))
    v_pad = values.copy()
    v_pad[mask == 0] = np.nan
    v_t = t64(v_pad).requires_grad_()
    loss, metrics = value_loss(v_t, t64(old_v), t64(returns), t64(mask), value_clip=clip, agg_mode=mode)
    loss.backward()
    want = np_value_loss(values, old_v, returns, mask, clip, mode)
    assert float(loss.detach()) == pytest.approx(want, rel=1e-10)
    fd = central_diff(lambda x: np_value_loss(x, old_v, returns, mask, clip, mode), values, mask)
    np.testing.assert_allclose(v_t.grad.numpy(), fd, rtol=1e-5, atol=1e-8)
    assert torch.all(v_t.grad[t64(mask) == 0] == 0)
    if clip is None:
        assert float(metrics["vf_clipfrac"]) == 0.0


def test_value_clip_is_pessimistic():
    # The new value moved 1.0 towards the return; clipped to 0.2 the error is larger,
    # so the clipped (max) term is used and the gradient is zero.
    v = torch.tensor([[1.0]], dtype=torch.float64, requires_grad=True)
    loss, metrics = value_loss(v, torch.zeros(1, 1, dtype=torch.float64), torch.full((1, 1), 2.0, dtype=torch.float64),
                               torch.ones(1, 1), value_clip=0.2)  # fmt: skip
    loss.backward()
    assert float(loss.detach()) == pytest.approx(0.5 * 1.8**2)
    assert float(v.grad) == 0.0 and float(metrics["vf_clipfrac"]) == 1.0

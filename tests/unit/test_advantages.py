"""Advantage estimators against the numpy references of tests/unit/numpy_reference.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from miles_async.algorithms.advantages import (
    broadcast_to_tokens,
    compute_advantages,
    gae,
    grpo_advantages,
    place_on_last_token,
    reinforce_plus_plus_baseline_advantages,
    reinforce_plus_plus_returns,
)
from tests.unit.numpy_reference import (
    SEEDS,
    make_groups,
    make_mask,
    np_gae,
    np_grpo,
    np_returns_rpp,
    np_rpp_baseline,
    np_whiten_list,
    t64,
    valid_positions,
)

# ---------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("normalize_std", [True, False])
def test_grpo_matches_numpy(seed, normalize_std):
    rng = np.random.default_rng(seed)
    rewards, ids = make_groups(rng)
    got = grpo_advantages(t64(rewards), torch.tensor(ids), normalize_std=normalize_std, eps=1e-6)
    want = np_grpo(rewards, ids, normalize_std, 1e-6)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-10, atol=1e-12)


def test_grpo_singleton_and_constant_groups_are_zero():
    rewards = torch.tensor([3.0, 1.0, 1.0, 1.0, 0.0, 2.0])
    ids = torch.tensor([9, 4, 4, 4, 2, 2])
    adv = grpo_advantages(rewards, ids)
    assert adv[0] == 0.0  # singleton
    assert torch.all(adv[1:4] == 0.0)  # identical rewards
    # Bessel-corrected std of {0, 2} is sqrt(2): advantages are -+1/sqrt(2).
    np.testing.assert_allclose(adv[4:].numpy(), [-1 / math.sqrt(2), 1 / math.sqrt(2)], rtol=1e-5)
    # Dr. GRPO keeps the raw centred reward.
    np.testing.assert_allclose(grpo_advantages(rewards, ids, normalize_std=False)[4:].numpy(), [-1.0, 1.0])


def test_grpo_rejects_bad_inputs():
    with pytest.raises(ValueError):
        grpo_advantages(torch.zeros(3), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError):
        grpo_advantages(torch.zeros(3), torch.zeros(3))


group_strategy = st.lists(
    st.lists(st.floats(-100, 100, allow_nan=False, allow_infinity=False), min_size=1, max_size=8),
    min_size=1,
    max_size=8,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(groups=group_strategy, normalize_std=st.booleans(), perm_seed=st.integers(0, 2**16))
def test_grpo_property_zero_mean_and_permutation_equivariant(groups, normalize_std, perm_seed):
    rewards = [r for g in groups for r in g]
    ids = [7 * gi + 1 for gi, g in enumerate(groups) for _ in g]
    r, i = t64(np.array(rewards)), torch.tensor(ids)
    adv = grpo_advantages(r, i, normalize_std=normalize_std)
    assert torch.isfinite(adv).all()
    for gid in set(ids):
        sel = i == gid
        members = adv[sel]
        scale = 1.0 if normalize_std else max(1.0, float(r[sel].abs().max()))
        assert abs(float(members.sum())) <= 1e-9 * scale * len(members) + 1e-12
        if len(members) == 1:
            assert float(members[0]) == 0.0
        if normalize_std and len(members) > 1:
            # |adv| can never exceed the Bessel bound (n-1)/sqrt(n).
            n = len(members)
            assert float(members.abs().max()) <= (n - 1) / math.sqrt(n) + 1e-9
    perm = torch.from_numpy(np.random.default_rng(perm_seed).permutation(len(rewards)))
    adv_perm = grpo_advantages(r[perm], i[perm], normalize_std=normalize_std)
    torch.testing.assert_close(adv_perm, adv[perm])


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_plus_plus_baseline_matches_numpy(seed):
    rng = np.random.default_rng(seed)
    rewards, ids = make_groups(rng)
    got = reinforce_plus_plus_baseline_advantages(t64(rewards), torch.tensor(ids))
    want = np_rpp_baseline(rewards, ids, 1e-8)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-9, atol=1e-12)
    # Globally whitened: zero mean, unit (population) variance over the batch.
    assert abs(float(got.mean())) < 1e-9
    assert abs(float(got.var(unbiased=False)) - 1.0) < 1e-6


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma", [1.0, 0.9])
@pytest.mark.parametrize("seq_level", [True, False])
def test_reinforce_plus_plus_returns_matches_numpy(seed, gamma, seq_level):
    rng = np.random.default_rng(seed)
    B, T = 6, 9
    mask = make_mask(rng, B, T)
    kl = rng.normal(size=(B, T)) * 0.1
    kl[mask == 0] = 1e6  # padding garbage must not leak
    kl_coef = 0.05
    if seq_level:
        seq_r = rng.normal(size=B)
        token_r = np.zeros((B, T))
        for b in range(B):
            token_r[b, valid_positions(mask[b])[-1]] = seq_r[b]
        rewards_in = t64(seq_r)
    else:
        token_r = rng.normal(size=(B, T))
        rewards_in = t64(token_r)
    got = reinforce_plus_plus_returns(rewards_in, t64(kl), t64(mask), gamma=gamma, kl_coef=kl_coef)
    want = np_returns_rpp(token_r, kl, mask, gamma, kl_coef, 1e-8)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-9, atol=1e-10)
    assert torch.all(got[t64(mask) == 0] == 0)


def test_gae_hand_worked_three_tokens():
    # gamma=0.9, lambda=0.8, reward 1 on the last token, V = (0.5, 0.6, 0.7):
    #   d2 = 1 + 0.9*0   - 0.7 = 0.30             A2 = 0.30
    #   d1 = 0 + 0.9*0.7 - 0.6 = 0.03             A1 = 0.03 + 0.72*0.30  = 0.246
    #   d0 = 0 + 0.9*0.6 - 0.5 = 0.04             A0 = 0.04 + 0.72*0.246 = 0.21712
    #   returns = A + V = (0.71712, 0.846, 1.0)
    # A fourth, padded position holds garbage and must be ignored.
    rewards = torch.tensor([[0.0, 0.0, 1.0, 5.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.6, 0.7, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lambd=0.8)
    np.testing.assert_allclose(adv.numpy(), [[0.21712, 0.246, 0.30, 0.0]], atol=1e-12)
    np.testing.assert_allclose(ret.numpy(), [[0.71712, 0.846, 1.0, 0.0]], atol=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (1.0, 0.95), (0.99, 0.9), (0.5, 0.0)])
def test_gae_matches_numpy(seed, gamma, lam):
    rng = np.random.default_rng(seed)
    B, T = 5, 8
    mask = make_mask(rng, B, T, empty_row=True)
    rewards = rng.normal(size=(B, T))
    values = rng.normal(size=(B, T))
    adv, ret = gae(t64(rewards), t64(values), t64(mask), gamma=gamma, lambd=lam)
    want_adv, want_ret = np_gae(rewards, values, mask, gamma, lam)
    np.testing.assert_allclose(adv.numpy(), want_adv, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(ret.numpy(), want_ret, rtol=1e-10, atol=1e-12)


def test_gae_promotes_low_precision_and_is_detached():
    values = torch.randn(2, 4, dtype=torch.bfloat16, requires_grad=True)
    adv, ret = gae(torch.ones(2, 4, dtype=torch.bfloat16), values, torch.ones(2, 4), gamma=0.9, lambd=0.9)
    assert adv.dtype == torch.float32 and not adv.requires_grad and not ret.requires_grad


def test_broadcast_and_place_on_last_token():
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]])
    seq = torch.tensor([2.0, -1.0, 3.0])
    np.testing.assert_array_equal(broadcast_to_tokens(seq, mask).numpy(), [[2, 2, 0, 0], [-1, 0, -1, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(place_on_last_token(seq, mask).numpy(), [[0, 2, 0, 0], [0, 0, -1, 0], [0, 0, 0, 0]])


# ---------------------------------------------------------------------------
# The estimator dispatch the trainer calls (--advantage-estimator)
# ---------------------------------------------------------------------------


def _grouped_batch(rng, T=7):
    rewards, ids = make_groups(rng)
    mask = make_mask(rng, len(rewards), T)
    return rewards, ids, mask


def _last_token_rewards(rewards, mask):
    out = np.zeros(mask.shape)
    for b in range(mask.shape[0]):
        pos = valid_positions(mask[b])
        if pos:
            out[b, pos[-1]] = rewards[b]
    return out


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    "estimator,normalize_std", [("grpo", True), ("grpo", False), ("gspo", True), ("reinforce_plus_plus_baseline", True)]
)
def test_outcome_estimators_put_the_sequence_advantage_on_every_trained_token(seed, estimator, normalize_std):
    rng = np.random.default_rng(seed)
    rewards, ids, mask = _grouped_batch(rng)
    adv, returns = compute_advantages(
        estimator, t64(rewards), torch.tensor(ids), t64(mask), normalize_std=normalize_std
    )
    seq = (
        np_rpp_baseline(rewards, ids, 1e-8)
        if estimator == "reinforce_plus_plus_baseline"
        else np_grpo(rewards, ids, normalize_std, 1e-6)
    )
    want = np.where(mask != 0, seq[:, None], 0.0)
    np.testing.assert_allclose(adv.numpy(), want, rtol=1e-9, atol=1e-12)
    assert returns is None
    if estimator != "reinforce_plus_plus_baseline":
        # Zero-mean within each group (per sequence: every token carries its sequence's value).
        for g in np.unique(ids):
            assert abs(seq[ids == g].mean()) < 1e-9


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_penalises_kl_per_token_and_whitens(seed, gamma):
    rng = np.random.default_rng(seed)
    rewards, ids, mask = _grouped_batch(rng)
    kl = rng.normal(size=mask.shape) * 0.2
    adv, returns = compute_advantages(
        "reinforce_plus_plus", t64(rewards), torch.tensor(ids), t64(mask), kl=t64(kl), kl_coef=0.1, gamma=gamma
    )
    want = np_returns_rpp(_last_token_rewards(rewards, mask), kl, mask, gamma, 0.1, 1e-8)
    np.testing.assert_allclose(adv.numpy(), want, rtol=1e-9, atol=1e-10)
    assert returns is None


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    "gamma,lam,kl_coef,normalize", [(1.0, 1.0, 0.0, False), (0.99, 0.95, 0.05, False), (1.0, 0.9, 0.1, True)]
)
def test_ppo_is_gae_over_kl_penalised_token_rewards(seed, gamma, lam, kl_coef, normalize):
    rng = np.random.default_rng(seed)
    rewards, ids, mask = _grouped_batch(rng)
    values = rng.normal(size=mask.shape)
    values[mask == 0] = 1e6  # padding garbage must not leak
    kl = rng.normal(size=mask.shape) * 0.2
    adv, returns = compute_advantages(
        "ppo",
        t64(rewards),
        torch.tensor(ids),
        t64(mask),
        values=t64(values),
        kl=t64(kl),
        kl_coef=kl_coef,
        gamma=gamma,
        lambd=lam,
        normalize_advantages=normalize,
    )
    token_rewards = _last_token_rewards(rewards, mask) - kl_coef * np.where(mask != 0, kl, 0.0)
    want_adv, want_ret = np_gae(token_rewards, values, mask, gamma, lam)
    np.testing.assert_allclose(returns.numpy(), want_ret, rtol=1e-9, atol=1e-10)
    if normalize:
        flat = [want_adv[b, t] for b in range(mask.shape[0]) for t in valid_positions(mask[b])]
        white = iter(np_whiten_list(flat, 1e-8))
        want_adv = np.array(
            [[next(white) if mask[b, t] else 0.0 for t in range(mask.shape[1])] for b in range(mask.shape[0])]
        )
    np.testing.assert_allclose(adv.numpy(), want_adv, rtol=1e-9, atol=1e-10)


def test_estimator_dispatch_rejects_bad_input():
    r, ids, mask = torch.ones(2), torch.tensor([0, 0]), torch.ones(2, 3)
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        compute_advantages("a2c", r, ids, mask)
    with pytest.raises(ValueError, match="critic's values"):
        compute_advantages("ppo", r, ids, mask)

"""Advantage and return estimators shared by both training backends.

Pure tensor functions. Token-level inputs are padded ``[B, T]`` tensors
with a ``loss_mask`` marking trained tokens. Rows are right-padded, and a
mask may also have interior holes (tool-output tokens of a multi-turn
rollout): the recursive estimators treat a row's masked tokens as one
contiguous trajectory, so a hole neither discounts nor receives reward and
the recursion passes straight across it. Outputs are 0 outside the mask.

All estimators run under ``no_grad`` and return detached tensors in at
least float32: advantages are targets, never differentiated through, and
low-precision recurrences accumulate visible error over long sequences.

Whitening statistics are taken over whatever batch is passed in; for
batch-global whitening under data parallelism, call these on the full
rollout batch before it is sharded.
"""

from __future__ import annotations

import torch
from torch import Tensor

from miles_async.algorithms import ESTIMATORS
from miles_async.algorithms.losses import masked_whiten

__all__ = [
    "grpo_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "reinforce_plus_plus_returns",
    "gae",
    "broadcast_to_tokens",
    "place_on_last_token",
    "compute_advantages",
    "ESTIMATORS",
]


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _check_rate(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name}={value} must lie in [0, 1]")


def _check_token_shapes(**tensors: Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    first = next(iter(shapes.values()))
    if len(first) != 2 or any(s != first for s in shapes.values()):
        raise ValueError(f"expected matching [B, T] tensors; got {shapes}")


def _group_stats(rewards: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample (group mean, group unbiased std, group size)."""
    if rewards.dim() != 1 or group_index.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_index must be 1-D of equal length; got "
            f"{tuple(rewards.shape)} and {tuple(group_index.shape)}"
        )
    if group_index.is_floating_point():
        raise ValueError("group_index must hold integer group ids")
    # unique() maps arbitrary (non-contiguous, unsorted) ids to 0..G-1.
    uniq, inv = torch.unique(group_index, return_inverse=True)
    num_groups = uniq.numel()
    counts = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device).index_add_(
        0, inv, torch.ones_like(rewards)
    )
    sums = torch.zeros_like(counts).index_add_(0, inv, rewards)
    mean = (sums / counts)[inv]
    # Two-pass variance: stable for rewards with a large common offset.
    sq = torch.zeros_like(counts).index_add_(0, inv, (rewards - mean).square())
    std = torch.sqrt(sq / (counts - 1).clamp_min(1.0))[inv]
    return mean, std, counts[inv]


def grpo_advantages(
    rewards: Tensor,
    group_index: Tensor,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """GRPO outcome advantages: ``(r - mean_g) / (std_g + eps)``.

    ``group_index[i]`` is the integer id of the prompt group of sample ``i``;
    ids need not be contiguous or sorted and groups may differ in size (e.g.
    after filtering or partial async collection). ``std_g`` is the unbiased
    (Bessel-corrected) group std, matching the reference GRPO implementations
    (``torch.std`` default). ``normalize_std=False`` gives Dr. GRPO
    (mean-centring only). A group of size 1 has no baseline to compare
    against and gets advantage 0.
    """
    with torch.no_grad():
        r = rewards.detach().to(_compute_dtype(rewards))
        mean, std, size = _group_stats(r, group_index)
        adv = r - mean
        if normalize_std:
            adv = adv / (std + eps)
        return torch.where(size > 1, adv, torch.zeros_like(adv))


def reinforce_plus_plus_baseline_advantages(
    rewards: Tensor,
    group_index: Tensor,
    eps: float = 1e-8,
) -> Tensor:
    """REINFORCE++-baseline outcome advantages (Hu et al., 2025).

    The group mean is the baseline (``r - mean_g``), and the result is then
    whitened over the whole batch, ``(a - mean(a)) / sqrt(var(a) + eps)``,
    instead of per group: scaling by the batch std keeps the relative size
    of advantages across prompts, so near-uniform groups are not blown up
    the way per-group std division does. Population variance over samples
    (see :func:`~miles_async.algorithms.losses.masked_var`). Size-1 groups
    centre to 0 before whitening (and the batch mean of the centred values is
    0 by construction, so they stay ~0).

    To add a per-token KL penalty, place the result on each row's last token
    and use :func:`reinforce_plus_plus_returns`.
    """
    with torch.no_grad():
        centred = grpo_advantages(rewards, group_index, normalize_std=False)
        return masked_whiten(centred, torch.ones_like(centred), eps=eps)


def place_on_last_token(seq_values: Tensor, loss_mask: Tensor) -> Tensor:
    """Put ``seq_values[b]`` on the last masked token of row ``b`` (``[B, T]``).

    A row with an empty mask has no token to carry the value and is left 0.
    """
    if seq_values.dim() != 1 or loss_mask.dim() != 2 or loss_mask.shape[0] != seq_values.shape[0]:
        raise ValueError(
            f"expected seq_values [B] and loss_mask [B, T]; got {tuple(seq_values.shape)} and {tuple(loss_mask.shape)}"
        )
    mask = loss_mask.bool()
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).max(dim=-1).values
    out = torch.zeros(mask.shape, dtype=seq_values.dtype, device=seq_values.device)
    has_token = last >= 0
    rows = torch.arange(mask.shape[0], device=mask.device)[has_token]
    out[rows, last[has_token]] = seq_values[has_token]
    return out


def _masked_discounted_sum(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """``G_t = r_t + gamma * G_next`` over each row's masked tokens."""
    r = torch.where(mask, rewards, torch.zeros_like(rewards))
    if gamma == 1.0:
        # Undiscounted: a reverse cumsum is exact, vectorised over T, and holes
        # (zero reward) pass through unchanged just as in the recurrence.
        out = r.flip(-1).cumsum(-1).flip(-1)
    else:
        out = torch.zeros_like(r)
        carry = torch.zeros_like(r[:, 0])
        for t in range(r.shape[1] - 1, -1, -1):
            m = mask[:, t]
            step = r[:, t] + gamma * carry
            carry = torch.where(m, step, carry)
            out[:, t] = step
    return torch.where(mask, out, torch.zeros_like(out))


def reinforce_plus_plus_returns(
    rewards: Tensor,
    kl: Tensor | None,
    loss_mask: Tensor,
    gamma: float = 1.0,
    kl_coef: float = 0.0,
    eps: float = 1e-8,
) -> Tensor:
    """REINFORCE++ token advantages: whitened discounted KL-penalised returns.

    ``rewards`` is either ``[B, T]`` token rewards or ``[B]`` sequence rewards,
    which are placed on each row's last masked token. The per-token reward is
    ``r_t - kl_coef * kl_t`` (``kl`` is a per-token estimate such as
    :func:`~miles_async.algorithms.losses.compute_approx_kl`; ``None`` means
    no penalty). ``G_t = r_t + gamma * G_{t+1}`` runs over masked tokens and
    the returns are whitened over all masked tokens of the batch (population
    variance, ``rsqrt(var + eps)``). Padding and holes are 0 in the output.
    """
    _check_rate("gamma", gamma)
    with torch.no_grad():
        dtype = _compute_dtype(rewards)
        mask = loss_mask.bool()
        if rewards.dim() == 1:
            token_rewards = place_on_last_token(rewards.detach().to(dtype), loss_mask)
        else:
            token_rewards = rewards.detach().to(dtype)
        _check_token_shapes(rewards=token_rewards, loss_mask=loss_mask)
        if kl is not None:
            _check_token_shapes(rewards=token_rewards, kl=kl)
            penalty = torch.where(mask, kl.detach().to(dtype), torch.zeros_like(token_rewards))
            token_rewards = token_rewards - kl_coef * penalty
        returns = _masked_discounted_sum(token_rewards, mask, gamma)
        return masked_whiten(returns, mask.to(dtype), eps=eps)


def gae(
    rewards: Tensor,
    values: Tensor,
    loss_mask: Tensor,
    gamma: float = 1.0,
    lambd: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Generalised Advantage Estimation on padded ``[B, T]`` tensors.

    Over each row's masked tokens ``t`` with next masked token ``t'``:
    ``delta_t = r_t + gamma * V_t' - V_t`` and
    ``A_t = delta_t + gamma * lambd * A_t'``, where ``V`` and ``A`` beyond the
    last masked token are 0 (the response ends the episode). Returns
    ``(advantages, returns = advantages + values)``, 0 outside the mask.
    Rewards on unmasked positions are ignored, so place an outcome reward on
    the last masked token (:func:`place_on_last_token`). Advantages are not
    whitened here; use :func:`~miles_async.algorithms.losses.masked_whiten`.
    """
    _check_rate("gamma", gamma)
    _check_rate("lambd", lambd)
    _check_token_shapes(rewards=rewards, values=values, loss_mask=loss_mask)
    with torch.no_grad():
        dtype = torch.promote_types(_compute_dtype(rewards), _compute_dtype(values))
        mask = loss_mask.bool()
        zero = torch.zeros((), dtype=dtype, device=rewards.device)
        r = torch.where(mask, rewards.detach().to(dtype), zero)
        v = torch.where(mask, values.detach().to(dtype), zero)
        if gamma == 1.0 and lambd == 1.0:
            # With gamma = lambda = 1 the value terms telescope:
            # A_t = sum_{k >= t} r_k - V_t, which is a vectorised reverse cumsum.
            adv = r.flip(-1).cumsum(-1).flip(-1) - v
        else:
            adv = torch.zeros_like(r)
            next_value = torch.zeros_like(r[:, 0])
            next_adv = torch.zeros_like(r[:, 0])
            for t in range(r.shape[1] - 1, -1, -1):
                m = mask[:, t]
                delta = r[:, t] + gamma * next_value - v[:, t]
                a_t = delta + gamma * lambd * next_adv
                adv[:, t] = a_t
                next_value = torch.where(m, v[:, t], next_value)
                next_adv = torch.where(m, a_t, next_adv)
        adv = torch.where(mask, adv, zero)
        returns = torch.where(mask, adv + v, zero)
        return adv, returns


def broadcast_to_tokens(seq_adv: Tensor, loss_mask: Tensor) -> Tensor:
    """Copy each row's scalar advantage onto its masked tokens (``[B] -> [B, T]``)."""
    if seq_adv.dim() != 1 or loss_mask.dim() != 2 or loss_mask.shape[0] != seq_adv.shape[0]:
        raise ValueError(
            f"expected seq_adv [B] and loss_mask [B, T]; got {tuple(seq_adv.shape)} and {tuple(loss_mask.shape)}"
        )
    return torch.where(loss_mask.bool(), seq_adv[:, None], torch.zeros((), dtype=seq_adv.dtype, device=seq_adv.device))


def compute_advantages(
    estimator: str,
    rewards: Tensor,
    group_index: Tensor,
    loss_mask: Tensor,
    *,
    normalize_std: bool = True,
    values: Tensor | None = None,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    lambd: float = 1.0,
    normalize_advantages: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """One rollout batch's token advantages ``[B, T]`` (and value targets for ``ppo``).

    The dispatch both backends use, over the *whole* rollout batch (whitening and
    group baselines are batch statistics, so this runs before the batch is sharded):

    * ``grpo`` / ``gspo``: group-normalised outcome advantage on every token
      (``normalize_std=False`` is Dr. GRPO); gspo differs only in its loss.
    * ``reinforce_plus_plus_baseline``: group-mean baseline, batch-whitened.
    * ``reinforce_plus_plus``: whitened discounted returns of the outcome reward
      minus ``kl_coef * kl`` per token.
    * ``ppo``: GAE over the critic's ``values`` with the same KL-penalised token
      rewards; returns ``(advantages, returns)``, advantages whitened over the batch
      when ``normalize_advantages``.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; choose from {ESTIMATORS}")
    if estimator in ("grpo", "gspo"):
        seq = grpo_advantages(rewards, group_index, normalize_std=normalize_std)
        return broadcast_to_tokens(seq, loss_mask), None
    if estimator == "reinforce_plus_plus_baseline":
        return broadcast_to_tokens(reinforce_plus_plus_baseline_advantages(rewards, group_index), loss_mask), None
    if estimator == "reinforce_plus_plus":
        return reinforce_plus_plus_returns(rewards, kl, loss_mask, gamma=gamma, kl_coef=kl_coef), None
    if values is None:
        raise ValueError("the ppo estimator needs the critic's values")
    with torch.no_grad():
        token_rewards = place_on_last_token(rewards.detach().to(_compute_dtype(rewards)), loss_mask)
        if kl is not None and kl_coef:
            token_rewards = token_rewards - kl_coef * torch.where(loss_mask.bool(), kl.to(token_rewards.dtype), 0.0)
        adv, returns = gae(token_rewards, values, loss_mask, gamma=gamma, lambd=lambd)
        if normalize_advantages:
            adv = masked_whiten(adv, loss_mask.to(adv.dtype))
        return adv, returns

"""Per-token RL losses shared by the torch/FSDP and Megatron backends.

Every function here is a pure tensor function: no I/O, no global state, no
process-group calls. Shapes follow one convention: ``[B, T]`` padded
tensors with a ``loss_mask`` whose ones mark the tokens that are trained on
(response tokens; tool outputs and padding are zero).

Metrics are returned as detached 0-dim tensors rather than Python floats so
that a backend can reduce them across micro-batches and ranks without forcing
a device synchronisation per metric.

Padding positions of inputs such as ``logprobs`` may hold arbitrary values
(including ``inf``/``nan`` from a masked-out vocabulary entry); every function
selects with ``torch.where`` before any nonlinearity so such values can affect
neither the loss nor its gradient.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "KLType",
    "AggMode",
    "LossType",
    "TISLevel",
    "TISMode",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "compute_approx_kl",
    "aggregate_loss",
    "compute_tis_weights",
    "ppo_clipped_surrogate",
    "policy_loss",
    "value_loss",
    "entropy_from_logits",
    "logprobs_from_logits",
]

KLType = Literal["k1", "k2", "k3", "low_var_kl"]
AggMode = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]
LossType = Literal["ppo", "gspo", "cispo"]
TISLevel = Literal["token", "sequence"]
TISMode = Literal["truncate", "mask"]

_KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
_AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
_LOSS_TYPES = ("ppo", "gspo", "cispo")
_TIS_LEVELS = ("token", "sequence")
_TIS_MODES = ("truncate", "mask")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r}; expected one of {choices}")


def _masked(x: Tensor, mask: Tensor) -> Tensor:
    # where() instead of x * mask: 0 * inf is nan, and padding may hold inf.
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


# ---------------------------------------------------------------------------
# Masked statistics
# ---------------------------------------------------------------------------


def masked_mean(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Mean of ``x`` over the positions where ``mask`` is non-zero.

    ``mask`` may be 0/1 or fractional weights. An all-zero mask (over the
    reduced dims) yields 0 instead of nan, so an empty micro-batch contributes
    nothing rather than poisoning a reduction.
    """
    mask = mask.to(x.dtype)
    num = _masked(x * mask, mask)
    den = mask
    if dim is None:
        num, den = num.sum(), den.sum()
    else:
        num, den = num.sum(dim=dim), den.sum(dim=dim)
    return num / den.clamp_min(torch.finfo(x.dtype).tiny)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = False) -> Tensor:
    """Variance of ``x`` over the masked positions of the whole tensor.

    Population variance by default: whitening should give the batch exactly
    unit variance, and token counts are large enough that Bessel's correction
    is immaterial where it would matter.
    """
    mask = mask.to(x.dtype)
    mean = masked_mean(x, mask)
    sq = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        # torch.where rather than an `if` so no host sync is forced.
        sq = torch.where(n > 1, sq * n / (n - 1).clamp_min(1.0), torch.zeros_like(sq))
    return sq


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` with statistics over masked positions.

    Uses the population variance (see :func:`masked_var`). Positions outside
    the mask are returned as 0 so padding never carries a spurious value into
    a later loss. ``shift_mean=False`` rescales without centring, for callers
    that want to keep the sign of an already-baselined signal.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask)
    centred = x - mean
    out = (centred if shift_mean else x) * torch.rsqrt(var + eps)
    return _masked(out, mask)


# ---------------------------------------------------------------------------
# KL estimators
# ---------------------------------------------------------------------------


def compute_approx_kl(logprobs: Tensor, ref_logprobs: Tensor, kl_type: KLType = "k1") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of ``pi``.

    With ``log r = ref_logprobs - logprobs`` (Schulman, "Approximating KL
    Divergence"):

    * ``k1``: ``-log r = logprobs - ref_logprobs`` (unbiased, high variance,
      can be negative per token),
    * ``k2``: ``0.5 * (log r) ** 2`` (biased, low variance),
    * ``k3``: ``r - 1 - log r`` (unbiased, non-negative),
    * ``low_var_kl``: ``k3`` clamped to ``[-10, 10]``. The log-ratio is also
      clamped to ``[-20, 20]`` before ``exp``: past that range ``k3`` exceeds
      10 anyway, so values are unchanged, but it stops ``exp`` overflowing to
      ``inf`` and turning the (zero) clamped gradient into ``0 * inf = nan``.
    """
    _check_choice("kl_type", kl_type, _KL_TYPES)
    log_ratio = logprobs - ref_logprobs
    if kl_type == "k1":
        return log_ratio
    if kl_type == "k2":
        return 0.5 * log_ratio.square()
    neg = -log_ratio  # log r
    if kl_type == "low_var_kl":
        neg = neg.clamp(-20.0, 20.0)
        return (torch.exp(neg) - 1.0 - neg).clamp(-10.0, 10.0)
    return torch.exp(neg) - 1.0 - neg


# ---------------------------------------------------------------------------
# Loss aggregation
# ---------------------------------------------------------------------------


def aggregate_loss(per_token: Tensor, loss_mask: Tensor, mode: AggMode = "token_mean") -> Tensor:
    """Reduce a ``[B, T]`` per-token loss to a scalar.

    * ``token_mean``: sum over all masked tokens / number of masked tokens;
      every token weighs the same, so long sequences dominate.
    * ``seq_mean_token_mean``: per-sequence token mean, then mean over
      sequences; every sequence weighs the same (original GRPO / GSPO form).
    * ``seq_mean_token_sum``: per-sequence token sum, then mean over
      sequences (Dr. GRPO-style, no length normalisation inside a sequence).

    Rows with no masked token are left out of the sequence count in the two
    ``seq_mean_*`` modes (they would otherwise dilute the mean with zeros or,
    for ``seq_mean_token_mean``, produce 0/0). All modes return 0 (with a
    graph) for an all-zero mask.
    """
    _check_choice("mode", mode, _AGG_MODES)
    if per_token.dim() != 2 or per_token.shape != loss_mask.shape:
        raise ValueError(
            f"per_token and loss_mask must both be [B, T]; got {tuple(per_token.shape)} and {tuple(loss_mask.shape)}"
        )
    if mode == "token_mean":
        return masked_mean(per_token, loss_mask)
    mask = loss_mask.to(per_token.dtype)
    seq_sum = _masked(per_token * mask, mask).sum(dim=-1)
    seq_len = mask.sum(dim=-1)
    valid = (seq_len > 0).to(per_token.dtype)
    if mode == "seq_mean_token_mean":
        per_seq = seq_sum / seq_len.clamp_min(torch.finfo(per_token.dtype).tiny)
    else:
        per_seq = seq_sum
    return masked_mean(per_seq, valid)


# ---------------------------------------------------------------------------
# Policy loss
# ---------------------------------------------------------------------------


def compute_tis_weights(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    loss_mask: Tensor,
    *,
    tis_clip: float = 2.0,
    tis_clip_low: float = 0.0,
    tis_level: TISLevel = "token",
    tis_mode: TISMode = "truncate",
) -> tuple[Tensor, Tensor, Tensor]:
    """Importance weights correcting for the rollout engine's policy.

    The rollout engine (sampler) and the trainer compute slightly different
    probabilities for the same weights (kernels, precision, and in the async
    setting a lagging policy version), so the trainer's "old" policy is not
    the behaviour policy. The raw ratio is ``pi_old / pi_rollout``:

    * ``tis_level="token"``: ``exp(old - rollout)`` per token,
    * ``tis_level="sequence"``: ``exp(sum_t (old - rollout))`` over the masked
      tokens of the sequence, broadcast to all its tokens.

    ``tis_mode="truncate"`` clamps the ratio into ``[tis_clip_low, tis_clip]``
    (truncated IS). ``tis_mode="mask"`` (IcePop-style) keeps the raw ratio
    where it lies inside the band and sets the weight to 0 where it leaves it,
    which drops those tokens (or the whole sequence) from the gradient.

    Returns ``(weights, raw_ratio, clipped)``, all ``[B, T]``, detached, and
    zero outside ``loss_mask``; ``clipped`` is 1.0 where the weight was
    truncated or masked.
    """
    _check_choice("tis_level", tis_level, _TIS_LEVELS)
    _check_choice("tis_mode", tis_mode, _TIS_MODES)
    if not tis_clip_low <= tis_clip:
        raise ValueError(f"tis_clip_low={tis_clip_low} must be <= tis_clip={tis_clip}")
    with torch.no_grad():
        log_w = _masked(old_logprobs.detach() - rollout_logprobs.detach(), loss_mask)
        if tis_level == "sequence":
            log_w = log_w.sum(dim=-1, keepdim=True).expand_as(log_w)
        raw = torch.exp(log_w)
        outside = (raw < tis_clip_low) | (raw > tis_clip)
        if tis_mode == "truncate":
            weights = raw.clamp(tis_clip_low, tis_clip)
        else:
            weights = torch.where(outside, torch.zeros_like(raw), raw)
        clipped = outside.to(raw.dtype)
        return _masked(weights, loss_mask), _masked(raw, loss_mask), _masked(clipped, loss_mask)


def ppo_clipped_surrogate(
    ratio: Tensor,
    advantages: Tensor,
    eps_clip: float,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token PPO clipped surrogate loss (to be minimised).

    ``pg = max(-A * ratio, -A * clip(ratio, 1 - eps_clip, 1 + eps_clip_high))``
    and, with dual clip (Ye et al. 2020), for ``A < 0`` only:
    ``pg = min(pg, -A * eps_clip_c)``, which bounds the loss of a negative-
    advantage token whose ratio has exploded.

    Returns ``(pg, clipped, dual_clipped)``; the last two are float indicator
    tensors (1.0 where that branch is the active one).
    """
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + eps_high)
    pg = torch.maximum(loss_unclipped, loss_clipped)
    clipped = (loss_clipped > loss_unclipped).to(ratio.dtype)
    dual_clipped = torch.zeros_like(clipped)
    if eps_clip_c is not None:
        if eps_clip_c <= 1.0:
            raise ValueError(f"eps_clip_c={eps_clip_c} must be > 1 (dual clip lower bound)")
        bound = -advantages * eps_clip_c
        negative = advantages < 0
        dual_clipped = (negative & (bound < pg)).to(ratio.dtype)
        pg = torch.where(negative, torch.minimum(pg, bound), pg)
    return pg, clipped, dual_clipped


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    eps_clip: float = 0.2,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
    rollout_logprobs: Tensor | None = None,
    use_tis: bool = False,
    tis_clip: float = 2.0,
    tis_clip_low: float = 0.0,
    tis_level: TISLevel = "token",
    tis_mode: TISMode = "truncate",
    agg_mode: AggMode = "token_mean",
    loss_type: LossType = "ppo",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped policy-gradient loss for ``[B, T]`` inputs.

    ``advantages`` is ``[B, T]`` (a ``[B]`` tensor is broadcast over each
    row's tokens). ``old_logprobs`` are the trainer's log-probs of the policy
    that generated the batch (recomputed before the update);
    ``rollout_logprobs`` are the sampler's own log-probs of the same tokens.

    ``loss_type``:

    * ``"ppo"``: ``ratio = exp(logprobs - old_logprobs)`` per token, then
      :func:`ppo_clipped_surrogate` (clip + optional dual clip).
    * ``"gspo"`` (Zheng et al. 2025): the ratio is the sequence-level,
      length-normalised ``s_i = exp(mean_t(logprobs - old_logprobs))`` over
      the row's masked tokens. Each token uses
      ``s_i,t = sg[s_i] * exp(logprobs_t - sg[logprobs_t])``, whose value is
      ``s_i`` and whose gradient is ``s_i * grad logprobs_t``; it then goes
      through the same clipped surrogate (``eps_clip``/``eps_clip_high``,
      which for GSPO are typically ~3e-4/4e-4). With
      ``agg_mode="seq_mean_token_mean"`` and a per-sequence advantage the
      gradient equals that of the paper's sequence objective
      ``mean_i max(-A_i s_i, -A_i clip(s_i))``. Dual clip applies as in PPO.
    * ``"cispo"`` (MiniMax-M1): per token
      ``loss = -sg[clip(ratio, 1 - eps_clip, 1 + eps_clip_high)] * A * logprobs``.
      The clipped IS weight is detached, so every token keeps a gradient
      (``-w * A * grad logprobs``) instead of being zeroed by the clip. The
      loss value itself is not meaningful, only its gradient. MiniMax-M1 uses
      no lower bound; pass ``eps_clip >= 1`` to get that. ``eps_clip_c`` is
      rejected because dual clipping has no meaning for this form.

    TIS (``use_tis``): the detached weights of :func:`compute_tis_weights`
    multiply the per-token loss before aggregation; the aggregation
    denominator is unchanged, so tokens masked by ``tis_mode="mask"``
    contribute zero rather than being removed from the count.

    Returns ``(loss, metrics)``; every metric is a detached 0-dim tensor and
    a mean over masked tokens (independent of ``agg_mode``):
    ``pg_loss``, ``clipfrac``, ``approx_kl`` (k1 of KL(old || new):
    ``mean(old - new)``), ``ratio_mean``, ``ratio_max``; ``dual_clipfrac``
    when ``eps_clip_c`` is set; ``train_rollout_kl`` (``mean(rollout - old)``,
    the k1 estimate of KL(rollout || old), sampled from the rollout policy)
    and ``train_rollout_logprob_abs_diff`` whenever ``rollout_logprobs`` is
    given; ``tis_mean``/``tis_max`` (raw ratio), ``tis_weight_mean``/``tis_weight_max``
    (applied weight) and ``tis_clipfrac`` when ``use_tis``.
    """
    _check_choice("loss_type", loss_type, _LOSS_TYPES)
    _check_choice("agg_mode", agg_mode, _AGG_MODES)
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T]; got {tuple(logprobs.shape)}")
    for name, t in (("old_logprobs", old_logprobs), ("loss_mask", loss_mask)):
        if t.shape != logprobs.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != logprobs shape {tuple(logprobs.shape)}")
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logprobs)
    if advantages.shape != logprobs.shape:
        raise ValueError(f"advantages shape {tuple(advantages.shape)} incompatible with {tuple(logprobs.shape)}")
    if use_tis and rollout_logprobs is None:
        raise ValueError("use_tis=True requires rollout_logprobs")
    if loss_type == "cispo" and eps_clip_c is not None:
        raise ValueError("eps_clip_c (dual clip) is not defined for loss_type='cispo'")

    mask = loss_mask.to(logprobs.dtype)
    advantages = _masked(advantages.detach().to(logprobs.dtype), mask)
    old_logprobs = old_logprobs.detach()
    # Masking the log-ratio first keeps garbage at padding out of exp() and
    # gives padded logprobs an exact zero gradient.
    log_ratio = _masked(logprobs - old_logprobs, mask)
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high

    metrics: dict[str, Tensor] = {}
    dual_clipped: Tensor | None = None
    if loss_type == "ppo":
        ratio = torch.exp(log_ratio)
        pg, clipped, dual_clipped = ppo_clipped_surrogate(ratio, advantages, eps_clip, eps_high, eps_clip_c)
    elif loss_type == "gspo":
        seq_log_ratio = masked_mean(log_ratio, mask, dim=-1)
        token_log_ratio = seq_log_ratio.detach()[:, None] + log_ratio - log_ratio.detach()
        ratio = torch.exp(token_log_ratio)
        pg, clipped, dual_clipped = ppo_clipped_surrogate(ratio, advantages, eps_clip, eps_high, eps_clip_c)
    else:
        ratio = torch.exp(log_ratio)
        is_weight = ratio.detach().clamp(1.0 - eps_clip, 1.0 + eps_high)
        clipped = (is_weight != ratio.detach()).to(ratio.dtype)
        pg = -is_weight * advantages * _masked(logprobs, mask)

    if rollout_logprobs is not None:
        if rollout_logprobs.shape != logprobs.shape:
            raise ValueError(
                f"rollout_logprobs shape {tuple(rollout_logprobs.shape)} != logprobs shape {tuple(logprobs.shape)}"
            )
        diff = _masked(rollout_logprobs.detach().to(logprobs.dtype) - old_logprobs, mask)
        metrics["train_rollout_kl"] = masked_mean(diff, mask).detach()
        metrics["train_rollout_logprob_abs_diff"] = masked_mean(diff.abs(), mask).detach()
    if use_tis:
        assert rollout_logprobs is not None
        weights, raw, tis_clipped = compute_tis_weights(
            old_logprobs,
            rollout_logprobs.to(logprobs.dtype),
            mask,
            tis_clip=tis_clip,
            tis_clip_low=tis_clip_low,
            tis_level=tis_level,
            tis_mode=tis_mode,
        )
        pg = pg * weights
        metrics["tis_mean"] = masked_mean(raw, mask)
        metrics["tis_max"] = _masked_max(raw, mask)
        metrics["tis_weight_mean"] = masked_mean(weights, mask)
        metrics["tis_weight_max"] = _masked_max(weights, mask)
        metrics["tis_clipfrac"] = masked_mean(tis_clipped, mask)

    loss = aggregate_loss(pg, mask, agg_mode)

    with torch.no_grad():
        metrics["pg_loss"] = loss.detach()
        metrics["clipfrac"] = masked_mean(clipped, mask)
        metrics["approx_kl"] = masked_mean(-log_ratio.detach(), mask)
        metrics["ratio_mean"] = masked_mean(ratio.detach(), mask)
        metrics["ratio_max"] = _masked_max(ratio.detach(), mask)
        if eps_clip_c is not None and dual_clipped is not None:
            metrics["dual_clipfrac"] = masked_mean(dual_clipped, mask)
    return loss, metrics


def _masked_max(x: Tensor, mask: Tensor) -> Tensor:
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return zero
    sel = torch.where(mask.bool(), x, torch.full((), -math.inf, dtype=x.dtype, device=x.device))
    return torch.where(mask.bool().any(), sel.max(), zero).detach()


# ---------------------------------------------------------------------------
# Value loss
# ---------------------------------------------------------------------------


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    loss_mask: Tensor,
    value_clip: float | None = None,
    agg_mode: AggMode = "token_mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO critic loss ``0.5 * max((V - R)^2, (V_clip - R)^2)`` per token.

    ``V_clip = old_values + clip(values - old_values, -value_clip, value_clip)``;
    with ``value_clip=None`` the loss is the plain ``0.5 * (V - R)^2``.
    The max makes the clip pessimistic: it only removes gradient when the
    new prediction moved further than ``value_clip`` *and* that move reduced
    the error.

    Metrics (detached, means over masked tokens): ``vf_loss``, ``vf_clipfrac``
    (fraction where the clipped error is the larger one), ``values_mean``,
    ``returns_mean``.
    """
    _check_choice("agg_mode", agg_mode, _AGG_MODES)
    mask = loss_mask.to(values.dtype)
    values_m = _masked(values, mask)
    old_values = _masked(old_values.detach().to(values.dtype), mask)
    returns = _masked(returns.detach().to(values.dtype), mask)
    err_unclipped = (values_m - returns).square()
    if value_clip is None:
        per_token = 0.5 * err_unclipped
        clipped = torch.zeros_like(err_unclipped)
    else:
        values_clipped = old_values + (values_m - old_values).clamp(-value_clip, value_clip)
        err_clipped = (values_clipped - returns).square()
        per_token = 0.5 * torch.maximum(err_unclipped, err_clipped)
        clipped = (err_clipped > err_unclipped).to(values.dtype)
    loss = aggregate_loss(per_token, mask, agg_mode)
    with torch.no_grad():
        metrics = {
            "vf_loss": loss.detach(),
            "vf_clipfrac": masked_mean(clipped, mask),
            "values_mean": masked_mean(values_m.detach(), mask),
            "returns_mean": masked_mean(returns, mask),
        }
    return loss, metrics


# ---------------------------------------------------------------------------
# Logits helpers
# ---------------------------------------------------------------------------


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of ``softmax(logits)`` over the last dim.

    ``H = logsumexp(z) - sum(softmax(z) * z)`` with ``z`` shifted by its
    (detached) row max. The form never takes ``log`` of a probability, so
    tokens with underflowing probability do not produce ``0 * -inf``; the
    shift keeps both terms O(log V) so their difference does not cancel
    catastrophically for large logits. Detaching the max is exact because
    entropy is shift-invariant. Computed in the input dtype; upcast bf16
    logits first if the entropy must be accurate.
    """
    shifted = logits - logits.detach().amax(dim=-1, keepdim=True)
    lse = torch.logsumexp(shifted, dim=-1)
    probs = torch.softmax(shifted, dim=-1)
    return lse - (probs * shifted).sum(dim=-1)


def logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """``log_softmax(logits)[..., labels]`` without materialising the log-softmax.

    Gathers the label logit and subtracts ``logsumexp`` so that nothing of
    shape ``[..., V]`` beyond ``logits`` itself is saved for backward (a
    log-softmax or a max-shifted copy would each add one, which at
    ``V ~ 1.5e5`` is gigabytes per micro-batch). The price is an absolute
    rounding error of about one ulp of the largest logit (~4e-6 in fp32 for
    logits near 30), far below the noise in the ratios it feeds.
    """
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels shape {tuple(labels.shape)} must equal logits.shape[:-1] {tuple(logits.shape[:-1])}")
    picked = torch.gather(logits, -1, labels.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)

"""Tolerances for comparing two floating-point computations of the same quantity, derived from the arithmetic.

Two correct computations that differ only in the order of their rounded operations (another matmul blocking or
SIMD width, another CPU, a split over workers or tensor-parallel ranks, a packed layout) agree to a bound that
follows from the dtype and the size of the reduction, not from what one CPU happened to produce:

* A sum or dot product of n terms, computed in any order, is within gamma_n * S of the exact value, where
  gamma_n = n*u / (1 - n*u), u is the dtype's unit roundoff and S the sum of the terms' absolute values (Higham,
  Accuracy and Stability of Numerical Algorithms, 2nd ed., section 3.1 and Lemma 3.1). The bound holds for every
  order, so it covers any CPU's kernels as long as they compute in that dtype; two computations then differ by at
  most 2 * gamma_n * S. Through a network the relative errors of the chained operations add (to first order), so n
  is the sum of the reduction lengths along the longest chain: ``transformer_depth`` counts them. It is a
  worst case (every rounding error aligned); measured errors sit orders of magnitude below it, and gross bugs (a
  missing token, a wrong shard) far above it, which each comparison's negative control checks.
* A log-prob is compared at its noise scale instead (``noise_tolerance``), since a subtle bug moves it by less
  than the worst case: with the rope delta dropped from the embedded engine's decode steps (a tiny Qwen2-VL's image
  prompt 12 positions off) its log-probs moved by 1.6e-3 to 4.9e-3, around the worst-case 2.4e-3. Rounding errors
  of independent operations add like a random walk: a rounding's relative error, at most u, spreads over [-u, u]
  with a standard deviation of about u / sqrt(3), so n of them over terms of size S have a standard deviation of
  at most sqrt(n / 3) * u * S, and the difference of two computations sqrt(2 n / 3) * u * S (the sqrt(n)-sized
  bound of Higham and Mary, "A new approach to probabilistic rounding error analysis", SIAM J. Sci. Comput. 41(5),
  2019). A comparison allows ``NOISE_SIGMAS`` of those, capped by the worst case. Every term taken as large as S,
  that deviation overstates the measured one: the measured differences sit at 0.25 of it at most (float32, every
  path's values in ``noise_tolerance``'s docstring), so the 5-sigma bound lies 20x or more above them, and 16x or
  more below the rope-delta bug's.
* Adam's update normalises the gradient: its first step is lr * g / (|g| + eps), which for |g| well above eps is
  +-lr whatever the rounding of g, but for |g| near or below eps has a gain of up to lr / eps (1e6 for lr 1e-2,
  eps 1e-8) on the gradient's absolute rounding. So a weight after an Adam step is compared against the range of
  the update over every gradient within the gradient's tolerance (``adam_tolerance``), element by element: tight
  where the gradient is determined by the arithmetic, up to 2 * lr where it is rounding noise around zero.
  After the first step the two runs' weights differ, and the next gradient differs through the loss's curvature,
  which no rounding bound covers: comparisons across computations stop at the first optimizer step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

UNIT_ROUNDOFF = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
}

# Elementwise roundings per transformer layer beyond its reductions: two RMSNorm scalings and their rsqrt, RoPE's
# product and sum, the attention scale, softmax's exp and division, SiLU's exp and division, the gate product and
# two residual adds; rounded up.
_ELEMENTWISE_PER_LAYER = 16
# Roundings of one element of an Adam(W) update beyond the gradient: the two moments, their bias corrections, the
# square root, eps, the division, lr, weight decay and the subtraction; rounded up.
_ADAM_ELEMENTWISE = 12


def unit_roundoff(dtype: torch.dtype) -> float:
    return UNIT_ROUNDOFF[dtype]


def gamma(n: int, dtype: torch.dtype = torch.float32) -> float:
    """Higham's gamma_n: the relative error bound of n chained roundings (a sum of n + 1 terms in any order)."""
    nu = n * unit_roundoff(dtype)
    if nu >= 1:
        raise ValueError(f"{n} roundings in {dtype} (u = {unit_roundoff(dtype):g}): n*u >= 1 bounds nothing")
    return nu / (1 - nu)


def transformer_depth(config: Any, seq_len: int) -> int:
    """Chained roundings from the weights to one logit of a decoder (an HF config), for sequences of up to
    ``seq_len`` tokens: per layer the reductions of RMSNorm (hidden), the q/k/v projections (hidden), q.k (head
    dim; twice with Qwen3's q/k norm), softmax and the weighted sum of values (the sequence, each), the output
    projection (heads * head dim), the MLP's gate/up (hidden) and down (the largest of the dense, expert and
    shared-expert intermediate sizes) projections, plus ``_ELEMENTWISE_PER_LAYER``; in an MoE layer also the
    router (hidden), its softmax (experts) and the weighted sum of the chosen experts and the shared one (top-k + 1)
    with its gate (hidden); then the final norm and the LM head (hidden)."""
    hidden = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    qk = head_dim * (2 if config.model_type in ("qwen3", "qwen3_moe") else 1)
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0
    shared = getattr(config, "shared_expert_intermediate_size", None) or 0
    moe = 2 * hidden + experts + config.num_experts_per_tok + 1 if experts else 0
    ffn = max(config.intermediate_size, getattr(config, "moe_intermediate_size", None) or 0, shared)
    per_layer = (
        4 * hidden + qk + 2 * seq_len + config.num_attention_heads * head_dim + ffn + moe + _ELEMENTWISE_PER_LAYER
    )
    return config.num_hidden_layers * per_layer + 2 * hidden + 2


def vision_depth(config: Any, seq_len: int) -> int:
    """Chained roundings of a vision-language model's image embeddings (Qwen2-VL's tower: an HF config with a
    ``vision_config``), 0 without one: the patch embedding (channels x frames x patch area), per block the
    reductions of a pre-norm transformer layer over up to ``seq_len`` * merge area patches, then the merger's
    norm and its two projections."""
    vc = getattr(config, "vision_config", None)
    if vc is None:
        return 0
    # Qwen2-VL names the tower's width embed_dim and its MLP by a ratio; Qwen2.5-VL hidden_size and intermediate_size.
    embed = getattr(vc, "embed_dim", None) or vc.hidden_size
    ffn = int(embed * vc.mlp_ratio) if getattr(vc, "mlp_ratio", None) else vc.intermediate_size
    merge = vc.spatial_merge_size
    patches = seq_len * merge * merge
    patch = vc.in_channels * vc.temporal_patch_size * vc.patch_size * vc.patch_size
    per_block = 4 * embed + embed // vc.num_heads + 2 * patches + embed + ffn
    return patch + vc.depth * (per_block + _ELEMENTWISE_PER_LAYER) + embed + 2 * embed * merge * merge


def forward_tolerance(depth: int, scale: float) -> float:
    """How far two float32 computations of a quantity ``depth`` roundings deep, over terms of total size
    ``scale``, can differ: 2 gamma_depth * scale."""
    return 2 * gamma(depth) * scale


# Standard deviations of the random-rounding model that a log-prob comparison allows (``noise_tolerance``): a
# normal variable leaves 5 of them once in 1.7 million draws, and the model's deviation is itself 4x or more the
# largest measured difference.
NOISE_SIGMAS = 5.0


def noise_tolerance(depth: int, scale: float) -> float:
    """How far two float32 computations of a log-prob ``depth`` roundings deep, over terms of size ``scale``, may
    differ at the noise scale of their rounding: ``NOISE_SIGMAS`` standard deviations of the difference of two
    random walks of ``depth`` roundings, sqrt(2 depth / 3) * u * scale (module docstring), capped by the worst
    case ``forward_tolerance``.

    Measured, float32, 2026-12-07: the largest |diff| over each comparison's tokens (over 1 to 4 runs), and the
    tolerance (sd: the model's standard deviation, a fifth of it):
    * embedded engine vs trainer, tiny VLMs (9.8e-5; sd 2.0e-5): Qwen2-VL 4.8e-7, after two training steps 1.2e-6
      to 4.3e-6, a resumed sample 6.3e-7 to 3.8e-6; Qwen3-VL 4.8e-7, after the steps 9.5e-7 to 3.1e-6; LoRA merged
      4.8e-7; the prefill's whole log-softmax 4.8e-7. The rope-delta bug: 1.6e-3 to 4.9e-3 over 7 runs (16-50x).
    * embedded engine, tiny text model (4.2e-5 to 7.9e-5 at temperatures 1.3 to 0.7): vs transformers 2.4e-7 to
      1.9e-6, vs a trained trainer 1.7e-6 to 2.4e-6 (6.9e-5).
    * SGLang and vLLM (CPU) vs transformers or the trainer: text 4.8e-7 (6.9e-5), after a weight update 9.5e-7
      (vLLM, from disk) to 3.5e-6 (SGLang, from tensors and over a process group; the largest: 0.25 sd); image
      prompts 2.4e-7 to 7.2e-7 (1.2e-4); SGLang's MoE after an update 2.3e-6 (7.7e-5).
    * trainer vs trainer: shared prefix vs one row per sample 4.8e-7 to 7.2e-7 (6.7e-5), FSDP2 two workers vs one
      0 to 4.8e-7, chunked log-probs and a kept weight version 0; Megatron under routing replay vs the torch backend
      4.8e-7 at one rank and at TP 2 x PP 2 (7.5e-5).
    """
    sd = math.sqrt(2 * depth / 3) * unit_roundoff(torch.float32) * scale
    return min(NOISE_SIGMAS * sd, forward_tolerance(depth, scale))


@dataclass(frozen=True)
class StepBounds:
    """The float32 rounding bounds of one training step of a model over a batch's token rows."""

    forward: int  # roundings chained into one log-prob: ``transformer_depth`` and log-softmax's sum (vocab)
    gradient: int  # into one weight's gradient: the backward pass mirrors the forward's reductions, then the
    # sum over the step's tokens
    vocab_size: int
    max_advantage: float  # GRPO's, normalised by the group's standard deviation: (n - 1) / sqrt(n) for n samples

    @classmethod
    def of(cls, model_dir: Any, rows: list[list[int]], group_size: int = 1) -> StepBounds:
        """For the HF model at ``model_dir`` and a batch of token ``rows`` (a step's tokens are at most all of
        them) in groups of ``group_size``."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_dir)
        text = config.get_text_config()  # a VLM's language model; a causal LM's own config
        longest = max(len(r) for r in rows)
        forward = transformer_depth(text, longest) + vision_depth(config, longest) + text.vocab_size + 2
        return cls(
            forward,
            2 * forward + sum(len(r) for r in rows),
            text.vocab_size,
            (group_size - 1) / math.sqrt(group_size),
        )

    @property
    def logprob_scale(self) -> float:
        """The size of a log-prob's terms, z_y and logsumexp(z): |log p| <= log(vocab) + 2 max|z|, at most
        2 log(vocab) for logits below log(vocab) / 2 in size (the tiny random models' are below 1.5)."""
        return 2 * math.log(self.vocab_size)

    @property
    def logprob(self) -> float:
        """Tolerance of a log-prob: at the noise scale of its rounding (``noise_tolerance``)."""
        return noise_tolerance(self.forward, self.logprob_scale)

    @property
    def metric(self) -> float:
        """Tolerance of a step metric (loss, policy loss, entropy, KL): a mean over tokens of log-probs,
        weighed by an advantage times an importance ratio near 1 in the policy loss."""
        return forward_tolerance(self.forward, self.logprob_scale * (1 + self.max_advantage))


def gradient_tolerance(
    reference: Mapping[str, torch.Tensor], depth: int, clipped: bool
) -> tuple[dict[str, torch.Tensor], float]:
    """Per-element tolerance of a step's float32 gradients (``reference``: one computation's, after clipping)
    and the relative tolerance of the gradient norm.

    Each element is ``depth`` roundings deep over terms whose magnitude is taken as its tensor's largest gradient
    (the sum over a step's tokens cancels, since advantages have both signs; the worst-case gamma_n leaves room for
    terms several times larger). With --clip-grad active each computation divides by its own norm, whose error is
    the gradient's error in norm plus that of a sum of squares over the largest tensor and the tensors' norms:
    a relative error on every element."""
    grads = {k: g.detach().double() for k, g in reference.items()}
    g_depth = 2 * gamma(depth)
    tol = {k: torch.full_like(g, g_depth * float(g.abs().max())) for k, g in grads.items()}
    norm = math.sqrt(sum(float((g * g).sum()) for g in grads.values()))
    err = math.sqrt(sum(float((t * t).sum()) for t in tol.values()))
    norm_terms = max(g.numel() for g in grads.values()) + len(grads)
    rel = err / norm + gamma(norm_terms) if norm > 0 else 0.0
    if clipped:
        tol = {k: t + rel * grads[k].abs() for k, t in tol.items()}
    return tol, rel


def adam_tolerance(
    grads: Mapping[str, torch.Tensor],
    grad_tol: Mapping[str, torch.Tensor],
    weights_after: Mapping[str, torch.Tensor],
    hyper: Mapping[str, Any],
    step: int,
    state: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> dict[str, torch.Tensor]:
    """Per-element tolerance of the weights after Adam(W) step ``step`` (1-based) from the same weights and the
    same moments (``state``: name -> (exp_avg, exp_avg_sq) before the step; none for the first step), when the two
    computations' gradients differ by at most ``grad_tol`` around ``grads``.

    The update is lr * d(g) with d(g) = m_hat(g) / (sqrt(v_hat(g)) + eps); its range over g +- grad_tol is taken on
    65 evenly spaced points, which include the ends (d is monotone in g on the first step, so the ends give the
    range exactly; with moments it has at most one turning point). Each computation rounds the update too:
    ``_ADAM_ELEMENTWISE`` roundings of lr * d and two of the weight."""
    lr, (beta1, beta2), eps = hyper["lr"], hyper["betas"], hyper["eps"]
    c1, c2 = 1 - beta1**step, 1 - beta2**step
    offsets = torch.linspace(-1.0, 1.0, 65, dtype=torch.float64)
    u = unit_roundoff(torch.float32)
    out = {}
    for k, g in grads.items():
        g = g.detach().double()
        m, v = (s.detach().double() for s in state[k]) if state is not None else (torch.zeros_like(g),) * 2

        def direction(x: torch.Tensor, m: torch.Tensor = m, v: torch.Tensor = v) -> torch.Tensor:
            m_hat = (beta1 * m + (1 - beta1) * x) / c1
            v_hat = (beta2 * v + (1 - beta2) * x * x) / c2
            return m_hat / (v_hat.sqrt() + eps)

        at = direction(g)
        grid = g.unsqueeze(-1) + grad_tol[k].double().unsqueeze(-1) * offsets
        around = direction(grid, m.unsqueeze(-1), v.unsqueeze(-1))
        spread = (around - at.unsqueeze(-1)).abs().amax(-1)
        rounding = 2 * (2 * u * weights_after[k].double().abs() + gamma(_ADAM_ELEMENTWISE) * lr * at.abs())
        out[k] = lr * spread + rounding
    return out


def record_first_step(
    actor: Any,
    weights: Callable[[], dict[str, torch.Tensor]],
    grads: Callable[[], dict[str, torch.Tensor]] | None = None,
) -> dict[str, Any]:
    """Wraps a train actor's optimizer step: once its first step has run, the returned dict holds the weights
    before and after it, its gradients (``grads``: after clipping), its metrics so far (one entry per micro-batch)
    and the optimizer's settings for it. ``weights`` and ``grads`` run on every rank (they may gather)."""
    first: dict[str, Any] = {}
    inner = actor._train_step

    def train_step(batch, idx, temperature, loss_of, metrics_acc):
        if first:
            return inner(batch, idx, temperature, loss_of, metrics_acc)
        group = actor.optimizer.param_groups[0]  # before the step: the torch backend's scheduler moves it after
        hyper = {k: group[k] for k in ("lr", "betas", "eps", "weight_decay")}
        before = weights()
        inner(batch, idx, temperature, loss_of, metrics_acc)
        first.update(
            before=before,
            after=weights(),
            grads=grads() if grads is not None else None,
            metrics={k: list(v) for k, v in metrics_acc.items()},
            hyper=hyper,
        )

    actor._train_step = train_step
    return first


def assert_same_first_step(
    reference: dict[str, Any],
    other: dict[str, Any],
    bounds: StepBounds,
    metrics: tuple[str, ...] = (),
    clip_grad: float = 1.0,
    step: int = 1,
    state: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> dict[str, float]:
    """Two computations' first optimizer step (``record_first_step``) from the same weights agree as the
    arithmetic allows: the step's ``metrics`` per micro-batch, its gradient norm, gradients (when ``other`` has
    them) and weights after the step. Negative controls: a copy of ``other`` with one shard misplaced or left
    unstepped, or its micro-batches shifted, must fail the same comparisons. Returns each comparison's largest
    |diff| / tolerance (the margin)."""
    assert other["hyper"] == reference["hyper"], (other["hyper"], reference["hyper"])
    norm = reference["metrics"]["grad_norm"][0]
    grad_tol, norm_rel = gradient_tolerance(reference["grads"], bounds.gradient, clipped=norm > clip_grad > 0)
    weight_tol = adam_tolerance(reference["grads"], grad_tol, reference["after"], reference["hyper"], step, state)
    margins = {"weights": assert_within(other["after"], reference["after"], weight_tol, "weights after the step")}
    margins["grad_norm"] = assert_within(
        other["metrics"]["grad_norm"][0], norm, norm_rel * norm, "gradient norm of the step"
    )
    tol = bounds.metric
    margins["metrics"] = max(
        [assert_within(other["metrics"][k], reference["metrics"][k], tol, f"step metric {k}") for k in metrics],
        default=0.0,
    )
    # A shard (half of the rows of the largest matrix whose second half the step moved: an untied embedding's rows
    # of unseen tokens stay put) the step did not reach, or moved to the other half.
    after, before = reference["after"], reference["before"]
    moved = [
        k
        for k in after
        if after[k].dim() and not after[k][after[k].shape[0] // 2 :].equal(before[k][after[k].shape[0] // 2 :])
    ]
    name = max(moved, key=lambda k: after[k].numel())
    half = reference["after"][name].shape[0] // 2
    unstepped = dict(other["after"])
    unstepped[name] = torch.cat([other["after"][name][:half], reference["before"][name][half:]])
    assert_rejected(unstepped, reference["after"], weight_tol, "weights with a shard left unstepped")
    if other["grads"] is not None:
        margins["grads"] = assert_within(other["grads"], reference["grads"], grad_tol, "gradients of the step")
        misplaced = dict(other["grads"])
        misplaced[name] = other["grads"][name].roll(half, 0)
        assert_rejected(misplaced, reference["grads"], grad_tol, "gradients with two shards swapped")
    # Each micro-batch's metric beside the next one's, where the micro-batches differ by more than the tolerance
    # (at the first step the importance ratio is 1 and its KL 0 in every micro-batch, up to rounding).
    for k in metrics:
        values = reference["metrics"][k]
        if max(values) - min(values) > 2 * tol:
            shifted = other["metrics"][k][1:] + other["metrics"][k][:1]
            assert_rejected(shifted, values, tol, f"step metric {k} of the next micro-batch")
    return margins


def _as_dict(x: Any) -> dict[str, Any]:
    return dict(x) if isinstance(x, Mapping) else {"": x}


def worst(actual: Any, expected: Any, tol: Any) -> tuple[float, str]:
    """The largest |actual - expected| / tol over every element (and where), for tensors, floats or dicts of
    them with the same keys; above 1 the two disagree beyond the tolerance."""
    a, e = _as_dict(actual), _as_dict(expected)
    t = _as_dict(tol) if isinstance(tol, Mapping) else dict.fromkeys(e, tol)
    if a.keys() != e.keys():
        return math.inf, f"different names: {sorted(a.keys() ^ e.keys())}"
    ratio, where = 0.0, ""
    for k in e:
        x, y = torch.as_tensor(a[k]).double(), torch.as_tensor(e[k]).double()
        if x.shape != y.shape:
            return math.inf, f"{k}: shape {tuple(x.shape)} vs {tuple(y.shape)}"
        diff, bound = (x - y).abs(), torch.as_tensor(t[k]).double().expand_as(x)
        r = torch.where(diff == 0, torch.zeros_like(diff), diff / bound)  # 0/0 is agreement; d/0 is infinite
        if r.numel() and float(r.max()) > ratio:
            i = int(r.argmax())
            ratio = float(r.flatten()[i])
            x_i, y_i, d_i, b_i = (float(v.flatten()[i]) for v in (x, y, diff, bound))
            where = (
                f"{k}[{i}]: {x_i!r} vs {y_i!r}, |diff| {d_i:.3g}, tolerance {b_i:.3g} "
                f"({int((r > 1).sum())} of {r.numel()} elements beyond it)"
            )
    return ratio, where


def assert_within(actual: Any, expected: Any, tol: Any, what: str) -> float:
    """Asserts that every element agrees within its tolerance; returns the largest |diff| / tolerance."""
    ratio, where = worst(actual, expected, tol)
    assert ratio <= 1, f"{what}: {where}"
    return ratio


def assert_rejected(broken: Any, expected: Any, tol: Any, what: str) -> None:
    """The negative control: a deliberately broken copy must fail the same comparison."""
    ratio, _ = worst(broken, expected, tol)
    assert ratio > 1, f"{what}: a deliberately broken copy passed (worst |diff| / tolerance {ratio:.3g})"

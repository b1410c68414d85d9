"""Attention over the shared-prefix layout that computes only the blocks its mask can open.

``backends/shared_prefix.py`` lays a group out as one sequence ``[prompt | slot 0 | ... | slot K-1]`` of length
``L = P + K * R`` with a block mask: a prompt token sees the prompt, a slot's token the prompt and its own slot. HF's
sdpa attention computes every one of the ``L x L`` scores and masks most away: with groups of 16 answers of 32 tokens
after a 40-token prompt, about 90% of them. Here the prompt attends to itself (``P x P``), and the ``K`` slots
attend, as one batch of ``G * K`` short sequences, to the prompt's keys and their own (``R x (P + R)`` each), so the
work grows with ``K`` instead of ``K**2``. The masks of both parts are cut out of the layout's own mask, so padding and
causality are exactly the layout's; the log-probs equal the dense attention's up to float summation order, and the
gradient of every slot flows into the one copy of the prompt's keys and values.

Registered with transformers as ``SHARED_PREFIX_SDPA`` (attention and mask), it is HF's sdpa for every call that
does not carry ``shared_prefix=(P, K, R)`` and a mask: the non-shared layout, a vision tower, generation.
"""

from __future__ import annotations

from typing import Any

import torch

from miles_async.utils.hf_attention import register_sdpa_variant

SHARED_PREFIX_SDPA = "miles_shared_prefix_sdpa"
# The least ratio of the dense layout's scores to the blocks' at which the split pays: its extra kernels (two
# attentions of many short sequences, the prompt's keys copied per slot) cost more than the scores it skips below
# it. Measured side by side (benchmarks/levers, SmolLM2-135M, bf16, 2 cores): groups of 8 answers of 8 tokens after
# a 40-token prompt (2.3x fewer scores) trained 15% slower split; groups of 16 of 32 tokens (8x) trained 5% faster
# and took their log-prob pass 22% faster.
MIN_SCORE_RATIO = 4.0


def worth_splitting(prompt: int, slots: int, width: int) -> bool:
    """Whether a layout of ``prompt`` columns and ``slots`` slots of ``width`` skips enough scores split."""
    dense = (prompt + slots * width) ** 2
    return dense >= MIN_SCORE_RATIO * (prompt * prompt + slots * width * (prompt + width))


def shared_prefix_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    shared_prefix: tuple[int, int, int] | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF's attention-function contract: ``query`` ``[G, H, L, D]``, ``key``/``value`` ``[G, Hkv, L, D]``, the
    layout's boolean ``[G, 1, L, L]`` mask; returns ``[G, L, H, D]``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    # A vision-language model hands its forward's keywords to its vision tower too, whose attention runs per image
    # without a mask: only the language model's calls carry the layout's mask.
    if shared_prefix is None or attention_mask is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    p, k, r = shared_prefix
    g, heads, length, d = query.shape
    if length != p + k * r or attention_mask is None or attention_mask.dim() != 4 or attention_mask.dtype != torch.bool:
        raise ValueError(
            f"shared-prefix attention: a [G, 1, L, L] boolean mask over L = P + K * R = {p} + {k} * {r} tokens was "
            f"expected, got {length} tokens and a mask of {None if attention_mask is None else attention_mask.shape}"
        )
    kv_heads = key.shape[1]
    mask = attention_mask[:, 0]
    prompt_out, _ = sdpa_attention_forward(
        module, query[:, :, :p], key[:, :, :p], value[:, :, :p], mask[:, None, :p, :p], **kwargs
    )

    def per_slot(x: torch.Tensor, n_heads: int) -> torch.Tensor:  # [G, h, K*R, D] -> [G, K, h, R, D]
        return x[:, :, p:].reshape(g, n_heads, k, r, d).transpose(1, 2)

    def with_prompt(x: torch.Tensor) -> torch.Tensor:  # each slot's keys after the prompt's: [G*K, Hkv, P+R, D]
        prompt = x[:, None, :, :p].expand(g, k, kv_heads, p, d)
        return torch.cat([prompt, per_slot(x, kv_heads)], dim=3).reshape(g * k, kv_heads, p + r, d)

    to_prompt = mask[:, p:, :p].reshape(g, k, r, p)
    # The diagonal blocks of the slots' mask: slot j's queries against slot j's keys ([G, R, R, K] -> [G, K, R, R]).
    own_slot = torch.diagonal(mask[:, p:, p:].reshape(g, k, r, k, r), dim1=1, dim2=3).permute(0, 3, 1, 2)
    slot_mask = torch.cat([to_prompt, own_slot], dim=3).reshape(g * k, 1, r, p + r)
    slot_out, _ = sdpa_attention_forward(
        module,
        per_slot(query, heads).reshape(g * k, heads, r, d),
        with_prompt(key),
        with_prompt(value),
        slot_mask,
        **kwargs,
    )
    return torch.cat([prompt_out, slot_out.reshape(g, k * r, heads, d)], dim=1), None


def register() -> None:
    """Make ``SHARED_PREFIX_SDPA`` an attention implementation transformers models can be set to (idempotent)."""
    register_sdpa_variant(SHARED_PREFIX_SDPA, shared_prefix_sdpa)


def use_prefix_attention(model: torch.nn.Module, shared_prefix: bool) -> torch.nn.Module:
    """``model`` with its attention switched to ``SHARED_PREFIX_SDPA`` when it runs HF's sdpa and the trainer lays
    groups out with a shared prefix (--shared-prefix): the same log-probs, less work as groups grow."""
    if shared_prefix and model.config._attn_implementation == "sdpa":
        register()
        model.set_attn_implementation(SHARED_PREFIX_SDPA)
    return model

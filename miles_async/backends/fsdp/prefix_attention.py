"""Attention over the shared-prefix layout that computes only the blocks its mask can open.

``backends/shared_prefix.py`` lays a group out as one sequence ``[prompt | slot 0 | ... | slot K-1]``, each slot as
long as its response (at most ``R``), with a block mask: a prompt token sees the prompt, a slot's token the prompt
and its own slot. HF's sdpa attention computes every one of the ``L x L`` scores and masks most away: with groups of
16 answers of 32 tokens after a 40-token prompt, about 90% of them. Here the prompt attends to itself (``P x P``),
and the ``K`` slots attend, as one batch of ``G * K`` short sequences gathered into blocks of width ``R``
(``SlotMap``), to the prompt's keys and their own (``R x (P + R)`` each), so the work grows with ``K`` instead of
``K**2``. The blocks' mask follows the layout's rules (a token sees the real prompt and its own slot up to itself,
padding only itself); the log-probs equal the dense attention's up to float summation order, and the gradient of
every slot flows into the one copy of the prompt's keys and values.

Registered with transformers as ``SHARED_PREFIX_SDPA`` (attention and mask), it is HF's sdpa for every call that
does not carry a layout's ``SlotMap`` as ``shared_prefix`` and a mask: the non-shared layout, a vision tower,
generation.
"""

from __future__ import annotations

from typing import Any

import torch

from miles_async.backends.shared_prefix import SlotMap
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
    shared_prefix: SlotMap | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF's attention-function contract: ``query`` ``[G, H, L, D]``, ``key``/``value`` ``[G, Hkv, L, D]``, the
    layout's boolean ``[G, 1, L, L]`` mask; returns ``[G, L, H, D]``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    # A vision-language model hands its forward's keywords to its vision tower too, whose attention runs per image
    # without a mask: only the language model's calls carry the layout's mask.
    if shared_prefix is None or attention_mask is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    p, k, r = shared_prefix.blocks
    tail = shared_prefix.scatter.shape[1]
    g, heads, length, d = query.shape
    if length != p + tail or attention_mask.dim() != 4 or attention_mask.dtype != torch.bool:
        raise ValueError(
            f"shared-prefix attention: a [G, 1, L, L] boolean mask over L = P + the responses' columns = {p} + {tail} "
            f"tokens was expected, got {length} tokens and a mask of {attention_mask.shape}"
        )
    kv_heads = key.shape[1]
    prompt_out, _ = sdpa_attention_forward(
        module, query[:, :, :p], key[:, :, :p], value[:, :, :p], attention_mask[:, :, :p, :p], **kwargs
    )
    gather = shared_prefix.gather.to(query.device)

    def blocks(x: torch.Tensor, n_heads: int) -> torch.Tensor:  # [G, h, L, D] -> [G, K, h, R, D]
        index = gather[:, None, :, None].expand(g, n_heads, k * r, d)
        return torch.gather(x[:, :, p:], 2, index).reshape(g, n_heads, k, r, d).transpose(1, 2)

    def with_prompt(x: torch.Tensor) -> torch.Tensor:  # each block's keys after the prompt's: [G*K, Hkv, P+R, D]
        prompt = x[:, None, :, :p].expand(g, k, kv_heads, p, d)
        return torch.cat([prompt, blocks(x, kv_heads)], dim=3).reshape(g * k, kv_heads, p + r, d)

    slot_out, _ = sdpa_attention_forward(
        module,
        blocks(query, heads).reshape(g * k, heads, r, d),
        with_prompt(key),
        with_prompt(value),
        shared_prefix.mask.to(query.device),
        **kwargs,
    )
    # Back from the blocks to the sequence's columns: [G*K, R, H, D] -> [G, L - P, H, D].
    scatter = shared_prefix.scatter.to(query.device)[:, :, None, None].expand(g, tail, heads, d)
    slots = torch.gather(slot_out.reshape(g, k * r, heads, d), 1, scatter)
    return torch.cat([prompt_out, slots], dim=1), None


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

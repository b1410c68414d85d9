"""The embedded engine's attention for a decode step: two small matmuls instead of the CPU flash kernel.

A decode step attends one query token per row to the row's cache. torch's CPU flash-attention kernel, which HF's
sdpa calls, blocks and rescales for long queries; with one query (three once HF packs a GQA group's heads into
it) that bookkeeping costs more than the scores: ``q @ k^T``, a softmax and ``p @ v`` take half to two thirds of its
time at SmolLM2's shapes (64 rows, 60-150 keys, float32, 2 cores). Yet a step's whole decode was not faster for it
beyond noise at answers of 32 or 128 tokens (``benchmarks/levers.py``'s ``decode-attention`` lever), so the engine
uses it only where ``model.DECODE_MATMULS`` says (off).

Registered with transformers as ``DECODE_SDPA``, it is HF's sdpa for every call it does not take: a query of more
than one token (a prefill, a vision tower), float16/bfloat16 (the scores would be rounded to 16 bits where the flash
kernel keeps them in float32), and any keyword that changes attention (soft-capping, sinks, position bias, dropout).
"""

from __future__ import annotations

from typing import Any

import torch

from miles_async.utils.hf_attention import register_sdpa_variant

DECODE_SDPA = "miles_decode_sdpa"
# Keywords of HF's attention contract that change what attention computes: their calls stay with sdpa.
_SDPA_ONLY = ("softcap", "s_aux", "position_bias", "sliding_window")


def decode_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF's attention-function contract: ``query`` ``[B, H, Q, D]``, ``key`` ``[B, Hkv, L, D]``, ``value``
    ``[B, Hkv, L, Dv]``, a boolean (True: attend) or additive mask broadcastable to ``[B, 1, Q, L]``; returns
    ``[B, Q, H, Dv]``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if (
        query.shape[2] != 1
        or query.dtype != torch.float32
        or dropout
        or any(kwargs.get(k) is not None for k in _SDPA_ONLY)
        or query.shape[1] % key.shape[1]
        or (attention_mask is not None and attention_mask.shape[1] != 1)
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    rows, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    # A GQA group's query heads as the rows of one matmul against their shared key head (HF's repeat_kv order:
    # query head h reads key head h // group).
    q = query.reshape(rows, kv_heads, heads // kv_heads, dim)
    scores = torch.matmul(q, key.transpose(-1, -2)).mul_(dim**-0.5 if scaling is None else scaling)
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores.masked_fill_(~attention_mask, float("-inf"))
        else:
            scores.add_(attention_mask)
    out = torch.matmul(scores.softmax(dim=-1), value)  # [B, Hkv, group, Dv]
    # Dv: the values' width, which MLA (DeepSeek-V3) makes narrower than the queries' and keys'
    return out.reshape(rows, 1, heads, value.shape[-1]), None


def register() -> None:
    """Make ``DECODE_SDPA`` an attention implementation transformers models can be set to (idempotent)."""
    register_sdpa_variant(DECODE_SDPA, decode_sdpa)

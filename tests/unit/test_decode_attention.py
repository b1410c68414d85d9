"""The engine's decode attention computes HF's sdpa: one query token per row against a left-padded cache, a GQA
group's heads sharing their key head; everything else goes to sdpa itself."""

from __future__ import annotations

import types

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from miles_async.inference.embedded.decode_attention import decode_sdpa

ROWS, HEADS, KV_HEADS, KEYS, DIM = 5, 6, 2, 23, 16


def _inputs(queries: int, dtype: torch.dtype = torch.float32, value_dim: int = DIM):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(ROWS, HEADS, queries, DIM, generator=g).to(dtype)
    k = torch.randn(ROWS, KV_HEADS, KEYS, DIM, generator=g).to(dtype)
    v = torch.randn(ROWS, KV_HEADS, KEYS, value_dim, generator=g).to(dtype)
    mask = torch.ones(ROWS, 1, queries, KEYS, dtype=torch.bool)
    mask[1, :, :, :7] = False  # left padding, as the engine's batch has
    mask[3, :, :, :2] = False
    module = types.SimpleNamespace(num_key_value_groups=HEADS // KV_HEADS, is_causal=True)
    return module, q, k, v, mask


# additive: a float mask; value_dim: values narrower than queries and keys, as MLA's (DeepSeek-V3) are
@pytest.mark.parametrize(("additive", "value_dim"), [(False, DIM), (True, DIM), (False, DIM // 2)])
def test_a_decode_step_attends_as_sdpa_does(additive: bool, value_dim: int) -> None:
    module, q, k, v, mask = _inputs(1, value_dim=value_dim)
    if additive:
        mask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
    got, _ = decode_sdpa(module, q, k, v, mask, scaling=0.3)
    assert got.shape == want.shape == (ROWS, 1, HEADS, value_dim)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # a padded row's hidden columns change nothing
    k2 = k.clone()
    k2[1, :, :7] = 100.0
    torch.testing.assert_close(decode_sdpa(module, q, k2, v, mask, scaling=0.3)[0], got)


def test_prefills_and_half_precision_are_sdpa_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers.integrations.sdpa_attention as sdpa

    calls = []
    real = sdpa.sdpa_attention_forward
    monkeypatch.setattr(sdpa, "sdpa_attention_forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    for queries, dtype in ((4, torch.float32), (1, torch.bfloat16)):
        module, q, k, v, mask = _inputs(queries, dtype)
        decode_sdpa(module, q, k, v, mask)
    assert len(calls) == 2
    module, q, k, v, mask = _inputs(1)
    decode_sdpa(module, q, k, v, mask)
    assert len(calls) == 2  # a float32 decode step is the matmuls'

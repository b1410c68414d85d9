"""The shared-prefix attention (backends/fsdp/prefix_attention.py) against HF's dense sdpa on the same layout: the
same outputs and gradients (float64: equal to rounding), for groups with padded prompts, short, empty and missing
slots and grouped-query heads; the attention work it does grows with the slots, not with their square; and a call
without the layout's blocks is HF's sdpa."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from benchmarks.roofline_core import flop_counter
from miles_async.backends.fsdp.prefix_attention import shared_prefix_sdpa, worth_splitting
from miles_async.backends.shared_prefix import shared_layout


class _Attention(torch.nn.Module):
    """What HF's sdpa reads of an attention layer: 6 query heads over 2 key/value heads."""

    is_causal = True
    num_key_value_groups = 3


def _qkv(groups: int, length: int, heads: int = 6, kv_heads: int = 2, dim: int = 8):
    torch.manual_seed(0)
    q = torch.randn(groups, heads, length, dim, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(groups, kv_heads, length, dim, dtype=torch.float64, requires_grad=True) for _ in range(2))
    return q, k, v


def test_it_gives_the_dense_attentions_outputs_and_gradients():
    # Three groups: prompts of 5, 3 and 1 tokens (left padded to 5); responses of 0-4 tokens; the last group has
    # two of the three slots, so its third is all padding.
    prompts = [[1, 2, 3, 4, 5]] * 2 + [[7, 8, 9]] * 3 + [[4]] * 2
    responses = [[5, 6, 7], [8], [1, 2], [3, 3, 3, 3], [], [9, 9], [6]]
    layout = shared_layout(prompts, responses)
    assert layout.blocks == (5, 3, 4)
    q, k, v = _qkv(*layout.input_ids.shape)
    dense, _ = sdpa_attention_forward(_Attention(), q, k, v, layout.attention_mask, scaling=0.3)
    ours, _ = shared_prefix_sdpa(
        _Attention(), q, k, v, layout.attention_mask, shared_prefix=layout.slot_map, scaling=0.3
    )
    torch.testing.assert_close(ours, dense, rtol=0, atol=1e-12)
    weights = torch.randn_like(dense)
    for a, b in zip(
        torch.autograd.grad((ours * weights).sum(), (q, k, v)),
        torch.autograd.grad((dense * weights).sum(), (q, k, v)),
        strict=True,
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    # a slot that saw another slot's keys would differ: the layout's mask is what it follows
    wrong = layout.attention_mask.clone()
    wrong[:, :, 5 + 4 :, 5 : 5 + 4] = True
    dense_wrong, _ = sdpa_attention_forward(_Attention(), q, k, v, wrong, scaling=0.3)
    assert not torch.allclose(ours, dense_wrong)


def test_its_work_grows_with_the_slots_not_their_square():
    p, k, r = 40, 16, 32
    layout = shared_layout([[1] * p] * k, [[2] * r] * k)
    q, key, v = (x.detach().float() for x in _qkv(1, p + k * r))

    def flops(fn) -> int:
        with flop_counter() as counter:
            fn()
        return counter.get_total_flops()

    mask = layout.attention_mask
    dense = flops(lambda: sdpa_attention_forward(_Attention(), q, key, v, mask))
    ours = flops(lambda: shared_prefix_sdpa(_Attention(), q, key, v, mask, shared_prefix=layout.slot_map))
    scores = {"dense": (p + k * r) ** 2, "ours": p * p + k * r * (p + r)}
    assert dense / ours == pytest.approx(scores["dense"] / scores["ours"])  # 552^2 / (40^2 + 512 * 72): 7.9x


def test_without_the_blocks_it_is_hfs_sdpa_and_a_mismatched_layout_is_refused():
    layout = shared_layout([[1, 2, 3]] * 2, [[4, 5], [6]])
    q, k, v = _qkv(*layout.input_ids.shape)
    plain = sdpa_attention_forward(_Attention(), q, k, v, None)[0]
    assert torch.equal(shared_prefix_sdpa(_Attention(), q, k, v, None)[0], plain)
    # a vision tower's calls get the forward's keywords too, and no mask
    assert torch.equal(shared_prefix_sdpa(_Attention(), q, k, v, None, shared_prefix=layout.slot_map)[0], plain)
    other = shared_layout([[1, 2, 3]] * 2, [[4, 5, 6], [6]]).slot_map  # 4 columns after the prompt, not 3
    with pytest.raises(ValueError, match=r"L = P \+ the responses' columns = 3 \+ 4 tokens"):
        shared_prefix_sdpa(_Attention(), q, k, v, layout.attention_mask, shared_prefix=other)


def test_the_split_runs_where_the_dense_layout_has_four_times_its_scores_or_more():
    # (40 + 8 * 8)^2 / (40^2 + 64 * 48): 2.3x fewer scores, where the split measured slower; 16 slots of 32: 8x
    assert not worth_splitting(40, 8, 8) and worth_splitting(40, 16, 32)
    assert worth_splitting(40, 8, 128) and not worth_splitting(300, 8, 32)  # 6.5x; 1.8x

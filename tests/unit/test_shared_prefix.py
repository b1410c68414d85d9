"""The shared-prefix layout (backends/shared_prefix.py): who sees whom, where each response token's logits come
from, and packing that counts a shared prompt once. The equality of log-probs and gradients on a real model is
tests/integration/test_shared_prefix.py."""

from __future__ import annotations

import torch

from miles_async.backends.packing import pack_micro_batches
from miles_async.backends.shared_prefix import pack_shared, prompt_keys, shared_layout

PROMPTS = [[5, 6, 7], [5, 6, 7], [8, 9], [5, 6, 7]]
RESPONSES = [[10, 11], [12], [13, 14, 15], []]


def test_rows_with_one_prompt_become_one_sequence():
    layout = shared_layout(PROMPTS, RESPONSES, pad_id=0)
    # Two prompts; the first has three slots, each as long as its response (2, 1 and 0 tokens): no padding between
    # them, the second sequence's 3 responses the longest tail.
    assert layout.input_ids.tolist() == [
        [5, 6, 7, 10, 11, 12],
        [0, 8, 9, 13, 14, 15],
    ]
    assert layout.sequence.tolist() == [0, 0, 1, 0]
    assert layout.logits_to_keep == 3 + 1
    # Positions restart after the prompt in every slot: RoPE sees the unshared layout's positions.
    assert layout.position_ids[0].tolist() == [0, 1, 2, 3, 4, 3]
    assert layout.position_ids[1, 1:6].tolist() == [0, 1, 2, 3, 4]


def test_a_response_sees_its_prompt_and_itself_only():
    responses = [[10, 11], [12], [13, 14, 15], [16]]
    mask = shared_layout(PROMPTS, responses).attention_mask[0, 0]
    assert mask[4].nonzero().flatten().tolist() == [0, 1, 2, 3, 4]  # slot 0, second token
    assert mask[5].nonzero().flatten().tolist() == [0, 1, 2, 5]  # slot 1 does not see slot 0
    assert mask[6].nonzero().flatten().tolist() == [0, 1, 2, 6]  # nor slot 2 slot 1
    assert mask[1].nonzero().flatten().tolist() == [0, 1]  # the prompt is causal
    # Left padding of the shorter prompt is seen by nobody else; padding after a sequence's responses sees itself.
    other = shared_layout(PROMPTS, responses).attention_mask[1, 0]
    assert not other[1:, 0].any()
    assert other[6].nonzero().flatten().tolist() == [6]


def test_the_blocks_gather_each_slot_at_one_width_and_scatter_back():
    slots = shared_layout(PROMPTS, RESPONSES).slot_map
    assert slots.blocks == (3, 3, 3)
    # Sequence 0: slot 0's tokens at columns 0-1 after the prompt, slot 1's at 2, slot 2 empty.
    assert slots.gather[0].tolist() == [0, 1, 0, 2, 0, 0, 0, 0, 0]
    assert slots.scatter[0].tolist() == [0, 1, 3]
    # A block's second token sees the real prompt and its slot's first two; padding in a block only itself.
    block = slots.mask.reshape(2, 3, 3, 6)[0]
    assert block[0, 1].nonzero().flatten().tolist() == [0, 1, 2, 3, 4]
    assert block[1, 1].nonzero().flatten().tolist() == [4]
    assert slots.mask.reshape(2, 3, 3, 6)[1, 0, 0].nonzero().flatten().tolist() == [1, 2, 3]  # prompt padded left


def test_each_response_token_is_predicted_from_the_column_before_it():
    layout = shared_layout(PROMPTS, RESPONSES)
    kept_start = layout.input_ids.shape[1] - layout.logits_to_keep  # the last prompt column
    assert kept_start == 2
    # Row 0 (slot 0 of the first prompt): token 0 from the last prompt column, token 1 from the slot's column 0.
    assert layout.column[0].tolist() == [0, 1, 0]
    assert layout.column[2].tolist() == [0, 1, 2]
    kept = torch.arange(2 * layout.logits_to_keep).reshape(2, -1, 1).float()
    from miles_async.backends.shared_prefix import row_logits

    assert row_logits(kept, layout)[2, :, 0].tolist() == [4.0, 5.0, 6.0]


def test_packing_counts_a_shared_prompt_once():
    prompts = [[1] * 30] * 8
    lengths = [4] * 8
    # One row per sample: 34 tokens each, three fit in 120.
    assert [len(b) for b in pack_micro_batches([34] * 8, 120)] == [3, 3, 2]
    # Shared: 30 + 4 * k fits k = 8 in 62.
    assert pack_shared(prompts, lengths, 62) == [list(range(8))]
    assert [len(b) for b in pack_shared(prompts, lengths, 61)] == [7, 1]
    # Two prompts: two sequences, each padded to the longest layout.
    assert pack_shared([[1] * 30, [2] * 30, [1] * 30], [4, 4, 4], 2 * (30 + 2 * 4)) == [[0, 1, 2]]
    assert pack_shared([[1] * 30, [2] * 30, [1] * 30], [4, 4, 4], 2 * (30 + 2 * 4) - 1) == [[0, 1], [2]]
    assert pack_shared([[1] * 100], [4], 50) == [[0]]  # too long for the budget: alone
    # Each response counts at its length, not the longest's: 30 + 2 + 9 + 4 + 1 = 46 tokens.
    assert pack_shared(prompts[:4], [2, 9, 4, 1], 46) == [[0, 1, 2, 3]]
    assert [len(b) for b in pack_shared(prompts[:4], [2, 9, 4, 1], 45)] == [3, 1]


def test_equal_tokens_with_other_images_do_not_share_a_prompt():
    """Two pictures of one size give a VLM's prompt the same placeholder tokens: the images are part of the key."""
    prompts, images = [[1] * 30] * 3, [["a.png"], ["b.png"], ["a.png"]]
    keys = prompt_keys(prompts, images)
    layout = shared_layout(prompts, [[2] * 4] * 3, keys=keys)
    assert layout.sequence.tolist() == [0, 1, 0]
    assert shared_layout(prompts, [[2] * 4] * 3).sequence.tolist() == [0, 0, 0]  # text: the tokens alone
    # Packing counts two sequences of up to 2 slots, 2 x (30 + 2 x 4) tokens, where the tokens alone need 30 + 3 x 4.
    assert pack_shared(prompts, [4] * 3, 30 + 3 * 4) == [[0, 1, 2]]
    assert pack_shared(prompts, [4] * 3, 2 * (30 + 2 * 4), keys) == [[0, 1, 2]]
    assert pack_shared(prompts, [4] * 3, 2 * (30 + 2 * 4) - 1, keys) == [[0, 1], [2]]

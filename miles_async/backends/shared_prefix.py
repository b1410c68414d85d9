"""Shared-prefix layout: the n responses of a GRPO group attend to one copy of their prompt.

A group's samples share their prompt tokens. Laid out one row per sample, every training pass (policy, old and
reference log-probs) computes the prompt n times. Here the rows of a micro-batch whose prompts are equal become one
sequence, ``[prompt | response 0 | response 1 | ...]``, each response in a slot exactly as long as it is, with a
block mask: a prompt token sees the prompt tokens before it; a response token sees the whole prompt and its own
response up to itself, never another slot; a padding position sees only itself (a row of keys all masked would
make attention NaN). Positions restart after the prompt in every slot, so RoPE sees exactly the positions of the
unshared layout, and each token attends to the same keys: the log-probs are those of the unshared layout up to
float summation order, and the gradient of every response flows into the one copy of the prompt's activations.

Slots are not padded to the longest response: with answers of uneven length (a long tail under a cap), padding
every slot to the longest made the linear layers compute over a third more columns than there are tokens (SmolLM2,
groups of 8 answers averaging 91 of 128 tokens). Every sequence of a micro-batch has the same columns (prompts
left-padded to the longest, the responses right-padded to the longest group's), so the logits needed are one
contiguous tail: the last prompt column (which predicts each response's first token) and the responses. Packing by
``--max-tokens-per-gpu`` counts a shared prompt once and each response at its length (``pack_shared``). The split
attention (``fsdp/prefix_attention.py``) computes slots as blocks of one width: ``SlotMap`` gathers them from the
sequence and scatters its outputs back.

Rows share a prompt when their prompt keys are equal: the tokens, and for a vision-language prompt its images too
(two pictures of one size give the same placeholder tokens). A VLM's sequences get their 3-D positions and their
images' pixels from ``miles_async.backends.fsdp.vision``.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch


@dataclass
class SlotMap:
    """The slots of a layout's sequences as ``K`` blocks of one width ``R`` (the longest response), for attention
    that computes each slot on its own (``fsdp/prefix_attention.py``)."""

    prompt: int  # P: the prompt's columns
    slots: int  # K: the most responses a sequence has
    width: int  # R: the longest response (at least 1)
    gather: torch.Tensor  # [G, K * R] the column after the prompt that holds slot j's token t
    scatter: torch.Tensor  # [G, L - P] each column after the prompt's place j * R + t among the blocks
    mask: torch.Tensor  # [G * K, 1, R, P + R] bool: a block's queries against the prompt's keys and its own

    @property
    def blocks(self) -> tuple[int, int, int]:
        """(P, K, R)."""
        return self.prompt, self.slots, self.width


@dataclass
class SharedPrefixLayout:
    input_ids: torch.Tensor  # [G, L], L = P + the longest group's responses (at least 1 column)
    attention_mask: torch.Tensor  # [G, 1, L, L] bool: True where the query (row) may attend to the key (column)
    position_ids: torch.Tensor  # [G, L]; a VLM's [3, G, L] once its images are attached
    logits_to_keep: int  # the tail of columns whose logits the log-probs need: L - P + 1
    sequence: torch.Tensor  # [B] the sequence (group) of each row of the micro-batch
    column: torch.Tensor  # [B, R] index into the kept logits predicting each response token
    source_row: torch.Tensor  # [G, L] the row (sample) whose token sits at each column; the prompt's: the group's first
    source_pos: torch.Tensor  # [G, L] that token's position in its sample, -1 for padding
    slot_map: SlotMap
    pixels: dict[str, torch.Tensor] | None = None  # a VLM's: each sequence's images in sequence order

    @property
    def blocks(self) -> tuple[int, int, int]:
        """(P, K, R): the prompt's columns, the slots a sequence has and the longest response."""
        return self.slot_map.blocks


def prompt_keys(prompts: list[list[int]], images: list[list[str]] | None = None) -> list[Hashable]:
    """What two rows must have equal to share their prompt: its tokens and its images."""
    if images is None:
        return [tuple(p) for p in prompts]
    return [(tuple(p), tuple(refs)) for p, refs in zip(prompts, images, strict=True)]


def group_rows(keys: list[Hashable]) -> list[list[int]]:
    """Row indices grouped by equal prompt key, in order of first appearance."""
    groups: dict[Hashable, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def shared_layout(
    prompts: list[list[int]], responses: list[list[int]], pad_id: int = 0, keys: list[Hashable] | None = None
) -> SharedPrefixLayout:
    groups = group_rows(keys if keys is not None else prompt_keys(prompts))
    p = max(len(x) for x in prompts)
    r = max(1, max(len(x) for x in responses))
    k = max(len(g) for g in groups)
    tail = max(1, max(sum(len(responses[row]) for row in rows) for rows in groups))
    width = p + tail
    ids = torch.full((len(groups), width), pad_id, dtype=torch.long)
    pos = torch.zeros((len(groups), width), dtype=torch.long)
    real = torch.zeros((len(groups), width), dtype=torch.bool)
    slot_of = torch.full((len(groups), width), k, dtype=torch.long)  # -1: the prompt; k: padding after the slots
    sequence = torch.zeros(len(prompts), dtype=torch.long)
    source_row = torch.zeros((len(groups), width), dtype=torch.long)
    source_pos = torch.full((len(groups), width), -1, dtype=torch.long)
    column = torch.zeros((len(prompts), r), dtype=torch.long)
    gather = torch.zeros((len(groups), k * r), dtype=torch.long)
    scatter = torch.zeros((len(groups), tail), dtype=torch.long)
    block_real = torch.zeros((len(groups), k, r), dtype=torch.bool)
    for g, rows in enumerate(groups):
        prompt = prompts[rows[0]]
        start = p - len(prompt)
        ids[g, start:p] = torch.tensor(prompt, dtype=torch.long)
        pos[g, start:p] = torch.arange(len(prompt))
        real[g, start:p] = True
        slot_of[g, :p] = -1
        source_row[g, start:p] = rows[0]
        source_pos[g, start:p] = torch.arange(len(prompt))
        offset = 0  # where this slot starts after the prompt
        for j, row in enumerate(rows):
            resp = responses[row]
            n, lo = len(resp), p + offset
            if n:
                ids[g, lo : lo + n] = torch.tensor(resp, dtype=torch.long)
                real[g, lo : lo + n] = True
                slot_of[g, lo : lo + n] = j
                source_row[g, lo : lo + n] = row
                source_pos[g, lo : lo + n] = len(prompt) + torch.arange(n)
                pos[g, lo : lo + n] = len(prompt) + torch.arange(n)
                gather[g, j * r : j * r + n] = offset + torch.arange(n)
                scatter[g, offset : offset + n] = j * r + torch.arange(n)
                block_real[g, j, :n] = True
                # Kept logits start at column p - 1: index 0 predicts the first response token of every slot.
                column[row, 1:n] = offset + torch.arange(1, n)
            sequence[row] = g
            offset += n
        # The columns after this sequence's responses go to blocks' padding, one each (there are K * R - offset of
        # those, at least as many): a padding position there sees only itself, as it does in the sequence.
        spare = (~block_real[g]).flatten().nonzero().flatten()[: tail - offset]
        gather[g, spare] = offset + torch.arange(len(spare))
        scatter[g, offset:] = spare
    causal = torch.ones((width, width), dtype=torch.bool).tril()
    same_slot = slot_of[:, :, None] == slot_of[:, None, :]
    key_is_prompt = (slot_of == -1)[:, None, :]
    visible = causal & (same_slot | key_is_prompt) & real[:, :, None] & real[:, None, :]
    visible |= torch.eye(width, dtype=torch.bool)  # padding sees itself
    # The blocks' mask: a slot's token sees the real prompt and its slot up to itself; padding only itself.
    to_prompt = block_real[:, :, :, None] & real[:, None, None, :p]
    own = torch.ones((r, r), dtype=torch.bool).tril() & block_real[:, :, :, None] & block_real[:, :, None, :]
    own |= torch.eye(r, dtype=torch.bool) & ~block_real[:, :, :, None]
    blocks_mask = torch.cat([to_prompt, own], dim=3).reshape(len(groups) * k, 1, r, p + r)
    slot_map = SlotMap(p, k, r, gather, scatter, blocks_mask)
    return SharedPrefixLayout(ids, visible[:, None], pos, tail + 1, sequence, column, source_row, source_pos, slot_map)


def pack_shared(
    prompts: list[list[int]], response_lengths: list[int], max_tokens: int, keys: list[Hashable] | None = None
) -> list[list[int]]:
    """Split row indices (in order) into micro-batches whose shared layout fits ``max_tokens``: each distinct
    prompt counted once and each response at its length, as ``shared_layout`` lays them out. A row too long for the
    budget goes alone."""
    batches: list[list[int]] = []
    current: list[int] = []
    tails: dict[Hashable, int] = {}  # each sequence's responses so far
    p = 0
    keys = keys if keys is not None else prompt_keys(prompts)

    def size(p: int, tails: dict[Hashable, int]) -> int:
        return len(tails) * (p + max(1, max(tails.values())))

    for i, (prompt, n, key) in enumerate(zip(prompts, response_lengths, keys, strict=True)):
        grown = {**tails, key: tails.get(key, 0) + n}
        if current and size(max(p, len(prompt)), grown) > max_tokens:
            batches.append(current)
            current, p, grown = [], 0, {key: n}
        current.append(i)
        tails, p = grown, max(p, len(prompt))
    if current:
        batches.append(current)
    return batches


def row_logits(kept: torch.Tensor, layout: SharedPrefixLayout) -> torch.Tensor:
    """``[B, R, V]``: for each row and response token, the logits that predict it, from the kept tail
    ``[G, K * R + 1, V]`` of the shared sequences."""
    return kept[layout.sequence[:, None].to(kept.device), layout.column.to(kept.device)]

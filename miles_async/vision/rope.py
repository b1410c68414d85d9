"""Qwen2-VL's 3-D rotary positions (temporal, height, width) of padded rows, the same in the engine and the trainer.

Both call the model's own ``get_rope_index`` on each row's real tokens, so an image's patches get the positions
the model was trained with and the text after it continues from the image's largest position, not from its token
count. The difference (``delta``) is what a decode step adds to its token index.
"""

from __future__ import annotations

from typing import Any

import torch


def rope_index_fn(model: Any) -> Any:
    """The model's ``get_rope_index`` (on the model or its inner ``model``), or None for 1-D rotary positions."""
    for m in (model, getattr(model, "model", None)):
        fn = getattr(m, "get_rope_index", None)
        if fn is not None:
            return fn
    return None


def row_positions(model: Any, ids: list[int], image_grid_thw: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """``[3, len(ids)]`` positions of one unpadded row and its delta (last position + 1 - length)."""
    row = torch.tensor([ids], dtype=torch.long)
    token_types = (row == int(model.config.image_token_id)).int()
    positions, delta = rope_index_fn(model)(row, token_types, image_grid_thw=image_grid_thw)
    return positions[:, 0], int(delta.reshape(-1)[0])


def padded_positions(
    model: Any, ids: torch.Tensor, mask: torch.Tensor, grids: list[torch.Tensor | None]
) -> tuple[torch.Tensor, list[int]]:
    """``[3, B, L]`` positions of rows whose real tokens are where ``mask`` is 1 (one contiguous run each), with
    each row's images' ``image_grid_thw`` (None: no image); padding gets position 0. Also each row's delta."""
    out = torch.zeros((3, *ids.shape), dtype=torch.long)
    deltas = []
    for i in range(ids.shape[0]):
        real = mask[i].bool()
        pos, delta = row_positions(model, ids[i][real].tolist(), grids[i])
        out[:, i, real] = pos
        deltas.append(delta)
    return out, deltas

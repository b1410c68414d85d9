"""A vision-language model in the embedded engine: a request's images made into pixel inputs, and the prefill and
decode inputs that carry them (the rows' pixels in row order, Qwen2-VL's 3-D positions).

The vision tower runs once, at a row's prefill: its embeddings then live in the KV cache with the prompt, so decode
steps take text tokens only, at the row's 1-D position shifted by its rope delta.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from miles_async.vision.hf import pixel_inputs, placeholder_count
from miles_async.vision.images import ImageError, load_image
from miles_async.vision.rope import padded_positions

if TYPE_CHECKING:
    from miles_async.inference.embedded.model import CausalLM
    from miles_async.inference.embedded.records import Seq


class ImageRequestError(ValueError):
    """A request's ``image_data`` this engine cannot serve: the message names what is wrong."""


@dataclass(frozen=True)
class Images:
    refs: tuple[str, ...]  # as the request sent them
    pixels: dict[str, torch.Tensor]  # pixel_values, image_grid_thw


def prepare_images(lm: CausalLM, refs: list[str], input_ids: list[int]) -> Images | None:
    """The pixel inputs of ``refs`` for a prompt ``input_ids``, checked against the prompt's placeholders (None: no
    images and none expected)."""
    if not refs:
        have = sum(t == lm.config.image_token_id for t in input_ids) if lm.is_vision else 0
        if have:
            # Without the images the placeholders would embed as an ordinary token: a silently blind answer.
            raise ImageRequestError(
                f"input_ids hold {have} image placeholder tokens (id {lm.config.image_token_id}) and no image_data"
            )
        return None
    if not lm.is_vision:
        raise ImageRequestError("this model has no vision tower (its config has no vision_config)")
    images = []
    for i, ref in enumerate(refs):
        try:
            images.append(load_image(ref))
        except ImageError as e:
            raise ImageRequestError(f"[{i}]: {e}") from e
    pixels = pixel_inputs(lm.processor, images)
    want = placeholder_count(pixels["image_grid_thw"], lm.processor.image_processor.merge_size)
    have = sum(t == lm.config.image_token_id for t in input_ids)
    if have != want:
        raise ImageRequestError(
            f"input_ids hold {have} image placeholder tokens (id {lm.config.image_token_id}) where the "
            f"{len(images)} image(s) fill {want}: the prompt must come from the model's processor with these images"
        )
    return Images(tuple(refs), {**pixels, "pixel_values": pixels["pixel_values"].to(lm.dtype)})


def vision_prefill(
    lm: CausalLM, rows: list[Seq], ids: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
    """The prefill's ``[3, B, L]`` positions and the rows' pixel inputs in row order (None: no row has an image);
    sets each row's rope delta for its decode steps."""
    grids = [s.pixels["image_grid_thw"] if s.pixels is not None else None for s in rows]
    positions, deltas = padded_positions(lm.model, ids, mask, grids)
    for seq, delta in zip(rows, deltas):
        seq.rope_delta = delta
    with_images = [s.pixels for s in rows if s.pixels is not None]
    if not with_images:
        return positions, None
    pixels = {k: torch.cat([p[k] for p in with_images]) for k in ("pixel_values", "image_grid_thw")}
    return positions, pixels


def decode_positions(rows: list[Seq], positions: torch.Tensor) -> torch.Tensor:
    """A decode step's ``[3, B, 1]`` positions: each row's 1-D position plus its rope delta, on all three axes."""
    delta = torch.tensor([s.rope_delta for s in rows], dtype=torch.long)[:, None]
    return (positions + delta)[None].expand(3, -1, -1)

"""A vision-language policy on the torch backend: each micro-batch's images as the model's pixel inputs, its
Qwen2-VL 3-D positions (the engine's, ``miles_async.vision.rope``), and --freeze-vision-tower.

Samples carry their images by reference; the pixels are computed here with the model folder's own processor, the
one the engines and the data source load, so all three see the same patches in the same placeholders.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from miles_async.backends.packing import MicroBatch
from miles_async.vision.hf import load_processor, pixel_inputs, placeholder_count, unsampled_token_ids
from miles_async.vision.images import load_image
from miles_async.vision.rope import padded_positions

# Each rollout's samples are collated for old log-probs, reference log-probs and every training pass: their pixels
# are computed once. A group's samples share their images, so this holds a few rollouts' worth.
_PIXEL_CACHE_SIZE = 512


def find_vision_tower(model: torch.nn.Module) -> tuple[str, torch.nn.Module] | None:
    """The model's vision encoder and projector (Qwen2-VL's ``visual``, which holds its merger) and its qualified
    name, or None for a text model."""
    for name, m in model.named_modules():
        if name.split(".")[-1] == "visual":
            return name, m
    return None


def vision_tower(model: torch.nn.Module) -> torch.nn.Module:
    found = find_vision_tower(model)
    if found is None:
        raise ValueError(f"--freeze-vision-tower: {type(model).__name__} has no vision tower ('visual') to freeze")
    return found[1]


def tower_in_every_pass(model: torch.nn.Module) -> None:
    """FSDP2 shards the vision tower block by block, so its forward and backward are collectives: a rank whose
    micro-batch holds no image would skip them while another rank's image waits in them (gloo: "collective
    mismatch"). Each pass without pixels runs the tower on one blank image here, its output joined to the pass at
    weight 0, so every rank gathers the tower's weights and reduces its (zero) gradients in step."""
    found = find_vision_tower(model)
    if found is None:
        return
    name, tower = found
    inner = model.get_submodule(name.rpartition(".")[0])  # the module that calls the tower, then the decoder
    merge = int(tower.spatial_merge_size)
    grid = torch.tensor([[1, merge, merge]])
    patch = tower.patch_embed.proj.weight.shape[1:].numel()  # channels x temporal patch x patch x patch
    pending: list[torch.Tensor] = []

    def before(module, args, kwargs):
        if kwargs.get("pixel_values") is None:
            device = kwargs["input_ids"].device
            blank = torch.zeros((merge * merge, patch), device=device)
            # Every output (Qwen3-VL's deepstack features too): each reaches weights the image path trains.
            features = inner.get_image_features(blank, grid.to(device))
            pending.append(sum(t.float().sum() for t in _tensors(features.to_tuple())))

    def after(module, args, kwargs, output):
        if pending:
            hidden = output.last_hidden_state
            output.last_hidden_state = hidden + (0.0 * pending.pop()).to(hidden.dtype)
        return output

    inner.register_forward_pre_hook(before, with_kwargs=True)
    inner.register_forward_hook(after, with_kwargs=True)


def _tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor in nested tuples and lists."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def freeze_vision_tower(model: torch.nn.Module) -> None:
    """--freeze-vision-tower: only the language model trains; the engines keep the tower they loaded."""
    vision_tower(model).requires_grad_(False)


class VisionInputs:
    """What a micro-batch of a vision-language policy carries beside its tokens."""

    def __init__(self, model_path: str, model: torch.nn.Module):
        self.processor = load_processor(model_path)
        self.model = model
        self.unsampled_ids = unsampled_token_ids(model.config)
        self._pixels: OrderedDict[tuple[str, ...], dict[str, torch.Tensor]] = OrderedDict()

    def pixels_of(self, refs: list[str]) -> dict[str, torch.Tensor]:
        key = tuple(refs)
        if key in self._pixels:
            self._pixels.move_to_end(key)
            return self._pixels[key]
        out = pixel_inputs(self.processor, [load_image(r) for r in refs])
        self._pixels[key] = out
        if len(self._pixels) > _PIXEL_CACHE_SIZE:
            self._pixels.popitem(last=False)
        return out

    def attach(self, mb: MicroBatch, images: list[list[str]], uids: list[str]) -> None:
        """Give ``mb`` (one padded row per sample, ``images[i]`` row i's references) its rows' pixel inputs and
        3-D positions; a sample whose placeholders do not match its images fails naming its uid."""
        merge = self.processor.image_processor.merge_size
        image_id = int(self.model.config.image_token_id)
        grids: list[torch.Tensor | None] = []
        rows: list[dict[str, torch.Tensor]] = []
        for r, refs in enumerate(images):
            have = int((mb.input_ids[r][mb.attention_mask[r].bool()] == image_id).sum())
            pixels = self.pixels_of(refs) if refs else None
            want = placeholder_count(pixels["image_grid_thw"], merge) if pixels is not None else 0
            if have != want:
                raise ValueError(
                    f"sample uid={uids[r]}: {have} image placeholder tokens for {len(refs)} image(s) that fill {want}"
                )
            grids.append(pixels["image_grid_thw"] if pixels is not None else None)
            if pixels is not None:
                rows.append(pixels)
        mb.position_ids, _ = padded_positions(self.model, mb.input_ids, mb.attention_mask, grids)
        if rows:
            mb.pixels = _concat(rows)
        if mb.shared is not None:
            self._attach_shared(mb, images)

    def _attach_shared(self, mb: MicroBatch, images: list[list[str]]) -> None:
        """The shared-prefix layout's 3-D positions, each token's from its own row (so a slot's response continues
        from its prompt's image positions exactly as in the row), and each sequence's images once, in sequence
        order, as the model fills its placeholders."""
        layout = mb.shared
        # A padded row's real tokens are one run from its first real column: its s-th token sits at first + s.
        first = mb.attention_mask.long().argmax(dim=1)
        token = layout.source_pos >= 0
        rows, pos = layout.source_row[token], layout.source_pos[token]
        shared = torch.zeros((3, *layout.input_ids.shape), dtype=torch.long)
        shared[:, token] = mb.position_ids[:, rows, first[rows] + pos]
        layout.position_ids = shared
        # The last prompt column is real in every sequence (prompts are left-padded); its row is the group's first.
        prompt_end = layout.input_ids.shape[1] - layout.logits_to_keep
        firsts = layout.source_row[:, prompt_end].tolist()
        pixels = [self.pixels_of(images[r]) for r in firsts if images[r]]
        layout.pixels = _concat(pixels) if pixels else None


def _concat(pixels: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.cat([p[k] for p in pixels]) for k in ("pixel_values", "image_grid_thw")}


def forward_kwargs(pixels: dict[str, torch.Tensor] | None, device: torch.device) -> dict[str, Any]:
    """Pixel inputs (``MicroBatch.pixels`` or its shared layout's) on ``device``; none for text."""
    return {k: v.to(device) for k, v in (pixels or {}).items()}

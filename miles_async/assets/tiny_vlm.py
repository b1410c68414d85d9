"""A tiny random Qwen2-VL, Qwen2.5-VL or Qwen3-VL (a vision tower of one block, the tiny LM's text side) with its
processor, for fast tests.

Built from a config in about a second and saved as an ordinary HF folder: ``AutoModelForImageTextToText`` and the
processor (``miles_async.vision.hf.load_processor``) load it as they would a real Qwen2-VL checkpoint. Images are
cut into 4-pixel patches and at most 32x32 pixels, so an image costs a handful of tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miles_async.assets.tiny_model import build_tiny_tokenizer

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")
# Never in a prompt here, but a Qwen-VL processor's vocabulary holds it: vLLM's looks it up for every request.
VIDEO_TOKEN = "<|video_pad|>"

# ChatML whose message content may be a list of parts; an image part becomes Qwen2-VL's placeholder.
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


VLM_ARCHES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")

# The vision tower of each layout: one block, 32 wide, patches (4 pixels by default) merged 2x2 into the LM's 64
# dimensions.
_VISION = {
    "qwen2_vl": dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2),
    # Qwen2.5-VL: windowed attention (a window of 2x2 merged patches) except in its full-attention blocks.
    "qwen2_5_vl": dict(
        depth=1,
        hidden_size=32,
        out_hidden_size=64,
        intermediate_size=64,
        num_heads=2,
        window_size=16,
        fullatt_block_indexes=[0],
    ),
    # Qwen3-VL: learned 2-D position embeddings (an 8x8 grid, interpolated to each image) and deepstack, the first
    # block's merged features added to the first decoder layer's hidden states.
    "qwen3_vl": dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        num_position_embeddings=64,
        deepstack_visual_indexes=[0],
    ),
}


def make_tiny_vlm(
    out_dir: Path, seed: int = 0, arch: str = "qwen2_vl", head_dim: int = 16, patch_size: int = 4
) -> Path:
    """Write a random tiny VLM of layout ``arch`` (``VLM_ARCHES``) and its processor to ``out_dir``; the same
    arguments give the same weights. ``head_dim`` 32 (two heads of the 64 wide LM): vLLM's CPU attention has no kernel
    for 16. ``patch_size``: the real models' 14 (Qwen2/2.5-VL) or 16 (Qwen3-VL) for an engine that assumes it (SGLang's
    Qwen2.5-VL); images then take 2x2 to 8x8 patches, as at 4."""
    import torch
    import transformers

    if arch not in VLM_ARCHES:
        raise ValueError(f"unknown VLM arch {arch!r}; expected one of {VLM_ARCHES}")
    if head_dim not in (16, 32):
        raise ValueError(f"head_dim {head_dim}: the tiny VLM's 64-wide LM takes 16 or 32")
    prefix = {"qwen2_vl": "Qwen2VL", "qwen2_5_vl": "Qwen2_5_VL", "qwen3_vl": "Qwen3VL"}[arch]
    config_cls = getattr(transformers, f"{prefix}Config")
    model_cls = getattr(transformers, f"{prefix}ForConditionalGeneration")
    processor_cls = getattr(transformers, f"{prefix}Processor")
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["</s>", "<|im_start|>", *VISION_TOKENS, VIDEO_TOKEN]})
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    tokens = vlm_token_ids(tokenizer)
    config = config_cls(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=64 // head_dim,
            num_key_value_heads=2 if head_dim == 16 else 1,
            max_position_embeddings=512,
            # head_dim / 2 rotary frequencies split over (temporal, height, width).
            head_dim=head_dim,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 3, 3] if head_dim == 16 else [4, 6, 6],
                # Qwen3-VL's frequencies interleave (t, h, w) where Qwen2-VL's come in three blocks. Transformers'
                # Qwen3-VL always interleaves; SGLang and vLLM read this key (real Qwen3-VL configs set it) and
                # otherwise take the blocks: image positions would differ from the trainer's.
                **({"mrope_interleaved": True} if arch == "qwen3_vl" else {}),
            },
            tie_word_embeddings=True,
            **special_ids(tokenizer),
        ),
        vision_config=dict(patch_size=patch_size, spatial_merge_size=2, **_vision(arch, patch_size)),
        tie_word_embeddings=True,
        **tokens,
    )
    torch.manual_seed(seed)
    model = model_cls(config).float()
    if arch == "qwen3_vl":
        # Learned positions as strong as the patches' features, as a trained model's are: an engine that interpolates
        # them otherwise than the trainer (SGLang's code has such a mode) then differs beyond the tests' tolerances.
        with torch.no_grad():
            model.model.visual.pos_embed.weight.normal_(0.0, 1.0)
    side = 2 * patch_size
    return save_vlm(
        model,
        tokenizer,
        Path(out_dir),
        processor_cls,
        patch_size=patch_size,
        min_pixels=side**2,
        max_pixels=(4 * side) ** 2,
    )


def _vision(arch: str, patch_size: int) -> dict[str, Any]:
    out = dict(_VISION[arch])
    if "window_size" in out:  # in pixels: a window of 2x2 merged patches whatever their size
        out["window_size"] = 4 * patch_size
    return out


def special_ids(tokenizer: Any) -> dict[str, int]:
    """The config entries of the tokenizer's bos, eos and pad tokens."""
    return dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )


def vlm_token_ids(tokenizer: Any) -> dict[str, int]:
    """A Qwen2-VL config's token entries: the special tokens and the vision tokens (``VISION_TOKENS``, which the
    tokenizer must hold)."""
    start, end, pad = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
    return dict(
        image_token_id=pad,
        video_token_id=tokenizer.convert_tokens_to_ids(VIDEO_TOKEN)
        if VIDEO_TOKEN in tokenizer.get_vocab()
        else tokenizer.unk_token_id,
        vision_start_token_id=start,
        vision_end_token_id=end,
        **special_ids(tokenizer),
    )


def save_vlm(
    model: Any, tokenizer: Any, out_dir: Path, processor_cls: Any, *, patch_size: int, min_pixels: int, max_pixels: int
) -> Path:
    """Save a Qwen2-VL-layout ``model`` with its processor (the image processor's PIL backend, images resized into
    ``[min_pixels, max_pixels]``, patches merged 2x2, the tokenizer's chat template) to ``out_dir``."""
    from transformers import GenerationConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from miles_async.vision.hf import image_only

    model.generation_config = GenerationConfig(**special_ids(tokenizer))
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=patch_size, merge_size=2, temporal_patch_size=2, min_pixels=min_pixels, max_pixels=max_pixels
    )
    processor = image_only(processor_cls)(image_processor, tokenizer, chat_template=tokenizer.chat_template)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    return out_dir

"""A small vision-language model in Qwen2-VL's layout: SmolLM2-135M-Instruct's weights as its language model and a
vision tower trained from scratch (no pretrained image encoder ships in any package here).

Qwen2-VL's language model is Llama's but for biases on q/k/v and 3-D rotary positions. With zero biases and
positions equal on all three axes (every text token's), it computes exactly what SmolLM2 computes, which
``build_vlm`` checks on a prompt before it saves. Being a plain ``Qwen2VLForConditionalGeneration`` folder, it loads
in the embedded engine, the torch trainer and SGLang's Qwen2-VL.

- Vision tower: 4 blocks 192 wide, 14-pixel patches merged 2x2 into the LM's 576 dimensions: a 112x112 image is
  64 patches and 16 image tokens.
- Tokenizer: SmolLM2's plus Qwen2-VL's three vision tokens; the chat template is ChatML with image parts and no
  default system prompt.
"""

from __future__ import annotations

import json
from pathlib import Path

# The merger's output width (hidden_size) is the language model's, set when the model is built.
VISION = dict(depth=4, embed_dim=192, num_heads=4, mlp_ratio=2, patch_size=14, spatial_merge_size=2)
# SGLang's Qwen2-VL keeps its own pixel bounds (3136 to 1003520); 112x112 images lie inside both, so every side
# resizes them alike (to themselves: 112 is a multiple of 28).
MIN_PIXELS, MAX_PIXELS = 56 * 56, 112 * 112


def build_vlm(smollm2_dir: Path, out_dir: Path, seed: int = 0) -> Path:
    """Write the VLM to ``out_dir``: SmolLM2's language model, a random vision tower (``seed``)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor

    from miles_async.assets.tiny_vlm import VISION_TOKENS, VLM_CHAT_TEMPLATE, save_vlm, special_ids, vlm_token_ids

    smol = json.loads((Path(smollm2_dir) / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    head_dim = smol["hidden_size"] // smol["num_attention_heads"]
    third = head_dim // 2 // 8
    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=smol["hidden_size"],
            intermediate_size=smol["intermediate_size"],
            num_hidden_layers=smol["num_hidden_layers"],
            num_attention_heads=smol["num_attention_heads"],
            num_key_value_heads=smol["num_key_value_heads"],
            max_position_embeddings=smol["max_position_embeddings"],
            rms_norm_eps=smol["rms_norm_eps"],
            hidden_act=smol["hidden_act"],
            # The rotary frequencies split over (temporal, height, width) as Qwen2-VL's [16, 24, 24] of 64.
            rope_parameters={
                "rope_type": "default",
                "rope_theta": smol["rope_parameters"]["rope_theta"],
                "mrope_section": [2 * third, 3 * third, 3 * third],
            },
            tie_word_embeddings=True,
            **special_ids(tokenizer),
        ),
        vision_config=dict(VISION, hidden_size=smol["hidden_size"], in_channels=3, in_chans=3),
        tie_word_embeddings=True,
        **vlm_token_ids(tokenizer),
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).float()
    lm = load_file(str(Path(smollm2_dir) / "model.safetensors"))
    embed = lm.pop("model.embed_tokens.weight")
    lm.pop("lm_head.weight", None)
    language = model.model.language_model
    missing, unexpected = language.load_state_dict({k.removeprefix("model."): v for k, v in lm.items()}, strict=False)
    if unexpected or any(not k.endswith("_proj.bias") for k in missing if k != "embed_tokens.weight"):
        raise RuntimeError(f"SmolLM2's weights do not fit: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        for name, p in language.named_parameters():
            if name.endswith("_proj.bias"):
                p.zero_()
        # The vision tokens' embeddings start at the mean of SmolLM2's (they mark the image, their values are learnt).
        table = language.embed_tokens.weight
        table[: embed.shape[0]] = embed
        table[embed.shape[0] :] = embed.mean(0)
    model.tie_weights()
    _check_text_matches(model, smollm2_dir, tokenizer)
    return save_vlm(
        model, tokenizer, Path(out_dir), Qwen2VLProcessor, patch_size=VISION["patch_size"], min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
    )  # fmt: skip


def _check_text_matches(model, smollm2_dir: Path, tokenizer) -> None:
    """On a text prompt the VLM's logits are SmolLM2's: the weights and the rotary split went in right."""
    import torch
    from transformers import AutoModelForCausalLM

    ids = tokenizer("The capital of France is Paris, and the capital of Italy is", return_tensors="pt").input_ids
    ref = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    with torch.no_grad():
        want = ref(ids).logits[0]
        got = model(input_ids=ids).logits[0, :, : want.shape[-1]]
    err = (got - want).abs().max().item()
    if err > 1e-3:
        raise RuntimeError(f"the VLM's text logits differ from SmolLM2's by {err:.3g}")

"""A vision-language model's Hugging Face side: which class loads it, its processor (without torchvision), the
prompt's tokens with each image's placeholders expanded, and the pixel inputs of a sample's images.

The trainer, the engine and the data source all load the processor from the model folder with ``load_processor``,
so the three agree on every image's size, its patches and its number of placeholder tokens.
"""

from __future__ import annotations

import json
import os
from typing import Any

# The text a chat template writes for one image; a processor without its own ``image_token`` uses Qwen2-VL's.
DEFAULT_IMAGE_TOKEN = "<|image_pad|>"


class PromptImageMismatch(ValueError):
    """A prompt whose image placeholders do not match its images in number."""


def is_vision_model(model_path: str) -> bool:
    """Whether the model folder holds a vision-language model (its config has a vision tower)."""
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        return False
    with open(path, encoding="utf-8") as fh:
        return "vision_config" in json.load(fh)


def model_class(model_path: str) -> Any:
    """The transformers auto class that loads the folder: image-text-to-text for a VLM, else a causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_model(model_path) else AutoModelForCausalLM


def load_processor(model_path: str) -> Any:
    """The folder's ``AutoProcessor``; without torchvision, the same processor class with images only.

    transformers 5 builds a Qwen-VL processor with a video processor, which needs torchvision (absent from this
    project's environments; adding it would pin one more wheel to torch's exact version). The image processor has a
    PIL backend that needs none, and RL prompts here carry images, not videos: the processor class is rebuilt
    without its video attribute, so its chat template and placeholder expansion are the model's own.
    """
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(model_path, local_files_only=True)
    except (ImportError, OSError) as e:
        # ImportError: the video processor's torchvision; OSError: a folder saved without a video processor.
        first = e
    try:
        return image_only(_processor_class(model_path)).from_pretrained(model_path, local_files_only=True)
    except Exception as e:
        raise RuntimeError(f"{model_path}: the model's processor does not load ({first}; images only: {e})") from e


def _processor_class(model_path: str) -> type:
    import transformers

    name = None
    for fname in ("processor_config.json", "preprocessor_config.json"):
        path = os.path.join(model_path, fname)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as fh:
                name = json.load(fh).get("processor_class")
            if name:
                break
    cls = getattr(transformers, name, None) if name else None
    if cls is None:
        raise ValueError(f"{model_path}: no processor_class in processor_config.json to load without torchvision")
    return cls


def image_only(cls: type) -> type:
    """Processor class ``cls`` (a Qwen-VL processor) without its video processor: it builds and loads without
    torchvision."""

    # ProcessorMixin takes its attributes from __init__'s parameter names: leaving out video_processor leaves the
    # processor without one (zip drops the None passed for it).
    class ImageOnly(cls):  # type: ignore[misc, valid-type]
        def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None, **kw: Any):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kw)

    ImageOnly.__name__ = ImageOnly.__qualname__ = cls.__name__
    return ImageOnly


def image_token(processor: Any) -> str:
    return getattr(processor, "image_token", None) or DEFAULT_IMAGE_TOKEN


def chat_messages(prompt: Any, n_images: int) -> list[dict]:
    """A prompt as chat messages: a string becomes one user turn with its images first; messages pass as given
    (their content parts place the images)."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "text", "text": prompt}]}]
    return prompt


def encode_prompt(
    processor: Any,
    prompt: Any,
    images: list[Any],
    apply_chat_template: bool,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The prompt's token ids with each image's placeholder expanded to its patches (the processor's own rule);
    ``PromptImageMismatch`` when the placeholders and the images differ in number."""
    if apply_chat_template:
        text = processor.apply_chat_template(
            chat_messages(prompt, len(images)), add_generation_prompt=True, tokenize=False, **(template_kwargs or {})
        )
    elif isinstance(prompt, str):
        text = prompt
    else:
        raise ValueError("a chat-message prompt needs --apply-chat-template")
    placeholders = text.count(image_token(processor))
    if placeholders != len(images):
        raise PromptImageMismatch(
            f"the prompt has {placeholders} image placeholder(s) ({image_token(processor)}) for {len(images)} image(s)"
        )
    enc = processor(text=[text], images=images or None, return_tensors="pt")
    return enc["input_ids"][0].tolist()


def pixel_inputs(processor: Any, images: list[Any]) -> dict[str, Any]:
    """``pixel_values`` and ``image_grid_thw`` of ``images`` (PIL), as the model's forward takes them."""
    out = processor.image_processor(images=images, return_tensors="pt")
    return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def unsampled_token_ids(config: Any) -> list[int]:
    """Tokens a VLM's policy never samples: the image placeholder. One in a response would stand for no image
    (the engine's forward and the trainer's would disagree on what it is), so the engine bans it and the trainer
    computes its log-probs under the same ban: both describe the distribution actually sampled from."""
    token = getattr(config, "image_token_id", None)
    return [int(token)] if token is not None else []


def placeholder_count(image_grid_thw: Any, merge_size: int) -> int:
    """The image tokens ``image_grid_thw``'s images fill in the prompt (patches merged ``merge_size`` squared)."""
    return int(image_grid_thw.prod(dim=-1).sum()) // (merge_size * merge_size)

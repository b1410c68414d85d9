"""The embedded engine's model: one Hugging Face causal LM on the CPU, loaded from a local folder, and one forward
pass of it over a batch that shares a ``DynamicCache``.

A vision-language model (Qwen2-VL layout: a config with a ``vision_config``) loads with its processor; its prefill
takes the rows' pixel inputs and runs the vision tower, and every pass takes Qwen2-VL's 3-D positions
(``miles_async.vision.rope``), which the scheduler computes per row.

Only caches made of plain full-attention ``DynamicLayer`` s are supported (Llama, Qwen2/2.5/3,
Mistral without sliding window, ...); sliding-window or linear-attention layers would need
position-aware merging and are refused at start-up.
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import Any

import torch

logger = logging.getLogger(__name__)


class CausalLM:
    """The model, its tokenizer (for the ``text`` of results only) and what the scheduler needs to know of it."""

    def __init__(self, model_path: str, dtype: torch.dtype, attn_implementation: str = "sdpa"):
        from miles_async.vision.hf import is_vision_model, load_processor, model_class, unsampled_token_ids

        self.dtype = dtype
        self.attn_implementation = attn_implementation
        self.is_vision = is_vision_model(model_path)
        # The image processor the data source and the trainer use too: the same patches, the same placeholders.
        self.processor = load_processor(model_path) if self.is_vision else None
        # local_files_only: this engine must never reach for the model hub.
        self.model = model_class(model_path).from_pretrained(
            model_path, dtype=dtype, attn_implementation=attn_implementation, local_files_only=True
        )
        self.model.eval()
        # No requires_grad_(False): the decode loop runs under inference_mode anyway, and with
        # frozen bf16 weights torch's CPU matmul on the non-contiguous last-token view that
        # lm_head receives at prefill copies the weight once per row (~200x slower at B=32).
        self.config = self.model.config
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        self.eos_token_ids = _eos_ids(self.model)
        text_config = self.config.get_text_config()  # a VLM's language model's; a causal LM's own
        self.context_len = int(getattr(text_config, "max_position_embeddings", 0) or 0) or None
        pad = getattr(text_config, "pad_token_id", None)
        self.pad_id = int(pad) if isinstance(pad, int) and 0 <= pad < self.vocab_size else 0
        self.tokenizer = _load_tokenizer(model_path)
        self.unsampled_ids = unsampled_token_ids(self.config) if self.is_vision else []

        params = inspect.signature(self.model.forward).parameters
        # transformers 5.x renamed past_key_values -> cache; accept either so
        # remote-code models keep working.
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._has_logits_to_keep = "logits_to_keep" in params
        self._check_cache_layout()

    def new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.config)

    def _check_cache_layout(self) -> None:
        from transformers.cache_utils import DynamicLayer

        cache = self.new_cache()
        bad = [type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer]
        if bad:
            raise NotImplementedError(
                f"embedded engine supports only full-attention DynamicLayer caches; model has {sorted(set(bad))}"
            )

    def forward(
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        cache: Any,
        last_only: bool,
        pixels: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The float32 logits of each row's last position; ``cache`` grows by the input's length. ``pixels``: the
        rows' images, in row order (``pixel_values``, ``image_grid_thw``), for a prefill."""
        kwargs: dict[str, Any] = {
            "input_ids": input_ids,
            "attention_mask": mask,
            "position_ids": positions,
            self._cache_kwarg: cache,
            "use_cache": True,
            **(pixels or {}),
        }
        if last_only and self._has_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        out = self.model(**kwargs)
        return out.logits[:, -1, :].float()

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        """The text of ``ids``; "" without a tokenizer or when decoding fails (ids are the contract, text is best
        effort)."""
        if self.tokenizer is None or not ids:
            return ""
        try:
            return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        except Exception:  # noqa: BLE001 - text is best effort, ids are the contract
            logger.exception("decoding output text failed")
            return ""


def _eos_ids(model: torch.nn.Module) -> set[int]:
    ids: set[int] = set()
    sources = [getattr(getattr(model, "generation_config", None), "eos_token_id", None)]
    sources.append(getattr(model.config, "eos_token_id", None))
    for src in sources:
        if src is None:
            continue
        if isinstance(src, int):
            ids.add(src)
        else:
            ids.update(int(x) for x in src)
    return ids


def _load_tokenizer(model_path: str) -> Any:
    """The folder's tokenizer, for the "text" field only; None for a folder without tokenizer files (a valid model
    folder: callers send input_ids and read output_ids, and text is ""). Tokenizer files that do not load are an
    error at start: serving "" as every text would score every text reward on an empty string."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    found = [f for f in names if os.path.exists(os.path.join(model_path, f))]
    if not found:
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - whatever transformers raises, the engine must not start
        raise RuntimeError(
            f"embedded engine: the tokenizer in {model_path} ({', '.join(found)}) does not load: "
            f"{type(exc).__name__}: {exc}"
        ) from exc

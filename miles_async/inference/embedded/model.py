"""The embedded engine's model: one Hugging Face causal LM on the CPU, loaded from a local folder, and one forward
pass of it over a batch that shares a ``DynamicCache`` (of ``kv_cache.GrowingLayer`` s where ``GROWING_KV_CACHE``).

A vision-language model (Qwen2-VL layout: a config with a ``vision_config``) loads with its processor; its prefill
takes the rows' pixel inputs and runs the vision tower, and every pass takes Qwen2-VL's 3-D positions
(``miles_async.vision.rope``), which the scheduler computes per row.

Only caches made of plain full-attention ``DynamicLayer`` s are supported (Llama, Qwen2/2.5/3,
Mistral without sliding window, ...); sliding-window or linear-attention layers would need
position-aware merging and are refused at start-up.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch

from miles_async.inference.embedded import decode_attention, kv_cache
from miles_async.inference.routed_experts import DENSE_LAYER_FILL
from miles_async.utils.moe_routers import find_routers

logger = logging.getLogger(__name__)

# Levers (``benchmarks/levers.py``) are on by default only where the levers table shows them faster beyond noise or
# they have another benefit. Neither of these was faster than what it replaces at 32 or 128 tokens an answer
# (float32, 8 alternated rounds: within noise): the growing cache (``kv_cache.py``, against transformers'
# DynamicCache; it also keeps up to a quarter more columns) and a decode step's attention as two matmuls
# (``decode_attention.py``, against HF's sdpa).
GROWING_KV_CACHE = False
DECODE_MATMULS = False


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
        if DECODE_MATMULS and attn_implementation == "sdpa" and not self.is_vision:
            # the same attention, its decode steps without the flash kernel's overhead (decode_attention.py)
            decode_attention.register()
            self.model.set_attn_implementation(decode_attention.DECODE_SDPA)
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
        self.routers = MoERouters(self.model, text_config)
        # What the last forward's MoE routers chose (``forward(..., capture_routing=True)``), else None.
        self.last_routing: torch.Tensor | None = None

    def new_cache(self) -> Any:
        """An empty cache: transformers' ``DynamicCache``, or one whose layers append in place (``kv_cache.py``)
        where ``GROWING_KV_CACHE``."""
        from transformers import DynamicCache

        return kv_cache.new_cache(self.config) if GROWING_KV_CACHE else DynamicCache(config=self.config)

    def _check_cache_layout(self) -> None:
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        cache = DynamicCache(config=self.config)
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
        capture_routing: bool = False,
    ) -> torch.Tensor:
        """The float32 logits of each row's last position; ``cache`` grows by the input's length. ``pixels``: the
        rows' images, in row order (``pixel_values``, ``image_grid_thw``), for a prefill. ``capture_routing`` (an
        MoE model): ``last_routing`` becomes the experts every MoE layer chose at every input position,
        ``[B, S, num_hidden_layers, num_experts_per_tok]`` int32 (padding positions included; dense layers 0)."""
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
        self.last_routing = None
        if not capture_routing:
            out = self.model(**kwargs)
            return out.logits[:, -1, :].float()
        if not self.routers:
            raise ValueError(f"routed experts: {self.routers.why_not}")
        with self.routers.capture() as captured:
            out = self.model(**kwargs)
        self.last_routing = self.routers.stack(captured, *input_ids.shape)
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


class MoERouters:
    """The MoE routers of a transformers 5 model (``utils/moe_routers.py``) and the experts they choose in a forward
    pass: a forward hook on each router keeps its ``indices`` while capturing (nothing otherwise: a hook that returns
    at once). Falsy where routed experts cannot be returned: ``why_not`` says why (a dense model; an MoE block whose
    router is not such a ``gate``, e.g. GPT-OSS's or Llama 4's ``router``).
    """

    def __init__(self, model: torch.nn.Module, text_config: Any):
        self.by_layer, unsupported = find_routers(model)
        self.num_layers = int(getattr(text_config, "num_hidden_layers", 0) or 0)
        self.topk = int(getattr(text_config, "num_experts_per_tok", 0) or 0)
        self.why_not: str | None = None
        if unsupported:
            self.why_not = (
                f"the embedded engine reads the experts of transformers 5's top-k routers (an MoE block's `gate` "
                f"returning (logits, weights, indices)); {unsupported[0]} has none"
            )
        elif not self.by_layer:
            self.why_not = "the model has no MoE layers"
        elif self.topk < 1 or max(self.by_layer) >= self.num_layers:
            self.why_not = (
                f"MoE routers in layers {sorted(self.by_layer)} do not fit the config's "
                f"num_hidden_layers={self.num_layers}, num_experts_per_tok={self.topk}"
            )
        self._captured: dict[int, torch.Tensor] | None = None
        if self.why_not is None:
            for layer, gate in self.by_layer.items():
                gate.register_forward_hook(self._hook(layer))

    def __bool__(self) -> bool:
        return self.why_not is None

    def _hook(self, layer: int) -> Any:
        def keep(_module: torch.nn.Module, _args: Any, output: Any) -> None:
            if self._captured is None:
                return
            indices = output[-1] if isinstance(output, tuple) and len(output) == 3 else None
            if not isinstance(indices, torch.Tensor) or indices.dtype.is_floating_point or indices.dim() != 2:
                raise NotImplementedError(
                    f"routed experts: the router of layer {layer} ({type(_module).__name__}) does not return "
                    f"(router_logits, weights, indices [tokens, top_k]) as transformers 5's MoE routers do"
                )
            self._captured[layer] = indices

        return keep

    @contextlib.contextmanager
    def capture(self) -> Iterator[dict[int, torch.Tensor]]:
        self._captured = captured = {}
        try:
            yield captured
        finally:
            self._captured = None

    def stack(self, captured: dict[int, torch.Tensor], batch: int, seq: int) -> torch.Tensor:
        """The captured indices as one ``[batch, seq, num_layers, topk]`` int32 tensor; a dense layer's entries 0
        (what SGLang returns for one: ``inference/routed_experts.py``)."""
        out = torch.full((batch, seq, self.num_layers, self.topk), DENSE_LAYER_FILL, dtype=torch.int32)
        for layer, indices in captured.items():
            if indices.shape != (batch * seq, self.topk):
                raise NotImplementedError(
                    f"routed experts: layer {layer}'s router returned indices of shape {tuple(indices.shape)}, "
                    f"expected ({batch * seq}, {self.topk}) for a [{batch}, {seq}] input"
                )
            out[:, :, layer] = indices.view(batch, seq, self.topk)
        return out


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

"""Rollout routing replay (R3): the experts an MoE model's routers chose for each token, as SGLang returns them.

A ``/generate`` request with ``"return_routed_experts": true`` (and optionally ``"routed_experts_start_len": S``,
an int in ``[0, len(input_ids)]``) is answered with ``meta_info["routed_experts"]``: the base64 (standard
alphabet) of a C-order int32 array of shape ``[rows, num_hidden_layers, num_experts_per_tok]``. Its rows are the
sequence positions ``[S, len(input_ids) + len(output_ids) - 1)``: every position whose forward pass produced the
next token (prompt positions and generated ones, not the last generated token, which no forward pass has read).
Each row holds, for every decoder layer, the indices of the experts that layer's router picked for that
position's token, in the router's own order. A dense layer of a partly-MoE model (DeepSeek's
``first_k_dense_replace``, Qwen3-MoE's ``mlp_only_layers``) holds 0s, as SGLang's (its capture buffers start
zeroed and only MoE layers write theirs).

This is SGLang's own format (``sglang.srt.state_capturer.routed_experts``: ``get_topk`` gathers the rows of
``[start_len, seqlen - 1)``; ``DetokenizerManager._b64_encode_per_request`` writes
``b64encode(tensor.numpy().tobytes())``), which slime reads; the embedded engine answers in it too. Pure numpy:
the rollout side imports ``decode`` without torch.
"""

from __future__ import annotations

import base64
import binascii

import numpy as np

# What a dense layer's entries hold (SGLang's capture buffers start zeroed; a dense layer never writes its slice).
DENSE_LAYER_FILL = 0


def encode(array: np.ndarray) -> str:
    """``array`` (``[rows, layers, topk]``, any integer dtype) as SGLang returns it: base64 of C-order int32."""
    a = np.asarray(array)
    if a.ndim != 3:
        raise ValueError(f"routed experts must be a [rows, layers, topk] array; got shape {a.shape}")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"routed experts must be integers; got dtype {a.dtype}")
    return base64.b64encode(np.ascontiguousarray(a, dtype=np.int32).tobytes()).decode("ascii")


def decode(b64: str, num_layers: int, topk: int) -> np.ndarray:
    """``meta_info["routed_experts"]`` back to an int32 array ``[rows, num_layers, topk]`` (``num_layers``: the
    model's ``num_hidden_layers``; ``topk``: its ``num_experts_per_tok``). ``ValueError`` when the text is not
    base64 or its size is not a whole number of rows of that shape."""
    if num_layers < 1 or topk < 1:
        raise ValueError(f"num_layers ({num_layers}) and topk ({topk}) must be >= 1")
    if not isinstance(b64, str):
        raise ValueError(f"routed experts must be a base64 string; got {type(b64).__name__}")
    try:
        raw = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"routed experts are not valid base64: {exc}") from exc
    row_bytes = num_layers * topk * 4
    if len(raw) % row_bytes:
        raise ValueError(
            f"routed experts: {len(raw)} bytes is not a whole number of rows of {num_layers} layers x {topk} experts "
            f"x 4 bytes (int32) = {row_bytes} bytes; are num_layers (num_hidden_layers) and topk "
            f"(num_experts_per_tok) the model's?"
        )
    return np.frombuffer(raw, dtype=np.int32).reshape(-1, num_layers, topk).copy()

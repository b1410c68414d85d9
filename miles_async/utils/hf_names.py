"""An HF model's tensors under the names its checkpoint gives them.

transformers 5 loads some checkpoints into parameters shaped otherwise than on disk: an MoE layer's routed experts
become two fused tensors (``mlp.experts.gate_up_proj`` ``[experts, 2 x ffn, hidden]`` and ``mlp.experts.down_proj``)
where the checkpoint names each expert's projections, Mixtral's ``block_sparse_moe`` becomes ``mlp``, and a
vision-language model's text layers move under ``model.language_model``. SGLang and vLLM load weights, and any other
tool reads an HF folder, by the checkpoint's names. So every export of an HF model (the torch backend's stream and
``--save-hf``, and the embedded engine's weight checksum, compared with the trainer's) goes through transformers'
own inverse of its load-time conversion, one parameter at a time, as ``save_pretrained`` does for a whole state
dict.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


def checkpoint_named(
    model: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``named`` (the model's live parameter names) renamed, and fused tensors split, as the checkpoint names them.
    A split tensor's parts are views of it: nothing is copied here."""
    from transformers.core_model_loading import revert_weight_conversion

    for name, tensor in named:
        yield from revert_weight_conversion(model, {name: tensor}).items()

"""Our attention functions as transformers attention implementations a model can be switched to."""

from __future__ import annotations

from collections.abc import Callable


def register_sdpa_variant(name: str, attention: Callable) -> None:
    """Register ``attention`` with transformers under ``name``, with sdpa's mask (idempotent).

    The variants (the trainer's shared-prefix attention, the engine's decode attention) take the masks HF's sdpa
    takes, so a model switched to ``name`` builds its masks exactly as under "sdpa".
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    if name not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, attention)
        AttentionMaskInterface.register(name, sdpa_mask)

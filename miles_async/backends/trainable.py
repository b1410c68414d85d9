"""--only-train-params-name-list / --freeze-params-name-list (slime's flags): which of the policy's weights train.

Patterns are Python regexes matched with ``re.search`` against the model's parameter names (transformers' names,
e.g. ``model.visual.blocks.0.attn.qkv.weight``). A pattern that matches nothing is a typo or a wrong model, so it
is refused naming the pattern and some of the names there are; so is a selection that leaves nothing to train.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

import torch


def trainable_names(names: Iterable[str], only: Sequence[str] = (), freeze: Sequence[str] = ()) -> set[str]:
    """The parameter names that train: those matching a pattern of ``only`` (all when it is empty), less those
    matching a pattern of ``freeze``. ``ValueError`` naming the flag for a pattern matching no name, or when
    nothing is left."""
    names = list(names)
    for flag, patterns in (("--only-train-params-name-list", only), ("--freeze-params-name-list", freeze)):
        for pattern in patterns:
            if not any(re.search(pattern, n) for n in names):
                sample = ", ".join(names[:3] + names[-2:])
                raise ValueError(f"{flag}: {pattern!r} matches none of the model's parameters (e.g. {sample})")
    keep = {n for n in names if not only or any(re.search(p, n) for p in only)}
    keep -= {n for n in keep if any(re.search(p, n) for p in freeze)}
    if not keep:
        raise ValueError("--only-train-params-name-list / --freeze-params-name-list leave no parameter to train")
    return keep


def select_trainable(model: torch.nn.Module, only: Sequence[str], freeze: Sequence[str]) -> None:
    """Freeze every parameter of ``model`` outside the selection (no-op without patterns)."""
    if not only and not freeze:
        return
    keep = trainable_names((n for n, _ in model.named_parameters()), only, freeze)
    for name, param in model.named_parameters():
        if name not in keep:
            param.requires_grad_(False)

"""``import torchvision`` with PyPI's CUDA wheel on a CPU torch, for the engines' CPU start-up shims.

PyPI's torchvision wheels are CUDA builds: with a CPU torch their compiled ops (``torchvision/_C.so``) cannot load,
and ``import torchvision`` then fails in ``_meta_registrations``, which registers fake kernels for
``torchvision::nms`` and ``torchvision::qnms`` unconditionally. Declaring the two op schemas (no implementation)
lets the Python part import (its transforms are torch code); calling the two ops would still fail. Engines need it
for a VLM's processor: transformers 5 builds a Qwen-VL processor with its video processor, which imports
torchvision. Imported by each engine's ``cpu_shims/sitecustomize.py`` at interpreter start-up: it imports torch
only where torchvision is installed, and nothing of ours but ``utils/upstream_patches.py``.
"""

from __future__ import annotations


def declare_ops(env: str) -> None:
    """Declares the two schemas where torchvision's ops did not load; ``env``: the engine whose environment this is
    ("sglang", "vllm"), whose torchvision the patch was checked against (``utils/upstream_patches.py``)."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is None:
        return
    import torch

    try:
        torch.ops.torchvision.nms  # noqa: B018 - present when torchvision's ops loaded
        return
    except (AttributeError, RuntimeError):
        pass
    from miles_async.utils.upstream_patches import check

    lib = torch.library.Library("torchvision", "FRAGMENT")
    for op in ("nms", "qnms"):
        check(f"torch.ops.torchvision.{op}", env)
        try:
            lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        except RuntimeError:
            pass
    declare_ops.library = lib  # the fragment lives as long as the process

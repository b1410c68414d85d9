"""Megatron-core on a machine without CUDA: the one place that knows CUDA is absent.

megatron-core assumes a GPU: it asks ``torch.cuda.current_device()``, keeps its RNG
tracker in CUDA generator states, and creates a few hundred tensors with
``device="cuda"`` / ``torch.cuda.current_device()`` / ``.cuda()`` (DDP buffers, the
optimizer's bookkeeping, the pipeline schedule's loss accumulators). ``apply()`` makes
all of those land on the CPU:

* ``torch.cuda.current_device`` returns 0 and every device that names CUDA (``"cuda"``,
  ``"cuda:N"``, ``torch.device("cuda")``, a bare int) is rewritten to the CPU by a
  ``TorchFunctionMode`` on factory calls, ``Tensor.to``/``.cuda()`` and friends;
* the CUDA RNG-state functions (torch's and Megatron's tracker helpers) read and write
  the CPU generator;
* CUDA streams, events and synchronisation become no-ops;
* ``Tensor.type()`` reports CPU tensors under their CUDA names ("torch.cuda.FloatTensor"),
  which Megatron's optimizers and gradient clipping dispatch on and assert.

It is applied only when ``torch.cuda.is_available()`` is false; on a GPU ``apply()``
returns at once, so the GPU path pays nothing.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch.overrides import TorchFunctionMode

_applied = False
_lock = threading.Lock()
_CPU = torch.device("cpu")


def needed() -> bool:
    return not torch.cuda.is_available()


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpu(TorchFunctionMode):
    """Rewrites every CUDA device argument of a torch call to the CPU."""

    _TO_SELF = {torch.Tensor.cuda, torch.Tensor.pin_memory, torch.Tensor.record_stream}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._TO_SELF:
            return args[0] if func is not torch.Tensor.record_stream else None
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # Megatron's optimizers dispatch on (and assert) 'torch.cuda.FloatTensor'-style names.
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs = {**kwargs, "device": _CPU}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], _CPU, *args[2:])
        if kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
        return func(*args, **kwargs)


class _NoStream:
    def __init__(self, *a, **k):
        pass

    def wait_stream(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def record_event(self, *a, **k):
        return _NoEvent()

    def synchronize(self):
        pass


class _NoEvent(_NoStream):
    def record(self, *a, **k):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def apply() -> None:
    """Install the shim in this process (idempotent); a no-op when CUDA is present."""
    global _applied
    if not needed():
        return
    with _lock:
        if _applied:
            _activate_mode()
            return
        cuda = torch.cuda
        cuda.current_device = lambda: 0
        cuda.set_device = lambda *a, **k: None
        cuda.synchronize = lambda *a, **k: None
        cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
        cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
        cuda.manual_seed = lambda seed: None  # the CPU generator is seeded by the worker
        cuda.manual_seed_all = lambda seed: None
        cuda.Stream = _NoStream
        cuda.Event = _NoEvent
        cuda.current_stream = lambda *a, **k: _NoStream()
        cuda.default_stream = lambda *a, **k: _NoStream()
        cuda.stream = lambda *a, **k: contextlib.nullcontext()
        cuda.memory_allocated = lambda *a, **k: 0
        cuda.max_memory_allocated = lambda *a, **k: 0
        cuda.empty_cache = lambda: None

        from megatron.core.tensor_parallel import random as mrandom

        mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
        mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
        # Activation recompute (--recompute-granularity) runs layers' forward again inside backward, which runs
        # within this mode's own handler for Tensor.backward, where torch disables the mode: give it its own.
        recompute = mrandom.CheckpointFunction.backward
        mrandom.CheckpointFunction.backward = staticmethod(lambda ctx, *grads: _in_mode(recompute, ctx, *grads))
        _applied = True
        _activate_mode()


_mode_threads: set[int] = set()


def _in_mode(fn, *args):
    with _CudaToCpu():
        return fn(*args)


def _activate_mode() -> None:
    # Torch-function modes are thread-local: enter it once in each thread that drives Megatron.
    tid = threading.get_ident()
    if tid not in _mode_threads:
        _CudaToCpu().__enter__()
        _mode_threads.add(tid)

"""Megatron-core on a machine without CUDA: the one place that knows CUDA is absent.

megatron-core assumes a GPU: it asks ``torch.cuda.current_device()``, keeps its RNG
tracker in CUDA generator states, and creates a few hundred tensors with
``device="cuda"`` / ``torch.cuda.current_device()`` / ``.cuda()`` (DDP buffers, the
optimizer's bookkeeping, the pipeline schedule's loss accumulators). ``apply()`` makes
all of those land on the CPU:

* ``torch.cuda.current_device`` returns 0 and every device that names CUDA (``"cuda"``,
  ``"cuda:N"``, ``torch.device("cuda")``, a bare int) is rewritten to the CPU by a
  ``TorchFunctionMode`` on factory calls, ``torch.device(...)`` itself, ``Tensor.to``/``.cuda()`` and friends;
* the CUDA RNG-state functions (torch's and Megatron's tracker helpers) read and write
  the CPU generator;
* CUDA streams, events and synchronisation become no-ops;
* ``Tensor.type()`` reports CPU tensors under their CUDA names ("torch.cuda.FloatTensor"),
  which Megatron's optimizers and gradient clipping dispatch on and assert;
* the MoE alltoall dispatcher's split sizes, which it moves off the GPU as numpy arrays
  (the form ``all_to_all_single`` takes) only when they were on the GPU, become numpy here too;
* gathers and reduce-scatters of uneven blocks (the dispatcher's, under TP x EP), which NCCL
  runs and gloo refuses, run as even ones: padded to the largest block, and an all-reduce.

It is applied only when ``torch.cuda.is_available()`` is false; on a GPU ``apply()``
returns at once, so the GPU path pays nothing. ``init_parallel`` applies it in the Megatron rank's own process, for
that process's life; ``uninstall()`` puts every original back (``installed()``: for a block). Each replacement is
registered, with the torch or megatron-core version it was written against, in ``utils/upstream_patches.py``:
``apply()`` checks every target exists before it replaces any.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from miles_async.utils import upstream_patches

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
        if not REPLACED.active:  # uninstalled while this thread's mode stayed on its stack
            return func(*args, **kwargs)
        if func in self._TO_SELF:
            return args[0] if func is not torch.Tensor.record_stream else None
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # Megatron's optimizers dispatch on (and assert) 'torch.cuda.FloatTensor'-style names.
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        if func is torch.device and args and _is_cuda(args[0]):
            return _CPU  # e.g. ``with torch.device(torch.cuda.current_device()):`` (YaRN's RoPE tables)
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


# Every replacement below is registered, with the version it was written against, in utils/upstream_patches.py.
_CUDA = "torch.cuda."
_MODE = "torch.overrides.TorchFunctionMode"
_BACKWARD = "torch.autograd._engine_run_backward"
_RNG = "megatron.core.tensor_parallel.random."
_MAPPINGS = "megatron.core.tensor_parallel.mappings."
_GATHER, _REDUCE_SCATTER = _MAPPINGS + "_gather_along_first_dim", _MAPPINGS + "_reduce_scatter_along_first_dim"
_MOVE_TO_CPU = "megatron.core.transformer.moe.token_dispatcher.maybe_move_tensor_to_cpu"


_CUDA_STANDINS = {
    "current_device": lambda: 0,
    "set_device": lambda *a, **k: None,
    "synchronize": lambda *a, **k: None,
    "get_rng_state": lambda device="cuda": torch.get_rng_state(),
    "set_rng_state": lambda state, device="cuda": torch.set_rng_state(state),
    "manual_seed": lambda seed: None,  # the CPU generator is seeded by the worker
    "manual_seed_all": lambda seed: None,
    "Stream": _NoStream,
    "Event": _NoEvent,
    "current_stream": lambda *a, **k: _NoStream(),
    "default_stream": lambda *a, **k: _NoStream(),
    "stream": lambda *a, **k: contextlib.nullcontext(),
    "memory_allocated": lambda *a, **k: 0,
    "max_memory_allocated": lambda *a, **k: 0,
    "empty_cache": lambda: None,
}


def _replacements(original: Mapping[str, Any]) -> dict[str, Any]:
    engine, gather, reduce_scatter = original[_BACKWARD], original[_GATHER], original[_REDUCE_SCATTER]
    return {
        **{_CUDA + name: fn for name, fn in _CUDA_STANDINS.items()},
        _RNG + "_get_cuda_rng_state": lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state(),
        _RNG + "_set_cuda_rng_state": lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state),
        # Backward runs within this mode's own handler for Tensor.backward, where torch disables the mode, yet
        # Megatron's autograd functions make CUDA tensors there too (activation recompute runs layers' forward
        # again, the MoE token exchange allocates its output): the autograd engine's pass gets a mode of its own.
        _BACKWARD: lambda *a, **k: _in_mode(engine, *a, **k),
        _MOVE_TO_CPU: _to_cpu,
        _GATHER: lambda x, group, sizes=None, *a, **k: (
            gather(x, group, sizes, *a, **k) if sizes is None else _gather_uneven(x, group, sizes)
        ),
        _REDUCE_SCATTER: lambda x, group, sizes=None, *a, **k: (
            reduce_scatter(x, group, sizes, *a, **k) if sizes is None else _reduce_scatter_uneven(x, group, sizes)
        ),
    }


REPLACED = upstream_patches.Replaced(
    [
        *(_CUDA + name for name in _CUDA_STANDINS),
        _RNG + "_get_cuda_rng_state",
        _RNG + "_set_cuda_rng_state",
        _BACKWARD,
        _MOVE_TO_CPU,
        _GATHER,
        _REDUCE_SCATTER,
    ]
)


def apply() -> None:
    """Install the shim in this process (idempotent), and its mode in the calling thread; a no-op when CUDA is
    present. Raises ``PatchTargetMissing`` naming the first target that is gone, having replaced nothing."""
    if not needed():
        return
    with _lock:
        if not REPLACED.active:
            upstream_patches.check(_MODE, "main")
            REPLACED.install(_replacements)
        _activate_mode()


def uninstall() -> None:
    """Puts every original back and leaves the calling thread's mode; a mode other threads entered stays on their
    stacks, inert (it rewrites nothing once uninstalled)."""
    with _lock:
        REPLACED.restore()
        mode = getattr(_thread, "mode", None)
        if mode is not None:
            mode.__exit__(None, None, None)
            _thread.mode = None


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """The shim for the block's duration (for a process that runs other torch code besides the backend)."""
    apply()
    try:
        yield
    finally:
        uninstall()


def _to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
    return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor


def _gather_uneven(x: torch.Tensor, group, sizes) -> torch.Tensor:
    import torch.distributed as dist

    sizes = [int(n) for n in sizes]
    padded = x.new_zeros(max(sizes), *x.shape[1:])
    padded[: x.shape[0]] = x
    out = x.new_empty(len(sizes) * max(sizes), *x.shape[1:])
    dist.all_gather_into_tensor(out, padded, group=group)
    return torch.cat([block[:n] for block, n in zip(out.chunk(len(sizes)), sizes)])


def _reduce_scatter_uneven(x: torch.Tensor, group, sizes) -> torch.Tensor:
    import torch.distributed as dist

    sizes = [int(n) for n in sizes]
    total = x.clone()
    dist.all_reduce(total, group=group)
    start = sum(sizes[: group.rank()])
    return total[start : start + sizes[group.rank()]].contiguous()


_thread = threading.local()


def _in_mode(fn, *args, **kwargs):
    with _CudaToCpu():
        return fn(*args, **kwargs)


def _activate_mode() -> None:
    # Torch-function modes are thread-local: enter it once in each thread that drives Megatron.
    if getattr(_thread, "mode", None) is None:
        _thread.mode = _CudaToCpu()
        _thread.mode.__enter__()

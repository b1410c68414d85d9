"""A stand-in for ``sgl_kernel`` so SGLang's real server runs on a CPU (tests only).

SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``, ``--device cpu``, torch-native attention)
imports two ops from the CPU build of sgl_kernel, which is not published on PyPI (the
``sglang-kernel`` wheel on PyPI is the CUDA build). These are those ops written plainly in
torch (and ctypes), with the semantics of SGLang's Triton kernels of the same name:

* ``assign_req_to_token_pool_cpu``: for each request ``i`` of the batch, the token-pool slots
  ``req_to_token[req_pool_indices[i], start[i]:end[i]]`` get the next ``end[i] - start[i]``
  entries of ``out_cache_loc`` (requests packed one after the other);
* ``copy_all_layer_kv_cache_cpu``: in every KV buffer (one raw pointer and row stride in bytes
  per buffer), row ``src_loc[j]`` is copied to row ``tgt_loc[j]``; every source row is read
  before any is written, so overlapping moves are safe.

Other CPU ops (speculative decoding, AMX kernels) are imported at module level by SGLang but
called only by features a plain CPU text model does not use; any other name imported from here
is a function that raises ``NotImplementedError`` naming the op, so a use shows at once.

Put this folder on the engine's PYTHONPATH (the launcher does so when it applies its CPU
defaults); nothing else imports it.
"""

from __future__ import annotations

import torch

from miles_async.utils.upstream_patches import check

check("sgl_kernel", "sglang")  # registered with the SGLang version whose calls these ops were written for

__version__ = "0.0.0+miles-async-cpu-standin"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    offset = 0
    for row, start, end in zip(rows, starts, ends):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    import ctypes

    tgt = tgt_loc.tolist()
    src = src_loc.tolist()
    for base, stride in zip(data_ptrs.tolist(), strides.tolist()):
        rows = [ctypes.string_at(base + s * stride, stride) for s in src]
        for t, row in zip(tgt, rows):
            ctypes.memmove(base + t * stride, row, stride)


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not in the CPU stand-in (miles_async/inference/sglang/cpu_shims)"
        )

    missing.__name__ = name
    return missing

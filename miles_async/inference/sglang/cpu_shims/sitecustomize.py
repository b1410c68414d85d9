"""Runs at start-up of every Python process with this folder on PYTHONPATH (the SGLang CPU engine's).

SGLang imports torchvision at start-up (image transforms of its multimodal configs), whose PyPI wheel is a CUDA
build that does not import on the CPU torch of the SGLang environment: ``inference/torchvision_ops.py`` makes it
importable.

SGLang allocates its host-side buffers through ``ALLOC_MEMORY_FUNCS[device]``
(``sglang.srt.mem_cache.pool_host.common``), which for ``"cpu"`` pins the buffer with
``cudaHostRegister`` (``alloc_with_host_register``): with a CPU torch that raises "Torch not compiled
with CUDA enabled". Its routed-experts capturer (``--enable-return-routed-experts``, rollout routing replay)
allocates its host cache so on ``--device cpu``, and the server died at start-up. Without CUDA there is
nothing to pin for: once that module is imported, its ``"cpu"`` entry allocates the same buffer unpinned.

SGLang's multimodal processor of Qwen2-VL and Qwen2.5-VL (``sglang.srt.multimodal.processors.qwen_vl``) imports the
Qwen3.5 model, which on a CPU binds four ``torch.ops.sgl_kernel`` ops of the (unpublished) CPU sgl_kernel at import
time (``sglang/srt/models/qwen3_5.py``: ``_fused_sigmoid_mul_cpu = torch.ops.sgl_kernel.fused_sigmoid_mul_cpu``
...). Without them the import fails, SGLang skips the processor module ("Ignore import error"), and a Qwen-VL server
dies at start-up with "No processor registered for architecture". Those four names are set on the op namespace as
functions that raise ``NotImplementedError`` naming the op: only a Qwen3.5 model would call them. Only these names:
SGLang picks CPU paths by ``hasattr(torch.ops.sgl_kernel, ...)`` for other ops.
"""

import sys

# Each patch is registered, with the SGLang or torchvision version it was written against, in
# miles_async/utils/upstream_patches.py, and checks its target there when applied; a shim that fails is written to
# stderr naming it (run_shim), and start-up goes on.
try:
    from miles_async.utils.upstream_patches import check, run_shim  # the checkout is on the engine's PYTHONPATH
except Exception as exc:  # noqa: BLE001 - reported: no shim can run without it
    print(f"miles-async CPU shims: cannot import miles_async ({type(exc).__name__}: {exc}); none applied",
          file=sys.stderr, flush=True)  # fmt: skip
    run_shim = None


def _declare_torchvision_ops() -> None:
    from miles_async.inference.torchvision_ops import declare_ops

    declare_ops("sglang")


# The torch.ops.sgl_kernel ops that sglang/srt/models/qwen3_5.py binds at import on a CPU (none is called by another
# model).
_OPS_BOUND_AT_IMPORT = (
    "fused_sigmoid_mul_cpu",
    "fused_qk_gemma_rmsnorm_cpu",
    "fused_qk_gemma_rmsnorm_with_gate_cpu",
    "fused_qkvzba_split_reshape_cat_contiguous_cpu",
)


def _missing_op(name):
    def missing(*args, **kwargs):
        raise NotImplementedError(
            f"torch.ops.sgl_kernel.{name} is not in the CPU stand-in (miles_async/inference/sglang/cpu_shims)"
        )

    missing.__name__ = name
    return missing


def _declare_import_time_ops() -> None:
    import os

    if os.environ.get("SGLANG_USE_CPU_ENGINE") != "1":
        return
    import torch

    namespace = torch.ops.sgl_kernel
    for name in _OPS_BOUND_AT_IMPORT:
        if not hasattr(namespace, name):
            check(f"torch.ops.sgl_kernel.{name}", "sglang")
            setattr(namespace, name, _missing_op(name))


_HOST_POOLS = "sglang.srt.mem_cache.pool_host.common"


def _alloc_unpinned(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
    return allocator.allocate(dims, dtype=dtype, device=device)


def _unpinned_cpu_pools(module) -> None:
    check(f"{_HOST_POOLS}.ALLOC_MEMORY_FUNCS", "sglang")
    import torch

    if not torch.cuda.is_available():
        module.ALLOC_MEMORY_FUNCS["cpu"] = _alloc_unpinned


class _AfterImport:
    """A meta-path finder that runs ``patch(module)`` once the module ``name`` has been executed."""

    def __init__(self, name, patch):
        self.name, self.patch = name, patch

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_and_patch(module):
            run(module)
            run_shim(f"{self.name} (after import)", lambda: self.patch(module))

        spec.loader.exec_module = exec_and_patch
        return spec


if run_shim is not None:
    run_shim("torchvision op schemas", _declare_torchvision_ops)
    run_shim("torch.ops.sgl_kernel ops bound at import", _declare_import_time_ops)
    run_shim(_HOST_POOLS, lambda: sys.meta_path.insert(0, _AfterImport(_HOST_POOLS, _unpinned_cpu_pools)))

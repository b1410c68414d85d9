"""Every replacement this project makes in another package's code, with the exact version it was written against.

A patch of torch, megatron-core, SGLang or torchvision is written for that package's code at one version: a
function it replaces may be renamed, change its signature or stop being called by the next one. So each patch is
listed here (``PATCHES``) with its target (a dotted name), the package and version it was written against, where it
runs, how long it stays and why; ``tests/unit/test_upstream_patches.py`` fails when an installed or pinned version
differs from the one recorded, so an upgrade cannot silently run stale patches. When applied, each patch checks
(``check``) that its target still exists, failing with an error that names it, and warns on stderr when the
installed version is not the recorded one.

Imported by the engines' start-up shims (``inference/*/cpu_shims/sitecustomize.py``) in the engines' own
environments: standard library only.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

TORCH, MEGATRON, SGLANG, TORCHVISION = "torch", "megatron-core", "sglang", "torchvision"
# The versions the patches were written against: requirements-megatron.txt, requirements-sglang.txt and
# scripts/lib/torch_install.sh pin the same ones (the test compares).
WRITTEN_AGAINST = {TORCH: "2.13.0", MEGATRON: "0.16.1", SGLANG: "0.5.23", TORCHVISION: "0.28.0"}

# How long a patch stays, by who applies it.
_MEGATRON_RANK = (
    "the Megatron rank's process, from init_parallel until cpu_compat.uninstall(), which restores the original. "
    "The rank's process (a Ray actor or a spawned rank) runs nothing but the backend, and Megatron keeps what it "
    "built under the patch (RNG tracker states, DDP buffers, streams) for every later call, the checkpoint "
    "writer's thread included, so it stays for the process's life there"
)
_MEGATRON_MODEL = (
    "the process that builds a Megatron model without Transformer Engine (model.py _without_te), for its life: "
    "the flag is read by every later forward; the rank's process runs nothing else"
)
_ENGINE_START = (
    "the engine's process, for its life: set at interpreter start-up (sitecustomize), before the engine imports "
    "the module that binds or reads it; the engine's process runs nothing else, and its environment is its own"
)


@dataclass(frozen=True)
class Patch:
    target: str  # the dotted name replaced (or, with ``defines``, added)
    package: str  # the distribution whose code the patch was written against ...
    env: str  # ... as installed in this environment: "main" (the project's venv), "sglang" or "vllm" (the engines')
    by: str  # the module that applies it
    lasts: str  # how long it stays, and why not scoped tighter
    why: str
    defines: bool = False  # the name is added where absent: only its owner must exist

    @property
    def version(self) -> str:
        return WRITTEN_AGAINST[self.package]


def _cpu_compat(target: str, why: str, package: str = TORCH) -> Patch:
    return Patch(target, package, "main", "miles_async/backends/megatron/cpu_compat.py", _MEGATRON_RANK, why)


_CUDA_NO_OPS = ("set_device", "synchronize", "manual_seed", "manual_seed_all", "stream", "empty_cache")
_CUDA_ZEROS = ("current_device", "memory_allocated", "max_memory_allocated")
_SGL_KERNEL_IMPORT_TIME_OPS = (  # sglang/srt/models/qwen3_5.py binds these at import on a CPU
    "fused_sigmoid_mul_cpu",
    "fused_qk_gemma_rmsnorm_cpu",
    "fused_qk_gemma_rmsnorm_with_gate_cpu",
    "fused_qkvzba_split_reshape_cat_contiguous_cpu",
)
_TORCHVISION_WHY = (
    "PyPI's torchvision is a CUDA build whose compiled ops do not load on a CPU torch; its _meta_registrations "
    "registers fakes for these two ops at import: declaring their schemas lets the Python part import (a VLM's "
    "processor needs its transforms)"
)

PATCHES: tuple[Patch, ...] = (
    *(
        _cpu_compat(f"torch.cuda.{name}", "Megatron calls it unconditionally; without CUDA it does nothing")
        for name in _CUDA_NO_OPS
    ),
    *(
        _cpu_compat(f"torch.cuda.{name}", "Megatron calls it unconditionally; without CUDA it answers 0")
        for name in _CUDA_ZEROS
    ),
    *(
        _cpu_compat(f"torch.cuda.{name}", "Megatron's RNG tracker keeps CUDA generator states: the CPU generator's")
        for name in ("get_rng_state", "set_rng_state")
    ),
    *(
        _cpu_compat(f"torch.cuda.{name}", "Megatron's schedule and DDP make streams and events: inert ones")
        for name in ("Stream", "Event", "current_stream", "default_stream")
    ),
    _cpu_compat(
        "torch.autograd._engine_run_backward",
        "backward runs inside the TorchFunctionMode's own handler, where torch disables the mode, yet Megatron's "
        "autograd functions make CUDA tensors there (activation recompute, the MoE token exchange): the engine's "
        "pass gets a mode of its own",
    ),
    _cpu_compat(
        "torch.overrides.TorchFunctionMode",
        "not replaced: cpu_compat._CudaToCpu, a mode of this class, is entered in each thread that drives Megatron "
        "and rewrites CUDA device arguments to the CPU and CPU tensor type names to CUDA ones (until uninstall())",
    ),
    *(
        _cpu_compat(f"megatron.core.tensor_parallel.random._{name}_cuda_rng_state", "the CPU generator's", MEGATRON)
        for name in ("get", "set")
    ),
    _cpu_compat(
        "megatron.core.transformer.moe.token_dispatcher.maybe_move_tensor_to_cpu",
        "the alltoall dispatcher's split sizes become numpy arrays (the form all_to_all_single takes) only when "
        "they were on the GPU: here too",
        MEGATRON,
    ),
    *(
        _cpu_compat(
            f"megatron.core.tensor_parallel.mappings._{name}_along_first_dim",
            "uneven blocks (the MoE dispatcher's under TP x EP), which NCCL runs and gloo refuses, run as even "
            "ones: padded to the largest block, and an all-reduce",
            MEGATRON,
        )
        for name in ("gather", "reduce_scatter")
    ),
    Patch(
        "megatron.core.transformer.moe.moe_utils.te_general_gemm",
        MEGATRON,
        "main",
        "miles_async/backends/megatron/model.py",
        _MEGATRON_MODEL,
        "the router's matmul tests `te_general_gemm is not None`, a name defined only when Transformer Engine "
        "imports: defined as None, the router takes its torch matmul",
        defines=True,
    ),
    Patch(
        "megatron.core.transformer.multi_latent_attention.HAVE_TE",
        MEGATRON,
        "main",
        "miles_async/backends/megatron/model.py",
        _MEGATRON_MODEL,
        "its module imports megatron-core's MagicMock stand-ins for Transformer Engine and so sets it, then fails on "
        "isinstance(linear_proj, <a MagicMock>): False",
    ),
    *(
        Patch(
            f"torch.ops.torchvision.{op}",
            TORCHVISION,
            env,
            "miles_async/inference/torchvision_ops.py",
            _ENGINE_START,
            _TORCHVISION_WHY,
            defines=True,
        )
        for env in ("sglang", "vllm")
        for op in ("nms", "qnms")
    ),
    *(
        Patch(
            f"torch.ops.sgl_kernel.{op}",
            SGLANG,
            "sglang",
            "miles_async/inference/sglang/cpu_shims/sitecustomize.py",
            _ENGINE_START,
            "sglang/srt/models/qwen3_5.py binds it at import on a CPU from the unpublished CPU sgl_kernel; without "
            "it the Qwen-VL processors fail to import: a function that raises NotImplementedError naming the op",
            defines=True,
        )
        for op in _SGL_KERNEL_IMPORT_TIME_OPS
    ),
    Patch(
        "sglang.srt.mem_cache.pool_host.common.ALLOC_MEMORY_FUNCS",
        SGLANG,
        "sglang",
        "miles_async/inference/sglang/cpu_shims/sitecustomize.py",
        _ENGINE_START,
        "its 'cpu' entry pins host buffers with cudaHostRegister, which a CPU torch refuses (the routed-experts "
        "capturer's cache): without CUDA the entry allocates the same buffer unpinned",
    ),
    Patch(
        "sgl_kernel",
        SGLANG,
        "sglang",
        "miles_async/inference/sglang/cpu_shims/sgl_kernel/__init__.py",
        _ENGINE_START,
        "the CPU build of sgl_kernel is not on PyPI: the two ops a CPU text model calls, in torch, and every other "
        "name a function that raises NotImplementedError naming it",
        defines=True,
    ),
)

BY_TARGET: dict[tuple[str, str], Patch] = {(p.target, p.env): p for p in PATCHES}


class PatchTargetMissing(RuntimeError):
    """A patch's target is gone: the installed package is not the version the patch was written against."""


def base_version(version: str) -> str:
    """``2.13.0+cpu`` -> ``2.13.0``: a local build of the same release is the same code."""
    return version.split("+", 1)[0]


def installed_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


_warned: set[str] = set()


def warn_if_stale(patch: Patch) -> None:
    """One line on stderr (once per package) when the installed version is not the one the patch was written
    against; the run goes on: the test suite is what refuses an upgrade without a review of its patches."""
    found = installed_version(patch.package)
    if (found is not None and base_version(found) == patch.version) or patch.package in _warned:
        return
    _warned.add(patch.package)
    print(
        f"miles-async: {patch.target} ({patch.by}) was written against {patch.package} {patch.version}, but "
        f"{patch.package} {found or 'is not installed'}{' is installed' if found else ''}: review the patches of "
        "miles_async/utils/upstream_patches.py before trusting this run",
        file=sys.stderr,
        flush=True,
    )


def _owner(target: str) -> tuple[Any, str]:
    """The object holding ``target``'s last name, and that name: the longest importable module prefix, then
    attributes. Raises ``PatchTargetMissing`` naming the target."""
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for name in parts[cut:-1]:
                obj = getattr(obj, name)
        except (AttributeError, RuntimeError) as exc:
            raise _missing(target, f"{name} is missing ({exc})") from exc
        return obj, parts[-1]
    raise _missing(target, f"no module of it imports ({parts[0]})")


def _missing(target: str, what: str) -> PatchTargetMissing:
    patch = next(p for p in PATCHES if p.target == target)
    return PatchTargetMissing(
        f"{target}, patched by {patch.by} (written against {patch.package} {patch.version}): {what}; "
        f"{patch.package} {installed_version(patch.package) or '(not installed)'} is installed"
    )


def check(target: str, env: str) -> Patch:
    """The registered patch of ``target`` in ``env``, about to be applied: raises ``PatchTargetMissing`` naming it
    when its target (or, for a name it defines, the target's owner) is gone; warns when the version differs."""
    patch = BY_TARGET[(target, env)]
    warn_if_stale(patch)
    if "." in target:
        owner, name = _owner(target)
        if not patch.defines and not hasattr(owner, name):
            raise _missing(target, f"{type(owner).__name__} {getattr(owner, '__name__', owner)} has no {name}")
    return patch


class Replaced:
    """Registered targets replaced together, and put back together: ``install`` checks every target before it
    replaces any, ``restore`` puts each original back."""

    def __init__(self, targets: Iterable[str], env: str = "main"):
        self.targets, self.env = tuple(targets), env
        self._saved: list[tuple[Any, str, Any]] = []

    @property
    def active(self) -> bool:
        return bool(self._saved)

    def install(self, build: Callable[[Mapping[str, Any]], Mapping[str, Any]]) -> None:
        """Replaces each target by ``build(originals)[target]`` (``build`` gets the originals by target)."""
        slots = {}
        for target in self.targets:
            check(target, self.env)
            slots[target] = _owner(target)
        originals = {t: getattr(owner, name) for t, (owner, name) in slots.items()}
        new = build(originals)
        if set(new) != set(self.targets):
            raise ValueError(f"replacements {sorted(new)} are not the targets {sorted(self.targets)}")
        for target, value in new.items():
            owner, name = slots[target]
            self._saved.append((owner, name, originals[target]))
            setattr(owner, name, value)

    def restore(self) -> None:
        while self._saved:
            owner, name, original = self._saved.pop()
            setattr(owner, name, original)


def run_shim(name: str, apply: Callable[[], None]) -> None:
    """Runs one start-up shim of an engine: a failure is written to stderr naming the shim and the exception, and
    start-up goes on (a sitecustomize that raises would skip every later shim)."""
    try:
        apply()
    except Exception as exc:  # noqa: BLE001 - reported, not swallowed: start-up goes on
        print(f"miles-async CPU shim {name!r} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)

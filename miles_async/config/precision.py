"""bf16 on a CPU that has no bf16 arithmetic: fall back to float32, and say so.

On a CPU without AVX512-BF16 or AMX (most AMD EPYCs, older Xeons, laptops) torch emulates bf16 matmuls,
about 80 times slower than float32 (a 512x576 @ 576x1536 matmul: 0.74 s against 0.009 s on an AMD EPYC
with AVX2). The quickstart's ``--bf16`` and the default ``--rollout-dtype bfloat16`` then make a 135M model
take minutes per step. Where the run has no GPU and the CPU lacks bf16, the torch trainer computes in float32
and the embedded engine serves float32: a warning names each flag that asked for bf16, and ``--keep-cpu-bf16``
keeps it (to reproduce a bf16 run's numerics). Without ``--rollout-dtype`` the engines get bfloat16, or float32
on such a CPU without a word, as nothing asked for bf16. SGLang and vLLM pick their own CPU kernels and keep
what they are given.
"""

from __future__ import annotations

import argparse
import functools
import os

from miles_async.config.declare import flag, group

GROUPS = (
    group(
        "training",
        flag(
            "--keep-cpu-bf16",
            action="store_true",
            help="keep --bf16 and --rollout-dtype bfloat16 on a CPU without bf16 arithmetic (no AVX512-BF16 or "
            "AMX), where torch emulates it about 80x slower than float32; by default such a run computes in "
            "float32 and warns",
        ),
    ),
)

_WHY = "this CPU has no bf16 arithmetic (no AVX512-BF16 or AMX), where torch's bf16 matmuls run ~80x slower"
_KEEP = "--keep-cpu-bf16 keeps bf16"


# oneDNN computes bf16 only with one of these x86 extensions (AVX-512, AMX, or AVX2's NE-convert); a CPU whose
# flags show none of them has no bf16 arithmetic, which is known without importing torch (seconds at start-up).
_BF16_CAPABLE_FLAGS = ("avx512", "amx", "avx_ne_convert")
# oneDNN's "avx512_core" ISA, from which on every oneDNN that torch has shipped (ideep's has_bf16_type_support)
# answers yes: a CPU with all four computes bf16, also known without torch. A CPU with only AVX-NE-CONVERT, or
# an ISA capped by $ONEDNN_MAX_CPU_ISA, is left to torch's own check, whose answer there has varied by release.
_AVX512_CORE_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})


def _cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str] | None:
    """The x86 flags of this CPU, or None where /proc/cpuinfo does not list them (another OS or architecture)."""
    try:
        with open(cpuinfo) as fh:
            for line in fh:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def bf16_from_flags(flags: set[str] | None, isa_capped: bool) -> bool | None:
    """oneDNN's bf16 answer where the CPU's flags settle it, else None (torch must be asked). Pure."""
    if flags is None:
        return None
    if not any(f.startswith(_BF16_CAPABLE_FLAGS) for f in flags):
        return False
    if _AVX512_CORE_FLAGS <= flags and not isa_capped:
        return True
    return None


@functools.cache
def cpu_has_bf16() -> bool:
    """Whether torch's CPU kernels run bf16 natively here (oneDNN's own check: AVX-512 core or AMX), from the
    CPU's flags where they settle it, so that the driver starts without torch on most CPUs."""
    known = bf16_from_flags(_cpu_flags(), bool(os.environ.get("ONEDNN_MAX_CPU_ISA")))
    if known is not None:
        return known
    import torch

    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def fall_back(ns: argparse.Namespace, on_gpu: bool, has_bf16: bool) -> tuple[argparse.Namespace, list[str]]:
    """The namespace the run uses (bf16 turned to float32 where it would be emulated) and a warning per flag that
    asked for bf16 and does not get it.

    Pure: the caller says whether the run has a GPU and whether this CPU computes bf16 natively.
    """
    emulated = not (on_gpu or has_bf16 or ns.keep_cpu_bf16)
    changes: dict[str, object] = {}
    warnings = []
    if ns.rollout_dtype is None:
        changes["rollout_dtype"] = "float32" if emulated and ns.rollout_backend == "embedded" else "bfloat16"
    elif emulated and ns.rollout_dtype == "bfloat16" and ns.rollout_backend == "embedded":
        changes["rollout_dtype"] = "float32"
        warnings.append(f"--rollout-dtype bfloat16: the embedded engine serves float32: {_WHY}; {_KEEP}")
    if emulated and ns.bf16 and ns.train_backend == "fsdp":
        changes["bf16"] = False
        warnings.append(f"--bf16: the torch trainer computes in float32: {_WHY}; {_KEEP}")
    return argparse.Namespace(**{**vars(ns), **changes}), warnings

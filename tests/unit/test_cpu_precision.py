"""bf16 on a CPU without bf16 arithmetic falls back to float32 with a warning naming the flag
(config/precision.py). The pure rule is tested for every case; one run of the parser checks what this machine does."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from miles_async.arguments import build_parser, parse_args
from miles_async.config import precision
from tests.flag_helpers import minimal_flags


def _ns(*words: str):
    ns, _ = build_parser().parse_known_args(list(words))
    return ns


@pytest.mark.parametrize(
    "words, on_gpu, has_bf16, bf16, rollout_dtype, flags_named",
    [
        # Nothing asked for a bf16 engine: float32 without a word.
        (("--bf16",), False, False, False, "float32", ["--bf16"]),
        (("--bf16", "--rollout-dtype", "bfloat16"), False, False, False, "float32", ["--rollout-dtype", "--bf16"]),
        (("--rollout-dtype", "bfloat16"), False, False, False, "float32", ["--rollout-dtype"]),
        ((), False, False, False, "float32", []),
        (("--bf16",), True, False, True, "bfloat16", []),  # the GPU computes bf16 itself
        (("--bf16",), False, True, True, "bfloat16", []),  # AVX512-BF16 / AMX
        (("--bf16", "--keep-cpu-bf16"), False, False, True, "bfloat16", []),
        (("--rollout-dtype", "float32"), True, False, False, "float32", []),
        # Megatron keeps its own --bf16 handling; SGLang and vLLM choose their own CPU kernels.
        (("--bf16", "--train-backend", "megatron", "--rollout-backend", "sglang"), False, False, True, "bfloat16", []),
    ],
)
def test_when_bf16_falls_back(words, on_gpu, has_bf16, bf16, rollout_dtype, flags_named):
    ns, warnings = precision.fall_back(_ns(*words), on_gpu, has_bf16)
    assert (ns.bf16, ns.rollout_dtype) == (bf16, rollout_dtype)
    assert [w.split(":")[0].split()[0] for w in warnings] == flags_named
    assert all("--keep-cpu-bf16" in w for w in warnings)


def test_the_caller_namespace_is_left_as_given():
    given = _ns("--bf16")
    precision.fall_back(given, False, False)
    assert given.bf16 is True and given.rollout_dtype is None


def test_this_machine_trains_and_serves_what_its_cpu_computes(tmp_path):
    cfg = parse_args([*minimal_flags(tmp_path), "--num-rollout", "1", "--bf16"])
    native = precision.cpu_has_bf16()
    assert cfg.train.dtype == ("bfloat16" if native else "float32")
    assert cfg.engine.dtype == ("bfloat16" if native else "float32")
    assert any(w.startswith("--bf16:") for w in cfg.warnings) is (not native)


AVX512_CORE = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}


@pytest.mark.parametrize(
    "flags, capped, expected",
    [
        ({"avx2", "fma"}, False, False),  # AVX2 only: no bf16 arithmetic, whatever the cap
        ({"avx2"}, True, False),
        ({"avx2", *AVX512_CORE}, False, True),  # Skylake-SP and later, Zen 4
        ({"avx2", *AVX512_CORE, "avx512_bf16", "amx_bf16", "amx_tile"}, False, True),  # Sapphire Rapids
        ({"avx2", *AVX512_CORE}, True, None),  # $ONEDNN_MAX_CPU_ISA may cap it below avx512_core
        ({"avx2", "avx512f"}, False, None),  # Xeon Phi: AVX-512 without the core subsets
        ({"avx2", "avx_vnni", "avx_ne_convert"}, False, None),  # client chips: torch's answer varies by release
        (None, False, None),  # no flags listed (another OS or architecture)
    ],
)
def test_the_flags_settle_bf16_only_where_onednn_answers_the_same_everywhere(flags, capped, expected):
    assert precision.bf16_from_flags(flags, capped) is expected


def test_the_cpu_flags_shortcut_agrees_with_torch():
    """Where the flags settle it the answer comes without torch; it must be torch's answer (oneDNN's check) on
    this machine, also with oneDNN capped below AVX-512 (as $ONEDNN_MAX_CPU_ISA does on a bigger CPU)."""
    import torch

    known = precision.bf16_from_flags(precision._cpu_flags(), False)
    assert precision.cpu_has_bf16() is bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if known is not None:
        assert known is bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    probe = (
        "import torch; from miles_async.config import precision; "
        "print(precision.cpu_has_bf16(), bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))"
    )
    capped = subprocess.run(
        [sys.executable, "-c", probe], env={**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"},
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout.split()  # fmt: skip
    assert capped == ["False", "False"]

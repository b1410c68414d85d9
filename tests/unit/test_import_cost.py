"""The processes that never touch a tensor start without torch: the driver (``train_async.py`` and its
``--check-config``), the inference controller and the rollout executor. Importing torch costs
each process seconds of CPU, which every run pays at start-up and a laptop's two cores feel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.scripts.helpers import ROOT

TORCH_FREE = (
    "train_async",
    "miles_async.run",
    "miles_async.ray.inference_controller",
    "miles_async.ray.rollout_executor",
)


@pytest.mark.parametrize("module", TORCH_FREE)
def test_the_processes_that_never_touch_a_tensor_import_no_torch(module):
    probe = f"import sys, {module}; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", f"importing {module} imports {proc.stdout.strip()}"


def test_parsing_and_checking_a_run_imports_no_torch(tiny_model, tiny_task, tmp_path):
    """``--check-config`` and the driver's own start: building the config needs no torch on a machine without an
    NVIDIA driver whose CPU flags settle bf16 (no bf16 arithmetic at all, or AVX-512 core: most CPUs, bf16 ones
    included). ``--bf16`` is asked for, so the precision check runs."""
    from miles_async.config import precision
    from miles_async.config.machine import NVIDIA_DRIVER_FILES
    from tests.e2e.runner import tiny_args

    if any(Path(f).exists() for f in NVIDIA_DRIVER_FILES):
        pytest.skip("GPU: an NVIDIA driver is loaded here, and torch counts the GPUs")
    if precision.bf16_from_flags(precision._cpu_flags(), bool(os.environ.get("ONEDNN_MAX_CPU_ISA"))) is None:
        pytest.skip("this CPU's flags leave bf16 to torch's own check (AVX-NE-CONVERT without AVX-512)")

    run_flags = [*tiny_args(tiny_model, tiny_task, tmp_path / "out"), "--num-rollout", "2", "--bf16", "--check-config"]
    probe = (
        "import sys, train_async; rc = train_async.cli(sys.argv[1:]); "
        "print('LOADED', sorted(m for m in ('torch', 'transformers') if m in sys.modules)); sys.exit(rc)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe, *run_flags], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "LOADED []", proc.stdout[-2000:]


def test_the_executor_loads_the_tokenizer_autotokenizer_gives_without_torch(tiny_model):
    """The driver resolves the tokenizer's class once (``tokenizer_class_path``) and the executor loads that class
    (``load_tokenizer``): the same tokens, chat template and special tokens as ``AutoTokenizer``, in a process that
    never imports torch (``AutoTokenizer`` itself imports it: about 3 s of CPU per run)."""
    from transformers import AutoTokenizer

    from miles_async.utils.tokenizer import tokenizer_class_path

    messages = [{"role": "user", "content": "What is 12 + 30? Answer with the number."}]
    probe = (
        "import json, sys\n"
        "from miles_async.utils.tokenizer import load_tokenizer\n"
        "tok = load_tokenizer(sys.argv[1], sys.argv[2])\n"
        "ids = tok.apply_chat_template(json.loads(sys.argv[3]), tokenize=True, add_generation_prompt=True)\n"
        "ids = ids['input_ids'] if isinstance(ids, dict) else ids\n"
        "print(json.dumps([type(tok).__name__, list(ids), tok.eos_token_id, tok.pad_token_id, len(tok),\n"
        "                  sorted(m for m in ('torch', 'transformers.configuration_utils') if m in sys.modules)]))\n"
    )
    cls = tokenizer_class_path(str(tiny_model))
    proc = subprocess.run(
        [sys.executable, "-c", probe, str(tiny_model), cls, json.dumps(messages)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    name, ids, eos, pad, size, loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    auto = AutoTokenizer.from_pretrained(str(tiny_model))
    want = auto.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    want = want["input_ids"] if isinstance(want, dict) else want
    assert (name, ids, eos, pad, size) == (
        type(auto).__name__,
        list(want),
        auto.eos_token_id,
        auto.pad_token_id,
        len(auto),
    )
    assert loaded == [], f"loading the tokenizer imported {loaded}"

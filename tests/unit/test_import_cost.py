"""The processes that never touch a tensor start without torch: the driver (``train_async.py`` and its
``--check-config``), the inference controller and the rollout executor. Importing torch costs
each process seconds of CPU, which every run pays at start-up and a laptop's two cores feel."""

from __future__ import annotations

import json
import os
import shutil
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


def test_the_executor_loads_the_tokenizer_autotokenizer_gives_and_after_the_first_time_without_torch(
    tiny_model, tmp_path
):
    """``load_tokenizer`` (the executor's): the same tokens, chat template and special tokens as ``AutoTokenizer``.
    The first load goes through AutoTokenizer (which imports torch) and remembers its class under the cache
    folder; a later one, in a new process, takes that class and imports no torch (about 3 s of CPU per run). A
    folder whose tokenizer config differs is not served from the remembered class."""
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "What is 12 + 30? Answer with the number."}]
    probe = (
        "import json, sys\n"
        "from miles_async.utils.tokenizer import load_tokenizer\n"
        "tok = load_tokenizer(sys.argv[1])\n"
        "ids = tok.apply_chat_template(json.loads(sys.argv[2]), tokenize=True, add_generation_prompt=True)\n"
        "ids = ids['input_ids'] if isinstance(ids, dict) else ids\n"
        "print(json.dumps([type(tok).__name__, list(ids), tok.eos_token_id, tok.pad_token_id, len(tok),\n"
        "                  sorted(m for m in ('torch', 'transformers.configuration_utils') if m in sys.modules)]))\n"
    )
    environment = {**os.environ, "MILES_ASYNC_CACHE": str(tmp_path / "cache")}

    def load(folder: Path) -> tuple[list, list]:
        proc = subprocess.run(
            [sys.executable, "-c", probe, str(folder), json.dumps(messages)],
            cwd=ROOT,
            env=environment,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        *got, loaded = json.loads(proc.stdout.strip().splitlines()[-1])
        return got, loaded

    auto = AutoTokenizer.from_pretrained(str(tiny_model))
    want = auto.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    want = want["input_ids"] if isinstance(want, dict) else want
    want = [type(auto).__name__, list(want), auto.eos_token_id, auto.pad_token_id, len(auto)]
    first, loaded_first = load(tiny_model)
    assert first == want and "torch" in loaded_first
    again, loaded_again = load(tiny_model)
    assert again == want
    assert loaded_again == [], f"loading the tokenizer again imported {loaded_again}"

    other = tmp_path / "other"
    shutil.copytree(tiny_model, other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 77}))
    _, loaded_other = load(other)
    assert "torch" in loaded_other, "a folder with another tokenizer config was served from the remembered class"


def test_the_driver_makes_its_training_workers_without_importing_them(tiny_model, tiny_task, tmp_path):
    """``TrainGroup`` names each worker's class (``WorkerHost``): making the Ray actor class, as the driver does for
    the policy and the critic of each backend, imports none of torch, transformers or the backends."""
    from tests.e2e.runner import tiny_args

    flags = [*tiny_args(tiny_model, tiny_task, tmp_path / "out"), "--num-rollout", "2", "--advantage-estimator", "ppo"]
    probe = (
        "import json, sys, ray\n"
        "from miles_async.arguments import parse_args\n"
        "from miles_async.ray.train_group import worker_class_path\n"
        "from miles_async.ray.worker_host import host_class\n"
        "cfg = parse_args(sys.argv[1:])\n"
        "hosts = [host_class(worker_class_path(c)) for c in (cfg.train, cfg.critic)]\n"
        "made = [ray.remote(h) and h.__name__ for h in hosts]\n"
        "print(json.dumps([made, sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules)]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe, *flags], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    made, loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert loaded == [], f"making the workers' actor classes imported {loaded}"
    assert made == ["FSDPTrainActor", "FSDPCritic"]

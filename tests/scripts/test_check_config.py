"""Every launcher under scripts/ runs its exact command through ``train_async.py --check-config``: the published
config.json of its model (tests/scripts/model_configs, no weights) against its model flags, small real JSONL data
files at the paths and with the keys the command names, and every other check that needs no worker. Nothing
starts (no Ray, no output folder); the command exits 0 and prints the resolved configuration and the worker plan.

The Qwen3 launcher's command is also run with each other scripts/models/*.sh MODEL_ARGS in place of Qwen3-4B's,
against that model's published config.json (the tiny Qwen3's: against the tiny random model, through
MODEL_ARGS_FILE), and with a checkpoint of another model, which fails naming the flags.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from miles_async.config.declare import module_installed
from miles_async.config.precision import cpu_has_bf16
from tests.scripts.helpers import ROOT, STUBS
from tests.scripts.test_launchers import _env, _run, _words
from tests.unit.test_model_flags import _script_model_args

CONFIGS = ROOT / "tests" / "scripts" / "model_configs"
QWEN3 = "scripts/run-qwen3-4B-async.sh"
CPU = "scripts/run-smollm2-cpu-async.sh"
QWEN3_MOE = "scripts/run-qwen3-30B-A3B-async.sh"
QWEN25_VL = "scripts/run-qwen2.5-VL-7B-async.sh"
QWEN3_PLAN = [
    "actor: 4 workers x 1 GPU = 4 GPUs; megatron TP 2 x PP 1 x CP 1, data parallel 2; placement group of 4 bundles "
    "x 1 GPU (PACK)",
    "rollout: 2 engines x 2 GPUs = 4 GPUs; sglang engines, weights by distributed; placement group of 2 bundles x "
    "2 GPUs (PACK)",
]


def _launcher_env(tmp_path: Path, script: str, model: str) -> dict:
    paths = {"OUT": str(tmp_path / "out"), "PYTHON": sys.executable}
    if script in (QWEN3, QWEN3_MOE, QWEN25_VL):
        paths.update(
            HF_CHECKPOINT=str(CONFIGS / model), DATA_DIR=str(tmp_path / "data"), SAVE_DIR=str(tmp_path / "ckpt")
        )
    else:
        paths.update(MODEL=str(CONFIGS / model), DATA=str(tmp_path / "data"))
    return _env(paths)


def _value(words: list[str], name: str) -> str:
    return words[len(words) - 1 - words[::-1].index(name) + 1]  # the last occurrence wins, as in argparse


# A 1x1 PNG: what an image column of a launcher's data holds (a data: URI is one of the forms it takes).
PNG = (
    "data:image/png;base64,"
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
)


def _write_data(words: list[str], prompts: int = 40) -> None:
    """A small real prompt file at each path the command names, with its --input-key and --label-key (and an image
    for each record under --multimodal-keys' column), JSONL or Parquet as the path says."""
    key, label = _value(words, "--input-key"), _value(words, "--label-key")
    image = json.loads(_value(words, "--multimodal-keys"))["image"] if "--multimodal-keys" in words else None
    if "--rollout-batch-size" in words:  # at least a rollout's worth
        prompts = max(prompts, int(_value(words, "--rollout-batch-size")))
    i = words.index("--eval-prompt-data") + 1 if "--eval-prompt-data" in words else len(words)
    evals = []
    while i < len(words) and not words[i].startswith("--"):
        evals.append(words[i])
        i += 1
    for path in [_value(words, "--prompt-data"), *(evals[1::2] if len(evals) > 1 else evals)]:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        records = [
            {key: f"What is {n} + {n}?", label: str(2 * n), **({image: [PNG]} if image else {})} for n in range(prompts)
        ]
        if path.endswith(".parquet"):
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(records), path)
        else:
            Path(path).write_text("".join(json.dumps(r) + "\n" for r in records))


def _check_config(script: str, env: dict, *extra: str) -> subprocess.CompletedProcess:
    """The launcher's own command (learnt from its --dry-run, to write the data it names), run with
    --check-config."""
    dry = _run(script, env, ["--dry-run", *extra])
    assert dry.returncode == 0, dry.stderr
    _write_data(_words(dry.stdout))
    return _run(script, env, [*extra, "--check-config"], timeout=240)


def _plan(stdout: str) -> list[str]:
    lines = stdout.split("# worker plan\n", 1)[1].split("\n\n", 1)[0].splitlines()
    return [line.strip() for line in lines if not line.strip().startswith("GPUs")]


def test_qwen3_launcher_passes_check_config_with_the_published_qwen3_4b(tmp_path):
    env = _launcher_env(tmp_path, QWEN3, "Qwen3-4B")
    proc = _check_config(QWEN3, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.rstrip().endswith("check-config: OK, the run would start")
    assert _plan(proc.stdout) == QWEN3_PLAN
    assert "backend: megatron" in proc.stdout and "tensor_model_parallel_size: 2" in proc.stdout
    assert not (tmp_path / "out").exists() and not (tmp_path / "ckpt").exists()  # nothing ran


def test_cpu_launcher_passes_check_config(tmp_path):
    proc = _check_config(CPU, _launcher_env(tmp_path, CPU, "SmolLM2-135M"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _plan(proc.stdout) == [
        "actor: 1 worker x 1 GPU = 1 GPU; fsdp (torch DDP), data parallel 1; placement group of 1 bundle x 1 GPU "
        "(PACK)",
        "rollout: 1 engine x 1 GPU = 1 GPU; embedded engines, weights by tensor; placement group of 1 bundle x 1 GPU "
        "(PACK)",
    ]
    # The launcher's --bf16 is the one warning, on a CPU that would emulate bf16 (config/precision.py).
    bf16_warning = "# warnings (1)\n  - --bf16: the torch trainer computes in float32"
    assert ("# warnings (0)" if cpu_has_bf16() else bf16_warning) in proc.stdout
    assert not (tmp_path / "out").exists()


def test_the_slurm_scripts_command_passes_check_config(tmp_path):
    """The command train-async.sbatch runs on the head node (the Qwen3 launcher with --ray-address, --save and the
    save sentinel), taken from its dry run."""
    sbatch_env = _env(
        {
            "SLURM_JOB_NODELIST": "gpu1",
            "SAVE_DIR": str(tmp_path / "ckpt"),
            "GPUS_PER_NODE": "8",
            "HEAD_NODE_IP": "10.1.2.3",
            "PATH": f"{STUBS}{os.pathsep}{os.environ.get('PATH', '')}",
        }
    )
    dry = _run("scripts/slurm/train-async.sbatch", sbatch_env, ["--dry-run"])
    assert dry.returncode == 0, dry.stderr
    command = _words(dry.stdout.split("# the run", 1)[1].split("\n", 1)[1])
    assert command[:2] == ["bash", str(ROOT / QWEN3)] and "--ray-address" in command
    proc = _check_config(QWEN3, _launcher_env(tmp_path, QWEN3, "Qwen3-4B"), *command[2:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ray_address: 10.1.2.3:6379" in proc.stdout and f"save: {tmp_path / 'ckpt'}" in proc.stdout
    assert _plan(proc.stdout) == QWEN3_PLAN


@pytest.mark.parametrize("model, args_file", [("Qwen2.5-7B", "qwen2.5-7B"), ("Llama-3.1-8B", "llama3.1-8B")])
def test_each_models_args_pass_check_config_against_its_published_config(tmp_path, model, args_file):
    """The Qwen3 launcher's exact command with scripts/models/<model>.sh's MODEL_ARGS in place of Qwen3-4B's."""
    env = _launcher_env(tmp_path, QWEN3, model)
    dry = _run(QWEN3, env, ["--dry-run"])
    words = _words(dry.stdout)
    _write_data(words)
    start, end = words.index(str(ROOT / "train_async.py")) + 1, words.index("--hf-checkpoint")
    assert words[start:end] == _script_model_args("qwen3-4B")
    command = words[:start] + _script_model_args(args_file) + words[end:] + ["--check-config"]
    proc = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _plan(proc.stdout) == QWEN3_PLAN


def test_the_tiny_qwen3_args_pass_check_config_against_the_tiny_qwen3(tmp_path):
    """The Qwen3 launcher with MODEL_ARGS_FILE=scripts/models/qwen3-tiny.sh (a CPU rehearsal's model) against the
    tiny random Qwen3 of miles_async/assets/tiny_model.py."""
    from miles_async.assets.tiny_model import make_tiny_model

    env = _launcher_env(tmp_path, QWEN3, "Qwen3-4B")
    env.update(
        MODEL_ARGS_FILE=str(ROOT / "scripts" / "models" / "qwen3-tiny.sh"),
        HF_CHECKPOINT=str(make_tiny_model(tmp_path / "tiny", arch="qwen3")),
    )
    words = _words(_run(QWEN3, env, ["--dry-run"]).stdout)
    start, end = words.index(str(ROOT / "train_async.py")) + 1, words.index("--hf-checkpoint")
    assert words[start:end] == _script_model_args("qwen3-tiny")
    proc = _check_config(QWEN3, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _plan(proc.stdout) == QWEN3_PLAN


def test_a_launcher_pointed_at_another_model_exits_2_naming_the_flags(tmp_path):
    proc = _check_config(QWEN3, _launcher_env(tmp_path, QWEN3, "Qwen2.5-7B"))
    assert proc.returncode == 2
    assert "error: the model flags do not describe --hf-checkpoint's model:" in proc.stderr
    assert (
        f"--num-layers 36 does not match {CONFIGS / 'Qwen2.5-7B'}/config.json: num_hidden_layers 28 (that is "
        f"--num-layers 28)"
    ) in proc.stderr
    assert "# worker plan" not in proc.stdout


def test_data_without_the_launchers_keys_exits_2_naming_the_file(tmp_path):
    env = _launcher_env(tmp_path, QWEN3, "Qwen3-4B")
    proc = _check_config(QWEN3, env, "--input-key", "question")
    assert proc.returncode == 0, proc.stderr[-3000:]  # the data was written with the key the command names
    data = tmp_path / "data" / "dapo-math-17k" / "dapo-math-17k.jsonl"
    data.write_text(json.dumps({"prompt": "1 + 1?", "label": "2"}) + "\n")
    proc = _run(QWEN3, env, ["--input-key", "question", "--check-config"], timeout=240)
    assert proc.returncode == 2 and str(data) in proc.stderr and "question" in proc.stderr, proc.stderr[-2000:]


# Lines of Miles' published launchers whose flags take several values, as written there: SGLANG_ARGS of
# scripts/run-qwen3-30B-A3B.sh and run-qwen3-235B-A22B.sh, ROLLOUT_ARGS of scripts/run-glm4.5-355B-A32B.sh, and the
# --offload-rollout-level its launchers keep commented out. bash expands them, as in the launchers.
MILES_LIST_VALUED = """
   --sglang-cuda-graph-bs 1 2 4 8 $(seq 16 8 256)
   --rollout-stop-token-ids 151329 151336 151338
   --offload-rollout-level kv_cache weight
"""


def test_miles_list_valued_flags_pass_check_config_as_lists(tmp_path):
    proc = _check_config(QWEN3, _launcher_env(tmp_path, QWEN3, "Qwen3-4B"), *_words(MILES_LIST_VALUED))
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = yaml.safe_load(proc.stdout.split("# resolved configuration\n", 1)[1].split("\n\n# worker plan", 1)[0])
    sizes = [str(bs) for bs in [1, 2, 4, 8, *range(16, 257, 8)]]
    assert cfg["engine"]["sglang_args"] == ["--mem-fraction-static", "0.8", "--cuda-graph-bs-decode", *sizes]
    assert cfg["rollout"]["sampling"]["stop_token_ids"] == [151329, 151336, 151338]
    assert cfg["eval"]["sampling"]["stop_token_ids"] == [151329, 151336, 151338]
    assert "  - --offload-rollout-level kv_cache weight is ignored: Miles' colocated-mode memory" in proc.stdout


def test_the_qwen3_30b_a3b_launcher_passes_check_config_with_the_published_config(tmp_path):
    """Miles' Qwen3-30B-A3B launcher moved onto train_async.py, against that model's published config.json:
    128 experts over EP 8 beside TP 4, and one SGLang engine of 8 GPUs apart from the trainer's 8."""
    env = _launcher_env(tmp_path, QWEN3_MOE, "Qwen3-30B-A3B")
    proc = _check_config(QWEN3_MOE, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.rstrip().endswith("check-config: OK, the run would start")
    assert _plan(proc.stdout) == [
        "actor: 8 workers x 1 GPU = 8 GPUs; megatron TP 4 x PP 1 x CP 1, data parallel 2; experts EP 8; placement "
        "group of 8 bundles x 1 GPU (PACK)",
        "rollout: 1 engine x 8 GPUs = 8 GPUs; sglang engines, weights by distributed; placement group of 1 bundle "
        "x 8 GPUs (PACK)",
    ]
    cfg = yaml.safe_load(proc.stdout.split("# resolved configuration\n", 1)[1].split("\n\n# worker plan", 1)[0])
    assert cfg["rollout"]["data"]["chat_template_kwargs"] == {"enable_thinking": False}
    assert cfg["train"]["megatron"]["moe"]["token_dispatcher_type"] == "alltoall"
    assert not (tmp_path / "out").exists() and not (tmp_path / "ckpt").exists()  # nothing ran


def test_the_qwen25_vl_launcher_passes_check_config_with_the_published_config(tmp_path):
    """Miles' VLM launcher (geo3k, fsdp backend) moved onto train_async.py for Qwen2.5-VL-7B-Instruct, against that
    model's published config.json: image prompts through --multimodal-keys from Parquet, the torch backend on 4 GPUs
    beside 4 SGLang engines of 1 GPU."""
    env = _launcher_env(tmp_path, QWEN25_VL, "Qwen2.5-VL-7B-Instruct")
    proc = _check_config(QWEN25_VL, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.rstrip().endswith("check-config: OK, the run would start")
    assert _plan(proc.stdout) == [
        "actor: 4 workers x 1 GPU = 4 GPUs; fsdp (torch DDP), data parallel 4; placement group of 4 bundles x 1 GPU "
        "(PACK)",
        "rollout: 4 engines x 1 GPU = 4 GPUs; sglang engines, weights by distributed; placement group of 4 bundles x "
        "1 GPU (PACK)",
    ]
    cfg = yaml.safe_load(proc.stdout.split("# resolved configuration\n", 1)[1].split("\n\n# worker plan", 1)[0])
    assert cfg["rollout"]["data"]["image_key"] == "images"
    assert not (tmp_path / "out").exists() and not (tmp_path / "ckpt").exists()  # nothing ran


def test_the_tiny_qwen3_moe_args_pass_check_config_against_the_tiny_qwen3_moe(tmp_path):
    """The 30B-A3B launcher with MODEL_ARGS_FILE=scripts/models/qwen3-moe-tiny.sh against the tiny random
    Qwen3-MoE of miles_async/assets/tiny_model.py, in the layout a CPU rehearsal gives it: TP 2 x EP 2 on 4
    training workers (its 4 experts cannot take EP 8)."""
    from miles_async.assets.tiny_model import make_tiny_model

    env = _launcher_env(tmp_path, QWEN3_MOE, "Qwen3-30B-A3B")
    env.update(
        MODEL_ARGS_FILE=str(ROOT / "scripts" / "models" / "qwen3-moe-tiny.sh"),
        HF_CHECKPOINT=str(make_tiny_model(tmp_path / "tiny", arch="qwen3_moe", tied=False)),
    )
    layout = [
        "--actor-num-gpus-per-node",
        "4",
        "--tensor-model-parallel-size",
        "2",
        "--expert-model-parallel-size",
        "2",
    ]
    words = _words(_run(QWEN3_MOE, env, ["--dry-run", *layout]).stdout)
    start, end = words.index(str(ROOT / "train_async.py")) + 1, words.index("--hf-checkpoint")
    assert words[start:end] == _script_model_args("qwen3-moe-tiny")
    proc = _check_config(QWEN3_MOE, env, *layout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _plan(proc.stdout)[0] == (
        "actor: 4 workers x 1 GPU = 4 GPUs; megatron TP 2 x PP 1 x CP 1, data parallel 2; experts EP 2; placement "
        "group of 4 bundles x 1 GPU (PACK)"
    )
    # The published launcher's EP 8 does not fit 4 experts, and the refusal names the flag.
    proc = _run(QWEN3_MOE, env, ["--tensor-model-parallel-size", "2", "--check-config"], timeout=240)
    assert proc.returncode == 2 and "--expert-model-parallel-size 8" in proc.stderr, proc.stderr[-2000:]


def test_the_moe_launcher_with_deepseek_v3_args_passes_check_config_against_the_published_config(tmp_path):
    """The Qwen3-30B-A3B launcher's exact command with MODEL_ARGS_FILE=scripts/models/deepseek-v3.sh (Miles'
    DeepSeek-V3 MODEL_ARGS: multi-latent attention, YaRN, 256 experts in 8 groups) against DeepSeek-R1's published
    config.json, whose architecture is DeepSeek-V3's, at the launcher's TP 4 x EP 8."""
    env = _launcher_env(tmp_path, QWEN3_MOE, "DeepSeek-R1")
    env["MODEL_ARGS_FILE"] = str(ROOT / "scripts" / "models" / "deepseek-v3.sh")
    words = _words(_run(QWEN3_MOE, env, ["--dry-run"]).stdout)
    start, end = words.index(str(ROOT / "train_async.py")) + 1, words.index("--hf-checkpoint")
    assert words[start:end] == _script_model_args("deepseek-v3")
    proc = _check_config(QWEN3_MOE, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _plan(proc.stdout)[0] == (
        "actor: 8 workers x 1 GPU = 8 GPUs; megatron TP 4 x PP 1 x CP 1, data parallel 2; experts EP 8; placement "
        "group of 8 bundles x 1 GPU (PACK)"
    )
    # Without Transformer Engine (here) TP with multi-latent attention would stop a run; the GPU node has it.
    te = "--tensor-model-parallel-size 4 with multi-latent attention (DeepSeek-V3) needs Transformer Engine"
    assert (te in proc.stdout) != module_installed("transformer_engine")

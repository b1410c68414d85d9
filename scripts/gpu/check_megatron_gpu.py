"""One-GPU check of the Megatron backend's GPU path: logits match transformers, one training step.

On a CUDA machine nothing of ``cpu_compat`` runs (it returns at once when CUDA is
present), so this exercises the real GPU path: NCCL, CUDA RNG tracker, Transformer
Engine's layer spec when ``transformer_engine`` imports (else the local spec).

Checks, each printed as one JSON line, then ``OK`` (exit 0) or ``FAILED`` (exit 1):

1. logits: for each model (default: a tiny Llama, a tiny Qwen3 and a tiny Qwen3-MoE built here,
   plus every ``--model``), the converted GPTModel's fp32 logits match transformers' on the GPU,
   and HF -> Megatron -> HF is exact; with Transformer Engine the MoE model runs its grouped GEMM
   and fused permutation (--moe-grouped-gemm, --moe-permute-fusion: "moe_grouped_gemm" says so);
2. train_step: ``MegatronTrainActor`` (Megatron DDP, optimizer, schedule) takes the optimizer
   steps of one rollout of a GRPO batch; the loss is finite and the weights move;
3. optimizer_offload: the same with Miles' --optimizer-cpu-offload --overlap-cpu-optimizer-d2h-h2d
   --use-precision-aware-optimizer: megatron-core's HybridDeviceOptimizer holds the optimizer (its
   state on the CPU), and the step moves the weights (on the CPU, where they mean nothing, the step
   with them trains as without).

Run it with ``bash scripts/gpu/check_megatron_gpu.sh`` (see there). ``--allow-cpu`` runs the
same code on the CPU through the shim; the test suite does that so this file stays working.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from miles_async.rollout.batch import RolloutBatch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _batch() -> RolloutBatch:
    from miles_async.rollout.batch import to_train_batch
    from miles_async.rollout.sample import Sample

    rng = random.Random(0)
    groups = []
    for g in range(4):
        prompt = [rng.randrange(5, 40) for _ in range(rng.randrange(3, 7))]
        groups.append(
            [
                Sample(
                    uid=str(g),
                    group_index=g,
                    index=i,
                    prompt="",
                    prompt_tokens=prompt,
                    response_tokens=[rng.randrange(5, 40) for _ in range(rng.randrange(1, 6))],
                    reward=float(rng.random() < 0.5),
                )
                for i in range(4)
            ]
        )
    for s in (s for g in groups for s in g):  # an engine's log-probs: --use-tis needs one per trained token
        s.rollout_logprobs = [-3.0] * s.response_length
    return to_train_batch(groups)


def check_logits(path: str, device: torch.device) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    from miles_async.backends.megatron.convert import HFReader, export_hf, load_hf
    from miles_async.backends.megatron.model import ArchSpec, ParallelSizes, build_gpt_model, have_transformer_engine

    arch = ArchSpec.from_hf(AutoConfig.from_pretrained(path))
    kernels = have_transformer_engine()  # what --moe-grouped-gemm --moe-permute-fusion turn on
    knobs = {"moe_grouped_gemm": kernels, "moe_permute_fusion": kernels}
    model = build_gpt_model(arch, ParallelSizes(), knobs=knobs).to(device).eval()
    get = HFReader(path)
    load_hf(model, get, arch, tp=1, rank=0)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    torch.manual_seed(0)
    ids = torch.randint(3, arch.vocab_size, (2, 33), device=device)
    with torch.no_grad():
        ours = model(ids, torch.arange(33, device=device).expand(2, -1), None)[..., : arch.vocab_size].float()
        ref = hf(input_ids=ids).logits.float()
    diff, scale = float((ours - ref).abs().max()), float(ref.abs().max())
    exact = all(torch.equal(t.cpu(), get(k)) for k, t in export_hf(model, arch))
    return {
        "check": "logits",
        "model": path,
        "use_te": model.use_te,
        "moe_grouped_gemm": arch.moe is not None and model.config.moe_grouped_gemm,
        "max_abs_diff": diff,
        "logit_scale": scale,
        "round_trip_exact": exact,
        "ok": diff <= 1e-3 * max(1.0, scale) and exact,
    }


def check_train_step(model: str, data: str, out: str, port: int) -> dict:
    return _train_step(model, data, out, port)[0]


def _train_step(model: str, data: str, out: str, port: int, extra: tuple[str, ...] = ()):
    """One rollout's optimizer steps of an actor given ``extra`` flags: its record, and the actor."""
    from miles_async.arguments import parse_args
    from miles_async.backends.megatron.actor import MegatronTrainActor

    cfg = parse_args(
        [
            "--use-tis",
            "--hf-checkpoint",
            model,
            "--prompt-data",
            data,
            "--rollout-batch-size",
            "4",
            "--n-samples-per-prompt",
            "4",
            "--num-rollout",
            "1",
            "--rm-type",
            "integer",
            "--lr",
            "1e-2",
            "--global-batch-size",
            "8",
            "--output-dir",
            out,
            "--train-backend",
            "megatron",
            *extra,
        ]
    ).train
    actor = MegatronTrainActor(cfg, 0, 1, total_optimizer_steps=2)
    actor.init_process_group("127.0.0.1", port)
    before = actor.hf_state()
    t0 = time.time()
    metrics = actor.train(0, _batch())
    seconds = time.time() - t0
    after = actor.hf_state()
    moved = any(not torch.equal(before[k], after[k]) for k in before)
    finite = all(math.isfinite(metrics[k]) for k in ("train/loss", "train/grad_norm"))
    record = {
        "check": "train_step",
        "device": str(actor.device),
        "loss": metrics["train/loss"],
        "grad_norm": metrics["train/grad_norm"],
        "seconds": seconds,
        "weights_moved": moved,
        "ok": moved and finite and actor.device.type == ("cuda" if torch.cuda.is_available() else "cpu"),
    }
    return record, actor


OFFLOAD = ("--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer")


def check_optimizer_offload(model: str, data: str, out: str, port: int) -> dict:
    """Miles' optimizer-memory flags take effect on a GPU: the optimizer inside Megatron's distributed optimizer is
    megatron-core's HybridDeviceOptimizer, whose state lives on the CPU, and a step still trains. On the CPU (where
    they mean nothing, and the actor leaves them off) the step with them still trains."""
    step, actor = _train_step(model, data, out, port, OFFLOAD)
    inner = getattr(actor.optimizer, "optimizer", None)
    kind = type(inner).__name__
    state_devices = sorted(
        {str(t.device) for st in getattr(inner, "state", {}).values() for t in st.values() if torch.is_tensor(t)}
    )
    offloaded = kind == "HybridDeviceOptimizer" and state_devices == ["cpu"]
    return {
        **step,
        "check": "optimizer_offload",
        "optimizer": kind,
        "state_devices": state_devices,
        "ok": step["ok"] and (offloaded if torch.cuda.is_available() else kind != "HybridDeviceOptimizer"),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", default=[], help="extra HF folder(s) to compare logits on")
    p.add_argument("--allow-cpu", action="store_true", help="run on the CPU through the shim (for the test suite)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() and not args.allow_cpu:
        print(
            "check_megatron_gpu: no CUDA device visible (torch.cuda.is_available() is false); this checks the "
            "GPU path - run it on a GPU machine, or pass --allow-cpu to run the same code on the CPU",
            file=sys.stderr,
        )
        return 2
    from miles_async.assets.tiny_model import make_tiny_model, make_tiny_task_dataset
    from miles_async.backends.megatron.model import ParallelSizes, init_parallel
    from miles_async.utils.ports import hosted_store

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        # fp32 means fp32: TF32 matmuls would put the logits ~1e-3 apart for no reason of ours.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    tmp = Path(tempfile.mkdtemp(prefix="check_megatron_gpu_"))
    llama = str(make_tiny_model(tmp / "llama", arch="llama"))
    qwen3 = str(make_tiny_model(tmp / "qwen3", arch="qwen3"))
    qwen3_moe = str(make_tiny_model(tmp / "qwen3_moe", seed=2, arch="qwen3_moe"))
    train, _ = make_tiny_task_dataset(tmp / "task", n_train=16, n_eval=4)
    store = hosted_store("127.0.0.1", timeout=300)  # the group's rendezvous, on a port no one can take first
    init_parallel(0, 1, ParallelSizes(), "127.0.0.1", store.port, seed=0, hosted=store)
    results = [check_logits(m, device) for m in (llama, qwen3, qwen3_moe, *args.model)]
    results.append(check_train_step(llama, str(train), str(tmp / "out"), store.port))
    results.append(check_optimizer_offload(llama, str(train), str(tmp / "out_offload"), store.port))
    shutil.rmtree(tmp, ignore_errors=True)
    for r in results:
        print(json.dumps(r), flush=True)
    ok = all(r["ok"] for r in results)
    print("OK" if ok else "FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

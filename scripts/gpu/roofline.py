"""The roofline of ``benchmarks/roofline.py`` on one GPU, in the units verl and slime report: model-FLOPs utilisation
(MFU: achieved FLOP/s over the measured bf16 matmul peak) and tokens/s per GPU.

Same accounting (``benchmarks/roofline_core.py``) and the same quickstart-shaped step (SmolLM2-135M, 8 prompts x 8
samples): the GPU's bf16 matmul peak (a large square and the step's shapes) and triad bandwidth, then
``FSDPTrainActor``'s phases on the GPU in bf16: old-log-prob and reference forwards, training forward and backward,
and the optimizer step. The embedded engine is CPU-only, so prefill and decode are not measured here (SGLang and vLLM
report their own throughput). A few minutes on one GPU; without CUDA it says so on stderr and exits 2 (it measured
nothing), as the other GPU checks do.

    PYTHONPATH=. HF_HUB_OFFLINE=1 python scripts/gpu/roofline.py [--model HF_FOLDER] [--json OUT.json]

``--allow-cpu`` runs the same code on the CPU in float32 (the test suite does, with a tiny model, so this file stays
working).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import roofline  # noqa: E402
from benchmarks import roofline_core as rc  # noqa: E402

NO_GPU = 2  # exit status without a GPU, as the other scripts/gpu checks
GPU = dataclasses.replace(roofline.FULL, reps=5, square=8192, triad_elements=1 << 28)


def measure(model: Path, data: Path, s: roofline.Settings, on_gpu: bool) -> dict:
    from transformers import AutoConfig

    device, sync = ("cuda", rc.cuda_sync) if on_gpu else ("cpu", rc.no_sync)
    dtype = "bfloat16" if on_gpu else "float32"
    limits = roofline.measure_limits(AutoConfig.from_pretrained(model), s, bf16_native=on_gpu, device=device, sync=sync)
    actor = roofline._actor(model, data, s, dtype, steps=s.reps + 2)
    batch = roofline.step_batch(model, s)
    timed = [rc.actor_phases(actor, batch, rollout, "time", sync) for rollout in range(s.reps + 1)][1:]
    counted = rc.actor_phases(actor, batch, s.reps + 1, "flops", sync)
    rows = roofline.phase_rows(rc.account(timed, counted), limits)
    for r in rows:
        r["tokens_per_s"] = r["tokens"] / r["seconds"]
        r["mfu"] = r["flops"] / r["seconds"] / limits["peaks"][dtype]
    step = {r["phase"]: r for r in rows}
    train = step["train fwd+bwd"]
    step_seconds = train["seconds"] + step["optimizer"]["seconds"]
    return {
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "dtype": dtype,
        "peak_flops_per_s": limits["peaks"][dtype],
        "bandwidth_bytes_per_s": limits["bandwidth"],
        "train_mfu": train["flops"] / step_seconds / limits["peaks"][dtype],
        "train_tokens_per_s_per_gpu": train["tokens"] / step_seconds,
        "limits": limits,
        "phases": rows,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="HF folder (default: SmolLM2-135M, built on first use)")
    ap.add_argument("--json", type=Path, default=None, help="also write the result here")
    ap.add_argument("--allow-cpu", action="store_true", help="run on the CPU when no GPU is visible (a check)")
    ap.add_argument("--quick", action="store_true", help="the benchmark's --quick shape (for a check)")
    a = ap.parse_args(argv)
    on_gpu = torch.cuda.is_available()
    if not on_gpu and not a.allow_cpu:
        print(
            f"roofline: needs a CUDA GPU (torch {torch.__version__} sees none); nothing measured (--allow-cpu runs "
            "the same account on the CPU)",
            file=sys.stderr,
        )
        return NO_GPU
    s = roofline.QUICK if a.quick else GPU if on_gpu else roofline.FULL
    with tempfile.TemporaryDirectory() as tmp:
        from miles_async.assets.tiny_model import make_tiny_task_dataset

        data, _ = make_tiny_task_dataset(Path(tmp) / "data", n_train=16, n_eval=4)
        model = a.model
        if model is None:
            from miles_async.assets.smollm2 import prepare_smollm2

            model = prepare_smollm2()
        result = measure(model, data, s, on_gpu)
    for r in result["phases"]:
        what = f"MFU {r['mfu']:.1%}" if r["flops"] else f"{r['fraction']:.1%} of the bandwidth"
        print(f"{r['phase']:>18}: {r['seconds'] * 1e3:8.1f} ms, {r['tokens_per_s']:10.0f} tokens/s, {what}")
    print(
        f"training step (fwd+bwd+optimizer) on {result['device']}, {result['dtype']}: MFU {result['train_mfu']:.1%}, "
        f"{result['train_tokens_per_s_per_gpu']:.0f} tokens/s per GPU "
        f"(matmul peak {result['peak_flops_per_s'] / 1e12:.1f} TFLOP/s measured)"
    )
    if a.json is not None:
        a.json.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""MoE layouts of the Megatron backend: bytes of training state per rank, measured over gloo on a tiny Qwen3-MoE and
counted from its config (``benchmarks/moe_memory_core.py``), then projected to Qwen3-30B-A3B on 8 and 16 GPUs.

Measured: each layout (one rank; EP 2; TP 2; PP 2; TP 2 x EP 2 with expert TP 2 and 1; PP 2 x EP 2, the multi-rank
ones with the distributed optimizer, as Miles runs) runs one training step of ``train_step``'s batch in spawned
ranks, and each rank counts what it holds afterwards: its parameters, the gradient buffers of Megatron's DDP and the
optimizer's state tensors. The fullest rank's bytes are compared with the count from ``config.json``: the ratio says
how far the projection's formula is from what megatron-core allocates (it leaves out Megatron's buffer padding).

Projected: the same formula on Qwen3-30B-A3B in bf16 with fp32 gradients and master weights (Miles' GPU setting),
every layout megatron-core would build on 8 GPUs (the training half of the Qwen3-30B-A3B launcher's two nodes) and
on 16, with and without --optimizer-cpu-offload, the launcher's layout (TP 4 x EP 8) and the one
``moe_memory_core.choose`` picks. Activations are not counted.

Standalone: ``python -m benchmarks.train_memory_moe [--quick]``; part of ``benchmarks.train_memory``'s result.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from benchmarks import moe_memory_core as core

ROOT = Path(__file__).resolve().parents[1]
QWEN3_30B_A3B = ROOT / "tests" / "scripts" / "model_configs" / "Qwen3-30B-A3B" / "config.json"
GPU_BYTES = 80e9  # an H100's memory
STATE_BUDGET = 0.6  # of it for the training state: the rest for activations, communication buffers and slack
LAUNCHER = core.Layout(tp=4, pp=1, ep=8)  # scripts/run-qwen3-30B-A3B-async.sh
# name -> (TP, PP, EP, expert TP, ranks): data parallel 2 where EP needs it; expert TP as Megatron defaults it (TP)
MEASURED = {
    "one rank": (1, 1, 1, 1, 1),
    "EP2": (1, 1, 2, 1, 2),
    "TP2": (2, 1, 1, 2, 2),
    "PP2": (1, 2, 1, 1, 2),
    "TP2 x EP2": (2, 1, 2, 2, 4),
    "TP2 x EP2, expert TP 1": (2, 1, 2, 1, 4),
    "PP2 x EP2": (1, 2, 2, 1, 4),
}
QUICK = ("one rank", "EP2", "TP2 x EP2")
WORKER_TIMEOUT = 600.0


def _state_bytes(actor) -> dict[str, int]:
    """What this rank holds between steps: parameters, Megatron DDP's gradient buffers, the optimizer's tensors."""
    import torch

    params = sum(p.numel() * p.element_size() for p in actor.module.parameters())
    buffers = list(actor.model.buffers) + list(actor.model.expert_parallel_buffers)
    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers)
    optimizers = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
    optimizer = sum(
        v.numel() * v.element_size()
        for opt in optimizers
        for state in opt.optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0  # Adam's step counter is a scalar
    )
    return {"params": params, "grads": grads, "optimizer": optimizer}


def _rank(rank: int, world: int, port: int, argv: list[str], out: str) -> None:
    """One rank of one layout: a training step, then its state's bytes, written to ``out``.rank."""
    from benchmarks import train_step
    from miles_async.arguments import parse_args
    from miles_async.backends.megatron.actor import MegatronTrainActor

    cfg = parse_args(argv).train
    actor = MegatronTrainActor(cfg, rank, world, total_optimizer_steps=1)
    actor.init_process_group("127.0.0.1", port)
    from transformers import AutoConfig

    actor.train(0, train_step.step_batch(AutoConfig.from_pretrained(cfg.model_path).vocab_size, prompts=1))
    Path(f"{out}.{rank}").write_text(json.dumps(_state_bytes(actor)))


def _file(name: str) -> str:
    return "".join(c for c in name if c.isalnum())


def measure(model: Path, data: Path, names: tuple[str, ...], work: Path) -> dict[str, list[dict]]:
    from tests.ports import spawn_ranks

    out = {}
    for name in names:
        tp, pp, ep, etp, world = MEASURED[name]
        argv = ["--hf-checkpoint", str(model), "--prompt-data", str(data), "--output-dir", str(work / "out"),
                "--use-tis", "--rollout-batch-size", "1", "--n-samples-per-prompt", "8", "--num-rollout", "1",
                "--rm-type", "integer", "--train-backend", "megatron", "--moe-token-dispatcher-type", "alltoall",
                "--actor-num-gpus-per-node", str(world), "--tensor-model-parallel-size", str(tp),
                "--pipeline-model-parallel-size", str(pp), "--expert-model-parallel-size", str(ep),
                "--expert-tensor-parallel-size", str(etp),
                *(["--use-distributed-optimizer"] if world > 1 else []),
                *(["--sequence-parallel"] if tp > 1 else [])]  # fmt: skip
        print(f"train_memory_moe: {name} ({world} ranks)", flush=True)
        codes = spawn_ranks(_rank, world, argv, str(work / _file(name)), timeout=WORKER_TIMEOUT)
        if codes != [0] * world:
            raise RuntimeError(f"{name}: ranks exited {codes}")
        out[name] = [json.loads(Path(f"{work / _file(name)}.{r}").read_text()) for r in range(world)]
    return out


def report(measured: dict[str, list[dict]], tiny_config: dict, target_config: dict) -> dict:
    from benchmarks.common import fmt, table

    tiny = core.MoEShape.of(tiny_config)
    kib = 2**10
    rows, ratios = [], {}
    for name, ranks in measured.items():
        tp, pp, ep, etp, world = MEASURED[name]
        layout = core.Layout(tp, pp, ep, etp, world)
        counted = core.rank_bytes(tiny, layout, core.Precision.fp32(distributed_optimizer=world > 1))
        fullest = max(ranks, key=lambda r: r["params"] + r["grads"] + r["optimizer"])
        total = fullest["params"] + fullest["grads"] + fullest["optimizer"]
        ratios[name] = total / counted.total
        rows.append([name, str(layout), fmt(total / tiny.total, 3), fmt(fullest["params"] / kib, 4),
                     fmt(fullest["grads"] / kib, 4), fmt(fullest["optimizer"] / kib, 4),
                     fmt(counted.total / kib, 4), f"{ratios[name]:.3f}"])  # fmt: skip
    tables = [
        table(
            f"Megatron MoE layouts, measured: the fullest rank's training state after one step, tiny Qwen3-MoE "
            f"({tiny.total} parameters, {tiny.experts} experts, top-{tiny_config['num_experts_per_tok']}), fp32, "
            "over gloo",
            [
                "layout",
                "ranks",
                "bytes/param",
                "params KiB",
                "grads KiB",
                "optimizer KiB",
                "counted KiB",
                "measured / counted",
            ],
            rows,
            note="bytes/param: the fullest rank's parameters + DDP gradient buffers + optimizer state, over the "
            "model's parameter count. counted: moe_memory_core.rank_bytes from config.json (fp32 weights and "
            "gradients, Adam's two moments; the distributed optimizer at 2+ ranks).",
        )  # fmt: skip
    ]

    target = core.MoEShape.of(target_config)
    gib, budget = 2**30, STATE_BUDGET * GPU_BYTES
    projection: dict = {"params": target.total, "budget_bytes": budget, "worlds": {}}
    rows = []
    for world in (8, 16):
        for offload in (False, True):
            precision = core.Precision.bf16(optimizer_on_host=offload)
            chosen = core.choose(target, world, precision, budget)
            launcher = core.Layout(LAUNCHER.tp, LAUNCHER.pp, LAUNCHER.ep, 1, world)
            best = min(core.layouts(target, world), key=lambda lay: core.rank_bytes(target, lay, precision).total)
            entry = {}
            for role, layout in (("launcher", launcher), ("chosen", chosen), ("least state", best)):
                if layout is None:
                    rows.append([world, "on host" if offload else "on GPU", role, "none fits", "", "", ""])
                    continue
                b = core.rank_bytes(target, layout, precision)
                entry[role] = {"layout": str(layout), "gpu_bytes": b.total, "optimizer_bytes": b.optimizer}
                rows.append([world, "on host" if offload else "on GPU", role, str(layout), fmt(b.total / gib, 3),
                             fmt(b.optimizer / gib, 3), "yes" if b.total <= budget else "no"])  # fmt: skip
            projection["worlds"][f"{world}{'_offload' if offload else ''}"] = entry
    tables.append(
        table(
            f"Projection: Qwen3-30B-A3B ({target.total / 1e9:.2f}B parameters, {target.experts} experts) on H100s, "
            "bf16 weights, fp32 gradients and master weights, distributed optimizer; activations NOT included",
            [
                "GPUs",
                "optimizer state",
                "layout",
                "TP PP EP DP",
                "GiB per GPU",
                "optimizer GiB per GPU (on host if offloaded)",
                f"fits {STATE_BUDGET:.0%} of 80 GB",
            ],
            rows,
            note="launcher: scripts/run-qwen3-30B-A3B-async.sh's TP 4 x EP 8 (it trains on 8 of its 16 GPUs and "
            "offloads the optimizer). chosen: moe_memory_core.choose, the layout that fits with the fewest "
            "TP x PP ranks, then the smallest EP. least state: the layout with the fewest bytes per GPU. The "
            "budget leaves 40% of each GPU to activations, which grow as TP and PP shrink (not modelled).",
        )  # fmt: skip
    )
    notes = [
        f"The count from config.json is within {max(abs(r - 1) for r in ratios.values()):.1%} of the measured "
        "state on every layout measured: " + ", ".join(f"{n} {r:.3f}" for n, r in ratios.items()) + ".",
    ]
    return {"measured": measured, "ratios": ratios, "projection": projection, "tables": tables, "notes": notes}


def run(quick: bool, out_dir: Path) -> dict:
    from miles_async.assets.tiny_model import make_tiny_model, make_tiny_task_dataset

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = make_tiny_model(work / "model", seed=2, arch="qwen3_moe")
        data, _ = make_tiny_task_dataset(work / "task", n_train=8, n_eval=2)
        measured = measure(model, data, QUICK if quick else tuple(MEASURED), work)
        tiny_config = json.loads((model / "config.json").read_text())
    return report(measured, tiny_config, json.loads(QWEN3_30B_A3B.read_text()))


if __name__ == "__main__":
    import argparse

    from benchmarks.common import render_table

    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    result = run(p.parse_args().quick, Path(tempfile.mkdtemp()))
    for t in result["tables"]:
        print(render_table(t))
    print(*result["notes"], sep="\n")

"""Seconds per training step of the training backends on the same SmolLM2-135M batch: the torch backend with its
shared-prefix layout (the default), the torch backend with one row per sample (--no-shared-prefix), and Megatron.

One GRPO rollout of 64 samples shaped like a real one (8 prompts x 8 samples, prompts of
~40 tokens, responses of 8) is trained as one optimizer step (global batch 64, fp32 weights
and AdamW, --max-tokens-per-gpu 8192, so one micro-batch), by ``FSDPTrainActor``
(transformers + torch) and by ``MegatronTrainActor`` (Megatron-core GPTModel, Megatron DDP,
optimizer and schedule; on a CPU machine through ``cpu_compat``). Each backend runs in its
own process with the same torch thread count: one warm-up step each, then timed steps,
alternating between the backends (so both see the same load on a shared machine) when
memory allows both processes at once, else one backend after the other.
``train/seconds`` (forward, backward, optimizer) is what is reported.

Standalone: ``python -m benchmarks.train_step [--quick]``; registered in ``benchmarks.run``
as ``"train_step": "benchmarks.train_step"``.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from miles_async.rollout.batch import RolloutBatch

# variant -> its flags
VARIANTS = {
    "fsdp": ("--train-backend", "fsdp"),
    "fsdp --no-shared-prefix": ("--train-backend", "fsdp", "--no-shared-prefix"),
    "megatron": ("--train-backend", "megatron"),
}
THREADS = 2
N_PROMPTS, N_SAMPLES, PROMPT_LEN, RESPONSE_LEN = 8, 8, 40, 8


def step_batch(
    vocab: int,
    seed: int = 0,
    prompts: int = N_PROMPTS,
    samples: int = N_SAMPLES,
    prompt_len: int = PROMPT_LEN,
    response_len: int = RESPONSE_LEN,
    as_groups: bool = False,
) -> Any:
    """A GRPO rollout shaped like the quickstart's (by default): ``prompts`` groups of ``samples``, prompts of about
    ``prompt_len`` random tokens, responses of ``response_len``; a ``RolloutBatch``, or its groups of samples."""
    from miles_async.rollout.batch import to_train_batch
    from miles_async.rollout.sample import Sample

    rng = random.Random(seed)
    groups = []
    for g in range(prompts):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len + rng.randrange(-4, 5))]
        groups.append(
            [
                Sample(
                    uid=str(g),
                    group_index=g,
                    index=i,
                    prompt="",
                    prompt_tokens=prompt,
                    response_tokens=[rng.randrange(3, vocab) for _ in range(response_len)],
                    reward=float(rng.random() < 0.5),
                )
                for i in range(samples)
            ]
        )
    for s in (s for g in groups for s in g):  # an engine's log-probs: --use-tis needs one per trained token
        s.rollout_logprobs = [-3.0] * s.response_length
    return groups if as_groups else to_train_batch(groups)


def uneven_lengths(cap: int, samples: int) -> list[int]:
    """A group's answer lengths with a long tail under ``cap``: spread evenly from 0.42 of it to it (mean 0.71 of the
    cap: 91 of 128, the mean of the 128x8x40 run's answers in benchmarks/trl_peer_shapes)."""
    return [round(cap * (0.42 + 0.58 * i / max(1, samples - 1))) for i in range(samples)]


def uneven_batch(batch_groups: list[list[Any]], cap: int, padded: bool) -> RolloutBatch:
    """``batch_groups``' samples with their answers cut to ``uneven_lengths``; ``padded``: each answer then filled
    back to ``cap`` with untrained tokens (loss mask 0), which costs the trainer's layers what slots padded to the
    longest answer cost before the shared-prefix layout laid slots out at their answers' lengths."""
    from dataclasses import replace

    from miles_async.rollout.batch import to_train_batch

    groups = []
    for group in batch_groups:
        cut = []
        for s, n in zip(group, uneven_lengths(cap, len(group)), strict=True):
            tokens = s.response_tokens[:n] + ([s.response_tokens[-1]] * (cap - n) if padded else [])
            cut.append(
                replace(
                    s,
                    response_tokens=tokens,
                    loss_mask=[1] * n + [0] * (len(tokens) - n),
                    rollout_logprobs=[-3.0] * len(tokens),
                )
            )
        groups.append(cut)
    return to_train_batch(groups)


def _worker(variant: str, model: str, data: str, steps: int, conn, tree: str | None = None) -> None:
    """Build one variant's actor, then train one step per request from the parent. ``tree``: a source tree of
    another revision (``--baseline``) to import miles_async from."""
    if tree is not None:
        sys.path.insert(0, tree)
    import torch

    from miles_async.arguments import parse_args

    cfg = parse_args(
        [
            "--use-tis",
            "--hf-checkpoint",
            model,
            "--prompt-data",
            data,
            "--rollout-batch-size",
            str(N_PROMPTS),
            "--n-samples-per-prompt",
            str(N_SAMPLES),
            "--num-rollout",
            str(steps),
            "--rm-type",
            "integer",
            "--lr",
            "1e-6",
            "--train-num-threads",
            str(THREADS),
            "--output-dir",
            tempfile.mkdtemp(),
            *VARIANTS[variant.split(" @")[0]],
        ]
    ).train
    t0 = time.time()
    if cfg.backend == "megatron":
        from miles_async.backends.megatron.actor import MegatronTrainActor

        actor = MegatronTrainActor(cfg, 0, 1, total_optimizer_steps=steps)
        actor.init_process_group(*actor.address())  # the rendezvous it serves, as a train group's rank 0 does
    else:
        from miles_async.backends.fsdp.actor import FSDPTrainActor

        actor = FSDPTrainActor(cfg, 0, 1, total_optimizer_steps=steps)
    from transformers import AutoConfig

    batch = step_batch(AutoConfig.from_pretrained(model).vocab_size)
    conn.send(
        {
            "build_seconds": time.time() - t0,
            "torch_threads": torch.get_num_threads(),
            "tokens": sum(len(t) for t in batch.tokens),
        }
    )
    while (rollout := conn.recv()) is not None:
        m = actor.train(rollout, batch)
        conn.send({"seconds": m["train/seconds"], "loss": m["train/loss"], "rss_gib": _rss_gib()})


def _rss_gib() -> float:
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return kb / 2**20


def _available_gib() -> float:
    with open("/proc/meminfo") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    return kb / 2**20


def measure(
    model: Path,
    reps: int,
    work: Path,
    variants: tuple[str, ...] = tuple(VARIANTS),
    min_free_gib: float = 18.0,
    trees: dict[str, str] | None = None,
) -> dict:
    """One warm-up step each, then ``reps`` timed steps each.

    With enough free memory both workers stay alive and their steps alternate (order flipped
    every round), so both see the same machine load; otherwise one backend after the other.
    """
    import torch.multiprocessing as mp

    from miles_async.assets.tiny_model import make_tiny_task_dataset

    train, _ = make_tiny_task_dataset(work / "task", n_train=64, n_eval=4)
    ctx = mp.get_context("spawn")
    interleaved = _available_gib() >= min_free_gib
    results: dict[str, dict] = {b: {"seconds": [], "losses": []} for b in variants}
    workers: dict[str, tuple] = {}

    def start(backend: str) -> None:
        parent, child = ctx.Pipe()
        tree = (trees or {}).get(backend)
        proc = ctx.Process(target=_worker, args=(backend, str(model), str(train), reps + 1, child, tree))
        proc.start()
        workers[backend] = (proc, parent)
        results[backend].update(parent.recv())

    def step(backend: str, rollout: int, timed: bool) -> None:
        conn = workers[backend][1]
        conn.send(rollout)
        r = conn.recv()
        results[backend]["rss_gib"] = r["rss_gib"]
        if timed:
            results[backend]["seconds"].append(r["seconds"])
            results[backend]["losses"].append(r["loss"])

    def stop(backend: str) -> None:
        proc, conn = workers.pop(backend)
        conn.send(None)
        proc.join(120)

    if interleaved:
        for b in variants:
            start(b)
        for b in variants:
            step(b, 0, timed=False)
        for rep in range(reps):
            for b in variants if rep % 2 == 0 else variants[::-1]:
                step(b, rep + 1, timed=True)
        for b in variants:
            stop(b)
    else:
        for b in variants:
            start(b)
            for rep in range(reps + 1):
                step(b, rep, timed=rep > 0)
            stop(b)
    return {"mode": "interleaved" if interleaved else "sequential", "backends": results}


def run(quick: bool, out_dir: Path, variants: tuple[str, ...] = tuple(VARIANTS), baseline: str | None = None) -> dict:
    """``baseline``: also the torch backend of that git revision ("fsdp @<rev>"), side by side."""
    from benchmarks.common import export_tree, fmt, median, smollm2_path, table

    reps = 3 if quick else 6
    with tempfile.TemporaryDirectory() as tmp:
        trees = {}
        if baseline is not None:
            trees[f"fsdp @{baseline}"] = str(export_tree(baseline, Path(tmp) / f"tree-{baseline}"))
            variants = (*variants, f"fsdp @{baseline}")
        measured = measure(smollm2_path(), reps, Path(tmp), variants, trees=trees)
    res = measured["backends"]
    rows = [
        [
            b,
            fmt(median(r["seconds"])),
            fmt(min(r["seconds"])),
            fmt(max(r["seconds"])),
            len(r["seconds"]),
            fmt(r["build_seconds"], 2),
            fmt(r["rss_gib"], 2),
        ]
        for b, r in res.items()
    ]

    def ratio(a: str, b: str) -> float | None:
        return median(res[a]["seconds"]) / median(res[b]["seconds"]) if a in res and b in res else None

    megatron, unshared = ratio("megatron", "fsdp"), ratio("fsdp --no-shared-prefix", "fsdp")
    tokens = res["fsdp"]["tokens"]
    notes = []
    if baseline is not None:
        notes.append(
            f"this tree / {baseline} = {ratio('fsdp', f'fsdp @{baseline}'):.2f}x per step (torch backend, 1 worker)."
        )
    if unshared is not None:
        notes.append(
            f"one row per sample / shared prefix = {unshared:.2f}x per step: the shared layout computes each "
            f"group's ~{PROMPT_LEN}-token prompt once instead of {N_SAMPLES} times."
        )
    if megatron is not None:
        notes.append(
            f"megatron / fsdp = {megatron:.2f}x per step on the same batch. On the CPU the Megatron path runs "
            "through cpu_compat (a TorchFunctionMode on every torch call), computes logits for every "
            "position, where the torch backend keeps only the response's (logits_to_keep), and lays out one "
            "row per sample."
        )
    return {
        "results": res,
        "mode": measured["mode"],
        "ratio_megatron_over_fsdp": megatron,
        "ratio_unshared_over_shared": unshared,
        "tables": [
            table(
                f"Seconds per training step, SmolLM2-135M, {N_PROMPTS * N_SAMPLES} samples "
                f"({tokens} tokens), fp32, {THREADS} torch threads",
                ["backend", "median s/step", "min", "max", "steps", "build s", "peak RSS GiB"],
                rows,
                note=f"steps {measured['mode']}",
            )
        ],
        "notes": notes,
    }


def headline(entry: dict) -> list[tuple[str, str]]:
    res = entry["results"]
    from benchmarks.common import median

    f = median(res["fsdp"]["seconds"])
    rows = []
    if "fsdp --no-shared-prefix" in res:
        u = median(res["fsdp --no-shared-prefix"]["seconds"])
        rows.append(
            (
                "train step, SmolLM2-135M, 8 prompts x 8 samples: shared prefix vs one row per sample",
                f"{f:.2f} s vs {u:.2f} s",
            )
        )
    if "megatron" in res:
        m = median(res["megatron"]["seconds"])
        rows.append(("train step, SmolLM2-135M, 64 samples: fsdp vs megatron backend", f"{f:.2f} s vs {m:.2f} s"))
    return rows


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--variants", nargs="+", choices=tuple(VARIANTS), default=tuple(VARIANTS))
    p.add_argument("--baseline", default=None, help="a git revision whose torch backend runs side by side")
    a = p.parse_args()
    result = run(a.quick, Path(tempfile.mkdtemp()), tuple(a.variants), a.baseline)
    for t in result["tables"]:
        from benchmarks.common import render_table

        print(render_table(t))
    print(*result["notes"], sep="\n")

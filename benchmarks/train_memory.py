"""Memory per training worker of the torch backend on SmolLM2-135M: DDP (the code before FSDP2) against FSDP2
and FSDP2 + LoRA, at 1 and 2 workers, with a projection to 4B and 8B models on 8 GPUs; then the Megatron backend's
MoE layouts and a Qwen3-30B-A3B projection (``benchmarks/train_memory_moe.py``, under the result's ``moe``).

Variants (``VARIANTS``):

- ``ddp``: the tree of commit ``DDP_COMMIT`` (the last one where 2+ workers replicate the model under
  DistributedDataParallel), exported read-only with ``git archive`` into a temporary folder and run from there;
- ``fsdp2``: this working tree (FSDP2 shards parameters, gradients and optimizer state over 2+ workers);
- ``lora``: this working tree with ``--lora-rank 8 --lora-alpha 16 --lora-target-modules all-linear`` (only the
  adapters are trained); reported as not available where the flags do not exist.

Each (variant, workers) configuration runs in fresh processes, one rank per process (``python
benchmarks/train_memory.py --worker ...`` with ``PYTHONPATH`` at the variant's tree; two ranks over gloo), on
train_step's batch (64 samples, fp32 weights and AdamW, one optimizer step per training step). Only one
configuration runs at a time; with several rounds the configurations alternate, order flipped every round.
Per rank, after its steps:

- the bytes of the tensors training keeps: parameters, gradients and optimizer state, counted on this rank's
  shards (``DTensor.to_local()``) when sharded and on the full tensors when not: independent of the allocator
  and the machine, divided by the model's parameter count it is *bytes per parameter*;
- peak RSS (``VmHWM``) after the build (and, at 2 workers, the sharding) and at the end: what the process
  really took, including torch itself, the model load and activations.

Standalone: ``python -m benchmarks.train_memory [--quick]``; registered in ``benchmarks.run`` as
``"train_memory": "benchmarks.train_memory"``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DDP_COMMIT = "fb5e1cc"
LORA_RANK, LORA_ALPHA = 8, 16
LORA_FLAGS = ("--lora-rank", str(LORA_RANK), "--lora-alpha", str(LORA_ALPHA), "--lora-target-modules", "all-linear")
# variant -> (its tree: "old" is DDP_COMMIT's export, "new" this working tree; extra flags)
VARIANTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "ddp": ("old", ()),
    "fsdp2": ("new", ()),
    "lora": ("new", LORA_FLAGS),
}
WORLDS = (1, 2)
CORES = 2  # torch threads per configuration, split among its ranks
GPUS, PROJECTED = 8, {"Qwen3-4B": 4.02e9, "Llama-3.1-8B": 8.03e9}
# The projection's models, for their LoRA adapter count: (hidden, intermediate, layers, q out, kv out).
SHAPES = {"Qwen3-4B": (2560, 9728, 36, 32 * 128, 8 * 128), "Llama-3.1-8B": (4096, 14336, 32, 32 * 128, 8 * 128)}
ROOT = Path(__file__).resolve().parents[1]
WORKER_TIMEOUT = 600.0
RESULT_PREFIX = "TRAIN_MEMORY_RESULT "


# -- the worker: one rank of one configuration, run with PYTHONPATH at the variant's tree --------------------------
def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _local(t):
    """This rank's part of ``t`` (the tree under test may predate DTensor use, so import lazily)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - old torch
        return t
    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(t) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def state_bytes(module, optimizer) -> dict[str, int]:
    """Bytes of the tensors training holds between steps, on this rank: parameters (trained and frozen), their
    gradients and the optimizer's state; and the model's (global) parameter counts."""
    out = dict.fromkeys(("params_trained", "params_frozen", "grads", "optimizer", "numel_trained", "numel_frozen"), 0)
    for p in module.parameters():  # deduplicated: tied embeddings count once
        kind = "trained" if p.requires_grad else "frozen"
        out[f"params_{kind}"] += _nbytes(p)
        out[f"numel_{kind}"] += p.numel()  # a DTensor's numel is the full tensor's
        if p.grad is not None:
            out["grads"] += _nbytes(p.grad)
    for st in optimizer.state.values():
        for v in st.values():
            if hasattr(v, "numel") and hasattr(v, "element_size"):
                out["optimizer"] += _nbytes(v)
    return out


def _worker_main(a: argparse.Namespace) -> None:
    """One rank: build the actor, join the group (where FSDP2 shards), train ``a.steps`` steps, print a result."""
    import torch

    from benchmarks import train_step
    from miles_async.arguments import parse_args
    from miles_async.backends.fsdp.actor import FSDPTrainActor

    torch.manual_seed(0)
    flags = [
        "--use-tis",
        "--hf-checkpoint",
        a.model,
        "--prompt-data",
        a.data,
        "--rollout-batch-size",
        str(a.prompts),
        "--n-samples-per-prompt",
        str(train_step.N_SAMPLES),
        "--num-rollout",
        str(a.steps),
        "--rm-type",
        "integer",
        "--lr",
        "1e-6",
        "--train-num-threads",
        str(max(1, CORES // a.world)),
        "--actor-num-gpus-per-node",
        str(a.world),
        "--output-dir",
        tempfile.mkdtemp(),
        *json.loads(a.flags),
    ]
    cfg = parse_args(flags).train
    t0 = time.time()
    actor = FSDPTrainActor(cfg, a.rank, a.world, total_optimizer_steps=a.steps)
    actor.init_process_group("127.0.0.1", a.port)
    hwm_setup = status_kib("VmHWM")
    from transformers import AutoConfig

    batch = train_step.step_batch(AutoConfig.from_pretrained(a.model).vocab_size, prompts=a.prompts)
    setup_s, seconds, losses = time.time() - t0, [], []
    for step in range(a.steps):
        m = actor.train(step, batch)
        seconds.append(m["train/seconds"])
        losses.append(m["train/loss"])
    result = {
        "rank": a.rank,
        "setup_seconds": setup_s,
        "step_seconds": seconds,
        "losses": losses,
        "hwm_setup_kib": hwm_setup,
        "hwm_kib": status_kib("VmHWM"),
        "rss_end_kib": status_kib("VmRSS"),
        "rss_anon_end_kib": status_kib("RssAnon"),
        "model_class": type(actor.module).__name__,
        **state_bytes(actor.module, actor.optimizer),
    }
    model = getattr(actor, "model", None)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        # DDP's reducer keeps its own flat gradient buckets (private API: best effort, for the report only).
        try:
            sizes = model._get_ddp_logging_data().get("bucket_sizes", "")
            result["ddp_bucket_bytes"] = sum(int(x) for x in str(sizes).replace(",", " ").split())
        except Exception as e:  # noqa: BLE001 - a missing private field must not lose the measurement
            result["ddp_bucket_bytes_error"] = repr(e)
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    if a.world > 1:
        torch.distributed.destroy_process_group()


# -- the parent: configurations one at a time ------------------------------------------------------------------------
def _available_gib() -> float:
    with open("/proc/meminfo") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    return kb / 2**20


def _die_with_parent() -> None:
    """Runs in the child before exec: the kernel kills a rank whose benchmark process dies, however it dies."""
    import ctypes
    import signal

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _lora_missing(model: Path, data: Path) -> str | None:
    """None when this tree's parser takes the LoRA flags, else the parser's complaint."""
    import contextlib
    import io

    from miles_async.arguments import parse_args

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parse_args(
                ["--hf-checkpoint", str(model), "--prompt-data", str(data), "--output-dir", tempfile.mkdtemp()]
                + ["--use-tis", "--rollout-batch-size", "1", "--num-rollout", "1", "--rm-type", "integer"]
                + list(LORA_FLAGS)
            )
    except SystemExit:
        return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else "parse_args rejected the flags"
    return None


def run_config(
    tree: Path, flags: tuple[str, ...], world: int, steps: int, prompts: int, model: Path, data: Path
) -> list[dict]:
    """Every rank's result for one configuration, in fresh processes; raises with the ranks' output on failure."""
    from miles_async.utils.ports import hosted_store
    from tests.ports import AGENT_STORE_ENV

    store = hosted_store("127.0.0.1", WORKER_TIMEOUT)  # the ranks' rendezvous, served until they are done
    port = store.port
    env = dict(os.environ, PYTHONPATH=str(tree), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env[AGENT_STORE_ENV] = "True"
    procs = []
    with tempfile.TemporaryDirectory() as logs:
        for rank in range(world):
            log = open(Path(logs) / f"rank{rank}.log", "w+")  # noqa: SIM115 - closed below
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--rank", str(rank), "--world"]
            cmd += [str(world), "--port", str(port), "--steps", str(steps), "--prompts", str(prompts)]
            cmd += ["--model", str(model), "--data", str(data)]
            cmd += ["--flags", json.dumps(list(flags))]
            proc = subprocess.Popen(
                cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
            )
            procs.append((proc, log))
        deadline = time.monotonic() + WORKER_TIMEOUT
        try:
            # A rank that dies leaves the other blocked in a collective: stop waiting as soon as one fails.
            while any(p.poll() is None for p, _ in procs):
                if any(p.returncode not in (None, 0) for p, _ in procs) or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
        finally:
            for p, _ in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(30)
        results, failures = [], []
        for rank, (p, log) in enumerate(procs):
            log.seek(0)
            text = log.read()
            log.close()
            line = next((x for x in text.splitlines() if x.startswith(RESULT_PREFIX)), None)
            if p.returncode != 0 or line is None:
                failures.append(f"rank {rank} exit {p.returncode}:\n{text[-3000:]}")
            else:
                results.append(json.loads(line[len(RESULT_PREFIX) :]))
    if failures:
        raise RuntimeError("\n".join(failures))
    return results


def measure(
    model: Path, data: Path, old_tree: Path, rounds: int, steps: int, prompts: int, variants: tuple[str, ...]
) -> dict:
    trees = {"old": old_tree, "new": ROOT}
    configs = [(v, w) for w in WORLDS for v in variants]
    res: dict[str, dict] = {f"{v}@{w}": {"variant": v, "world": w, "runs": [], "errors": []} for v, w in configs}
    for r in range(rounds):
        for v, w in configs if r % 2 == 0 else configs[::-1]:
            tree, flags = VARIANTS[v]
            key = f"{v}@{w}"
            print(f"train_memory: round {r + 1}/{rounds}, {key} (free {_available_gib():.1f} GiB)", flush=True)
            try:
                res[key]["runs"].append(run_config(trees[tree], flags, w, steps, prompts, model, data))
            except RuntimeError as e:
                res[key]["errors"].append(str(e))
                print(f"train_memory: {key} failed:\n{e}", file=sys.stderr, flush=True)
    return res


# -- the report --------------------------------------------------------------------------------------------------
def lora_adapter_params(hidden: int, inter: int, layers: int, q_out: int, kv_out: int, rank: int) -> int:
    """LoRA A and B of every linear layer of the blocks (q, k, v, o, gate, up, down; not the head): rank x (in +
    out) each."""
    per_layer = (hidden + q_out) + 2 * (hidden + kv_out) + (q_out + hidden) + 2 * (hidden + inter) + (inter + hidden)
    return rank * per_layer * layers


KINDS = ("params_trained", "params_frozen", "grads", "optimizer", "ddp_buckets")


def _summary(runs: list[list[dict]]) -> dict:
    """One configuration's numbers: the tensor bytes are the same every run (deterministic), RSS takes the max."""
    ranks = [{**r, "ddp_buckets": r.get("ddp_bucket_bytes", 0)} for r in runs[-1]]
    r0 = ranks[0]
    per_rank = {k: max(r[k] for r in ranks) for k in KINDS}  # the largest rank's
    return {
        "numel_trained": r0["numel_trained"],
        "numel_frozen": r0["numel_frozen"],
        "per_rank_bytes": per_rank,
        "per_rank_total": max(sum(r[k] for k in KINDS) for r in ranks),
        "all_ranks_bytes": {k: sum(r[k] for r in ranks) for k in KINDS},
        "all_ranks_total": sum(r[k] for r in ranks for k in KINDS),
        "hwm_gib": max(r["hwm_kib"] for rs in runs for r in rs) / 2**20,
        "hwm_setup_gib": max(r["hwm_setup_kib"] for rs in runs for r in rs) / 2**20,
        "rss_anon_end_gib": max(r.get("rss_anon_end_kib", 0) for rs in runs for r in rs) / 2**20,
        "step_seconds": [s for rs in runs for s in rs[0]["step_seconds"]],
        "model_class": r0["model_class"],
    }


def run(quick: bool, out_dir: Path, variants: tuple[str, ...] = tuple(VARIANTS)) -> dict:
    from benchmarks.common import export_tree, smollm2_path
    from miles_async.assets.tiny_model import make_tiny_task_dataset

    # The batch is train_step's, cut to its first prompt(s): the tensor bytes do not depend on it, and on the
    # shared 2-core machine a 64-sample step at 2 workers took minutes. Two steps in the full run: from the
    # second on, Adam's state coexists with the activations and gradients (the steady-state peak RSS).
    rounds, steps, prompts = (1, 1, 1) if quick else (1, 2, 2)
    model = smollm2_path()
    notes: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        data, _ = make_tiny_task_dataset(Path(tmp) / "task", n_train=64, n_eval=4)
        missing = _lora_missing(model, data) if "lora" in variants else None
        if missing is not None:
            notes.append(f"lora: not available in this tree ({missing}); its column is empty.")
            variants = tuple(v for v in variants if v != "lora")
        old = export_tree(DDP_COMMIT, Path(tmp) / "ddp_tree") if "ddp" in variants else ROOT
        raw = measure(model, data, old, rounds, steps, prompts, variants)
    settings = {
        "rounds": rounds,
        "steps": steps,
        "prompts": prompts,
        "ddp_commit": DDP_COMMIT,
        "lora_flags": list(LORA_FLAGS),
        "variants": list(variants),
    }
    result = report(raw, settings, json.loads((model / "config.json").read_text()), notes)
    # The Megatron MoE layouts and the Qwen3-30B-A3B projection (benchmarks/train_memory_moe.py).
    from benchmarks import train_memory_moe

    result["moe"] = moe = train_memory_moe.run(quick, out_dir)
    result["tables"] += moe["tables"]
    result["notes"] += moe["notes"]
    return result


def report(raw: dict, settings: dict, model_config: dict, notes: list[str]) -> dict:
    """Tables, projection and notes from ``measure``'s per-rank results."""
    from benchmarks.common import fmt, table
    from benchmarks.train_step import N_SAMPLES

    variants = settings["variants"]
    summaries = {k: _summary(c["runs"]) for k, c in raw.items() if c["runs"]}
    for k, c in raw.items():
        if c["errors"] and not c["runs"]:
            notes.append(f"{k} failed: {c['errors'][-1].strip().splitlines()[-1]}")
    # The model's size: every parameter of the plain model (LoRA's adapters are not part of it).
    base = next((s["numel_trained"] + s["numel_frozen"] for k, s in summaries.items() if not k.startswith("lora")), 0)
    if not base and summaries:
        base = next(iter(summaries.values()))["numel_frozen"]
    mib, gib = 2**20, 2**30
    rows = []
    for v in VARIANTS:
        for w in WORLDS:
            s = summaries.get(f"{v}@{w}")
            if s is None:
                rows.append([v, w, "not available" if v not in variants else "failed"] + [""] * 9)
                continue
            b = s["per_rank_bytes"]
            s["bytes_per_param"] = s["per_rank_total"] / base
            rows.append(
                [
                    v,
                    w,
                    fmt(s["bytes_per_param"], 3),
                    fmt((b["params_trained"] + b["params_frozen"]) / mib, 3),
                    fmt(b["grads"] / mib, 3),
                    fmt(b["optimizer"] / mib, 3),
                    fmt(b["ddp_buckets"] / mib, 3) if b["ddp_buckets"] else "",
                    fmt(s["per_rank_total"] / mib, 3),
                    fmt(s["hwm_setup_gib"], 3),
                    fmt(s["hwm_gib"], 3),
                    fmt(min(s["step_seconds"]), 3),
                ]
            )
    tables = [
        table(
            f"Memory per training worker, SmolLM2-135M ({base / 1e6:.1f}M parameters), fp32 weights + AdamW, "
            f"{settings['prompts']} x {N_SAMPLES} samples of train_step's batch per step, {settings['steps']} "
            f"step(s), {CORES} torch threads split among the workers",
            [
                "variant",
                "workers",
                "bytes/param",
                "params MiB",
                "grads MiB",
                "optimizer MiB",
                "DDP buckets MiB",
                "total MiB",
                "peak RSS after setup GiB",
                "peak RSS GiB",
                "s/step (min)",
            ],
            rows,
            note="bytes/param = (parameters + gradients + optimizer state + DDP's gradient buckets held by one "
            "worker, the largest rank) / the model's parameter count. Peak RSS is VmHWM: torch itself, the model "
            "load, activations and allocator slack included; the tensor bytes leave out activations.",
        )
    ]

    projection, proj_rows = {}, []
    ddp = summaries.get("ddp@2") or summaries.get("ddp@1")
    fsdp, lora = summaries.get("fsdp2@2"), summaries.get("lora@2")
    h, heads = model_config["hidden_size"], model_config["num_attention_heads"]
    hd = model_config.get("head_dim") or h // heads
    smol_shape = (h, model_config["intermediate_size"], model_config["num_hidden_layers"], heads * hd)
    smol_adapters = lora_adapter_params(*smol_shape, model_config["num_key_value_heads"] * hd, rank=LORA_RANK)
    if lora is not None and lora["numel_trained"] != smol_adapters:
        notes.append(
            f"lora: the run trains {lora['numel_trained']} parameters, the q/k/v/o/gate/up/down formula gives "
            f"{smol_adapters} for SmolLM2: the projection's adapter counts use that formula, so check it."
        )
    for name, params in PROJECTED.items():
        row: dict = {"params": params, "lora_adapters": lora_adapter_params(*SHAPES[name], rank=LORA_RANK)}
        if ddp is not None:  # every GPU holds everything: one worker's bytes, whatever the number of GPUs
            row["ddp"] = ddp["per_rank_total"] / base * params
        if fsdp is not None:  # the whole state (both ranks at 2 workers), 1/8 of it on each of 8 GPUs
            row["fsdp2"] = fsdp["all_ranks_total"] / base * params / GPUS
        if lora is not None:
            # The whole state of both ranks: the frozen weights, and the adapters with their gradients and Adam
            # state, each scaled by its own count.
            frozen = lora["all_ranks_bytes"]["params_frozen"]
            per_adapter = (lora["all_ranks_total"] - frozen) / max(lora["numel_trained"], 1)
            row["lora"] = (frozen / lora["numel_frozen"] * params + per_adapter * row["lora_adapters"]) / GPUS
        projection[name] = row
        proj_rows.append(
            [
                name,
                f"{params / 1e9:.2f}B",
                f"{row['lora_adapters'] / 1e6:.1f}M ({100 * row['lora_adapters'] / params:.2f}%)",
            ]
            + [fmt(row[k] / gib, 3) if k in row else "n/a" for k in ("ddp", "fsdp2", "lora")]
        )
    tables.append(
        table(
            f"Projection: parameters + gradients + optimizer state per GPU on {GPUS} GPUs, fp32 master weights + "
            "AdamW, activations NOT included",
            ["model", "parameters", f"rank-{LORA_RANK} adapters", "ddp GiB", "fsdp2 GiB", f"lora r{LORA_RANK} GiB"],
            proj_rows,
            note=f"ddp: one worker's measured bytes/param at {2 if 'ddp@2' in summaries else 1} workers (with DDP's "
            f"buckets) x parameters, the same on any number of GPUs; fsdp2: the measured bytes/param of both ranks "
            f"together at 2 workers x parameters / {GPUS}; lora: the frozen weights (measured bytes per frozen "
            f"parameter x parameters) plus the adapters (measured bytes per adapter parameter, i.e. weight, gradient "
            f"and Adam state, x the model's rank-{LORA_RANK} q/k/v/o/gate/up/down adapter count from its layer "
            f"shapes), all sharded over the {GPUS} GPUs. Activations, communication buffers and allocator slack are "
            "not included.",
        )
    )
    notes.append(
        f"LoRA adapter fraction: SmolLM2-135M at rank {LORA_RANK} has {smol_adapters / 1e6:.2f}M adapter parameters "
        f"({100 * smol_adapters / base:.2f}% of {base / 1e6:.1f}M), the formula's count"
        + (f" and the run's ({lora['numel_trained']})" if lora is not None else "")
        + "; the fraction shrinks with width (~rank/hidden), so the projection counts each model's adapters from "
        "its shapes instead of scaling SmolLM2's fraction (which would give "
        + ", ".join(f"{n} {smol_adapters / base * p / 1e6:.0f}M" for n, p in PROJECTED.items())
        + "). Rank 16 doubles the adapters: "
        + ", ".join(f"{n} {2 * projection[n]['lora_adapters'] / 1e6:.0f}M" for n in PROJECTED)
        + "."
    )
    for w in WORLDS:  # the same batch and seed: FSDP2 must train as DDP did, rank by rank
        old, new = raw.get(f"ddp@{w}", {}).get("runs"), raw.get(f"fsdp2@{w}", {}).get("runs")
        if old and new:
            pairs = [(x, y) for a, b in zip(old[-1], new[-1]) for x, y in zip(a["losses"], b["losses"])]
            diff = max(abs(x - y) / max(abs(x), abs(y), 1e-12) for x, y in pairs)
            notes.append(f"{w} worker(s): fsdp2's per-rank losses over the steps equal ddp's to {diff:.1e} (relative).")
    if "ddp@2" in summaries:
        notes.append(
            "ddp's DDP buckets: the reducer's flat gradient buckets (gradient_as_bucket_view is off, so one more "
            "fp32 copy of the gradients at 2+ workers), read from DDP's logging data (bucket_sizes)."
        )
    return {
        "settings": settings,
        "base_params": base,
        "raw": raw,
        "summaries": summaries,
        "lora_adapters_formula_smollm2": smol_adapters,
        "projection": projection,
        "tables": tables,
        "notes": notes,
    }


def headline(entry: dict) -> list[tuple[str, str]]:
    s = entry.get("summaries", {})
    if "ddp@2" in s and "fsdp2@2" in s:
        return [
            (
                "train state per worker, SmolLM2-135M fp32 AdamW, 2 workers: DDP vs FSDP2",
                f"{s['ddp@2']['bytes_per_param']:.1f} vs {s['fsdp2@2']['bytes_per_param']:.1f} bytes/param",
            )
        ]
    return []


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--variants", nargs="+", choices=tuple(VARIANTS), default=tuple(VARIANTS))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("rank", "world", "port", "steps", "prompts"):
        p.add_argument(f"--{name}", type=int, help=argparse.SUPPRESS)
    for name in ("model", "data", "flags"):
        p.add_argument(f"--{name}", help=argparse.SUPPRESS)
    return p.parse_args(argv)


if __name__ == "__main__":
    a = _args()
    if a.worker:
        # Run as a file: its folder (benchmarks/) must not shadow top-level modules; PYTHONPATH names the tree.
        sys.path.pop(0)
        _worker_main(a)
    else:
        sys.path.insert(0, str(ROOT))
        result = run(a.quick, Path(tempfile.mkdtemp()), tuple(a.variants))
        from benchmarks.common import render_table

        for t in result["tables"]:
            print(render_table(t))
        print(*result["notes"], sep="\n")

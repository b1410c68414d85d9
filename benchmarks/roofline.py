"""How far each phase of a step is from what this machine can do: a roofline measured in one run.

The machine's limits, measured here: torch's matrix-multiply rate in float32 and bf16 at a large square shape (the
peak every fraction is taken against) and at the shapes a quickstart-shaped step runs (the MLP's and the output
projection's, at the decode, prefill and training token counts), and the memory bandwidth (a float32 triad). On a CPU
without bf16 arithmetic (no AVX512-BF16 or AMX: torch emulates it) bf16 is measured at one small shape only and marked
emulated; the run computes in float32 there, as ``--bf16`` falls back to (``config/precision.py``).

The step: SmolLM2-135M (a tiny random model with ``--quick``), 8 prompts of ~40 tokens x 8 samples of 8 tokens, as
``benchmarks/train_step.py`` builds it. Its phases run through our own code (``benchmarks/roofline_core.py``): the
embedded engine's prefill and decode, and ``FSDPTrainActor``'s old-log-prob and reference forwards, training forward
and backward, and optimizer step. Each is timed (median of the timed runs, engine and trainer alternating), its work
counted in a separate run (FLOPs on the executed graph; bytes for decode and the optimizer), and profiled in a third.
A phase below its goal (compute-bound phases at 40% of the matmul peak, bandwidth-bound ones at 50% of the triad) gets
its profile's top ops by self CPU time in the results.

Standalone: ``python -m benchmarks.roofline [--quick]``; registered in ``benchmarks.run`` as ``"roofline"``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks import roofline_core as rc


@dataclass(frozen=True)
class Settings:
    prompts: int
    samples: int
    prompt_len: int
    response_len: int
    reps: int  # timed runs of the step
    square: int  # side of the large square matmul
    triad_elements: int
    min_seconds: float = 0.3  # each limit's repetitions run at least this long (the best one counts)


FULL = Settings(prompts=8, samples=8, prompt_len=40, response_len=8, reps=3, square=2048, triad_elements=1 << 25)
QUICK = Settings(2, 4, 12, 4, reps=1, square=512, triad_elements=1 << 22, min_seconds=0.05)


def _threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# --------------------------------------------------------------------------- limits
def measure_limits(
    config: Any, s: Settings, bf16_native: bool, device: str = "cpu", sync: Callable[[], None] = rc.no_sync
) -> dict:
    """Matmul rates (large square and the step's shapes, per dtype) and the triad bandwidth on ``device``. Without
    native bf16, bf16 is timed once at the decode MLP's shape (seconds, where float32 takes milliseconds)."""
    tokens = {
        "decode": s.prompts * s.samples,
        "prefill": s.prompts * s.prompt_len,
        "train": s.prompts * (s.prompt_len + s.samples * s.response_len),
    }
    shapes = rc.step_shapes(config.hidden_size, config.intermediate_size, config.vocab_size, tokens)
    rows = []
    peaks, emulated = {}, []
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        if name == "bfloat16" and not bf16_native:
            label, m, k, n = shapes[0]
            rate = rc.matmul_rate(m, k, n, dtype, device, min_seconds=0.0, max_reps=1, sync=sync)
            rows.append({"dtype": name, "shape": label, "m": m, "k": k, "n": n, "flops_per_s": rate, "emulated": True})
            peaks[name] = rate
            emulated.append(name)
            continue
        sq = s.square
        peaks[name] = rc.matmul_rate(sq, sq, sq, dtype, device, s.min_seconds, sync=sync)
        rows.append({"dtype": name, "shape": "large square", "m": sq, "k": sq, "n": sq, "flops_per_s": peaks[name]})
        for label, m, k, n in shapes:
            rate = rc.matmul_rate(m, k, n, dtype, device, s.min_seconds, sync=sync)
            rows.append({"dtype": name, "shape": label, "m": m, "k": k, "n": n, "flops_per_s": rate})
    return {
        "matmul": rows,
        "peaks": peaks,
        "step_shape_peaks": {
            d: max(r["flops_per_s"] for r in rows if r["dtype"] == d and r["shape"] != "large square") for d in peaks
        },
        "emulated": emulated,
        "bandwidth": rc.triad_bandwidth(s.triad_elements, device, s.min_seconds, sync=sync),
        "triad_mib": s.triad_elements * 4 / 2**20,
    }


class Probes:
    """The large-square peak of the step's dtype and the triad, measured again between the step's runs: on a shared
    machine one measurement can fall in a busy moment, and the bound is the best the machine showed in the run."""

    def __init__(self, limits: dict, s: Settings, dtype: str) -> None:
        self.limits, self.s, self.dtype = limits, s, dtype
        self.peaks, self.bandwidths = [limits["peaks"][dtype]], [limits["bandwidth"]]

    def __call__(self) -> None:
        sq = self.s.square
        self.peaks.append(rc.matmul_rate(sq, sq, sq, getattr(torch, self.dtype), min_seconds=self.s.min_seconds))
        self.bandwidths.append(rc.triad_bandwidth(self.s.triad_elements, min_seconds=self.s.min_seconds))

    def best(self) -> dict:
        """The limits with the best of every probe, and the probes' spread."""
        limits = {**self.limits, "peaks": {**self.limits["peaks"], self.dtype: max(self.peaks)}}
        limits["bandwidth"] = max(self.bandwidths)
        limits["probes"] = {"peak": self.peaks, "bandwidth": self.bandwidths}
        for r in limits["matmul"]:
            if r["dtype"] == self.dtype and r["shape"] == "large square":
                r["flops_per_s"] = max(self.peaks)
        return limits


# --------------------------------------------------------------------------- the step
def _actor(model: Path, data: Path, s: Settings, dtype: str, steps: int):
    from miles_async.arguments import parse_args
    from miles_async.backends.fsdp.actor import FSDPTrainActor

    flags = [
        "--hf-checkpoint", str(model), "--ref-load", str(model), "--prompt-data", str(data),
        "--rollout-batch-size", str(s.prompts), "--n-samples-per-prompt", str(s.samples),
        "--num-rollout", str(steps), "--rm-type", "integer", "--lr", "1e-6", "--use-tis",
        # A KL loss builds the reference model, whose forward is a phase of its own; its coefficient changes nothing.
        "--use-kl-loss", "--kl-loss-coef", "0.001",
        "--train-num-threads", str(_threads()), "--output-dir", tempfile.mkdtemp(),
        *(["--bf16", "--keep-cpu-bf16"] if dtype == "bfloat16" else []),
    ]  # fmt: skip
    return FSDPTrainActor(parse_args(flags).train, 0, 1, total_optimizer_steps=steps)


def step_batch(model: Path, s: Settings) -> Any:
    """The step's rollout (``benchmarks/train_step.py``'s, at ``s``'s shape), in ``model``'s vocabulary."""
    from transformers import AutoConfig

    from benchmarks import train_step

    vocab = AutoConfig.from_pretrained(model).vocab_size
    return train_step.step_batch(vocab, 0, s.prompts, s.samples, s.prompt_len, s.response_len)


def measure_step(
    model: Path,
    data: Path,
    s: Settings,
    dtype: str,
    between: Callable[[], None] = rc.no_sync,
    profile: bool = True,
) -> list[rc.Phase]:
    """The step's phases: one warm-up, ``s.reps`` timed runs, one counted, one profiled (unless not ``profile``);
    the engine's run and the trainer's alternate, so both see the same load on a shared machine. ``between`` runs
    before each round."""
    from miles_async.inference.embedded.engine import Engine

    torch.set_num_threads(_threads())
    batch = step_batch(model, s)
    prompts = [batch.tokens[i][: batch.prompt_lengths[i]] for i in range(0, len(batch), s.samples)]
    actor = _actor(model, data, s, dtype, steps=s.reps + 3)
    engine = Engine(str(model), dtype=getattr(torch, dtype), max_running_requests=s.prompts * s.samples)
    engine.start()
    runs: dict[str, list[list[rc.Phase]]] = {"time": [], "flops": [], "profile": []}
    rollout = 0
    try:
        for how in ["time"] * (s.reps + 1) + ["flops"] + (["profile"] if profile else []):
            between()
            gen = rc.engine_phases(engine, prompts, s.samples, s.response_len, how)
            train = rc.actor_phases(actor, batch, rollout, how)
            rollout += 1
            runs[how].append(gen + train)
    finally:
        engine.shutdown()
    return rc.account(runs["time"][1:], runs["flops"][0], runs["profile"][0] if profile else None)


# --------------------------------------------------------------------------- report
def _rate(x: float, unit: str) -> str:
    scale, prefix = next(((v, p) for v, p in ((1e12, "T"), (1e9, "G")) if x >= v), (1e6, "M"))
    return f"{x / scale:.3g} {prefix}{unit}/s"


def phase_rows(phases: list[rc.Phase], limits: dict) -> list[dict]:
    """Each phase's work, time, binding limit (the roofline's: the longer of its FLOPs at the matmul peak of its
    dtype and its bytes at the triad bandwidth), its achieved rate of that limit and the fraction."""
    peaks, bandwidth = limits["peaks"], limits["bandwidth"]
    out = []
    for p in phases:
        binding = p.binding(peaks, bandwidth)
        work, bound, unit = (p.flops, peaks[p.dtype], "FLOP") if binding == "compute" else (p.bytes, bandwidth, "B")
        out.append(
            {
                "phase": p.name,
                "dtype": p.dtype,
                "flops": p.flops,
                "bytes": p.bytes,
                "tokens": p.tokens,
                "seconds": p.seconds,
                "binding": binding,
                "unit": unit,
                "achieved": work / p.seconds,
                "bound": bound,
                "bound_seconds": p.bound_seconds(peaks, bandwidth),
                "fraction": p.fraction(peaks, bandwidth),
                "goal": rc.goal_of(binding),
                "top_ops": p.top_ops(),
            }
        )
    return out


def _plot(rows: list[dict], out_dir: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    rows = rows[::-1]
    ax.barh(
        [f"{r['phase']} ({r['binding']})" for r in rows],
        [r["fraction"] for r in rows],
        color=["tab:green" if r["fraction"] >= r["goal"] else "tab:red" for r in rows],
    )
    for i, r in enumerate(rows):
        ax.plot([r["goal"]] * 2, [i - 0.4, i + 0.4], color="black", linewidth=1.5)
        ax.text(r["fraction"], i, f" {r['fraction']:.1%}", va="center", fontsize=8)
    ax.set_xlabel("fraction of the roofline bound (| = goal)")
    ax.set_xlim(0, max(1.0, max(r["fraction"] for r in rows) * 1.15))
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    name = "roofline.png"
    fig.savefig(out_dir / name, dpi=100)
    plt.close(fig)
    return name


def report(limits: dict, rows: list[dict], model_name: str, s: Settings, dtype: str, out_dir: Path) -> dict:
    from benchmarks.common import table

    probes = limits["probes"]
    limit_rows = [
        [r["dtype"], r["shape"], f"{r['m']}x{r['k']}x{r['n']}", _rate(r["flops_per_s"], "FLOP")]
        + [
            "emulated (no bf16 arithmetic on this CPU)"
            if r.get("emulated")
            else f"best of {len(probes['peak'])} probes in the run"
            if r["dtype"] == dtype and r["shape"] == "large square"
            else ""
        ]
        for r in limits["matmul"]
    ]
    limit_rows.append(
        [
            "float32",
            f"triad, 3 x {limits['triad_mib']:.0f} MiB",
            "",
            _rate(limits["bandwidth"], "B"),
            f"best of {len(probes['bandwidth'])} probes in the run",
        ]
    )
    phase_table = [
        [
            r["phase"],
            f"{r['flops'] / 1e9:.3g}",
            f"{r['bytes'] / 1e9:.3g}" if r["bytes"] else "",
            f"{r['seconds']:.3f}",
            f"{r['binding']} ({_rate(r['bound'], r['unit'])})",
            _rate(r["achieved"], r["unit"]),
            f"{r['bound_seconds']:.3g}",
            f"{r['fraction']:.1%}",
            f"{r['goal']:.0%}",
        ]
        for r in rows
    ]
    below = [r for r in rows if r["fraction"] < r["goal"]]
    profile_rows = [[r["phase"], op, f"{ms:.1f}", f"{share:.0%}"] for r in below for op, ms, share in r["top_ops"]]
    step = f"{s.prompts} prompts of ~{s.prompt_len} tokens x {s.samples} samples of {s.response_len} tokens"
    spread = ", ".join(
        f"{what} {_rate(min(v), unit)} to {_rate(max(v), unit)}"
        for what, v, unit in (("peak", probes["peak"], "FLOP"), ("bandwidth", probes["bandwidth"], "B"))
    )
    notes = [
        f"Each phase's bound is the roofline's: the longer of its FLOPs at the large-shape matmul peak of its dtype "
        f"({dtype} here) and its bytes at the triad bandwidth; the fraction is that time over the measured time. "
        f"The peak and the bandwidth were measured {len(probes['peak'])} times, between the step's runs, and the best "
        f"is the bound (spread: {spread}); the step's own shapes reach "
        + ", ".join(f"{_rate(v, 'FLOP')} in {d}" for d, v in limits["step_shape_peaks"].items())
        + " at best (first table).",
        "FLOPs are counted on the executed graph (torch.utils.flop_counter, attention counted dense as the kernel "
        "computes it); decode's bytes are the weights plus each row's KV cache per step, the optimizer's 28 B per "
        "trained parameter (AdamW, fp32 weights, gradients and moments). Train fwd+bwd's time excludes the optimizer "
        "step; its FLOPs include the forward's logits for the loss.",
    ]
    decode = next((r for r in rows if r["phase"] == "decode"), None)
    if decode is not None and decode["binding"] == "compute":
        balance = limits["peaks"][decode["dtype"]] / limits["bandwidth"]
        notes.append(
            f"decode is compute-bound here: {s.prompts * s.samples} rows per step make "
            f"{decode['flops'] / decode['bytes']:.0f} FLOP per byte read, above this machine's balance "
            f"({balance:.0f} FLOP/B: peak over bandwidth), so its bound is the matmul peak, not the bandwidth."
        )
    if limits["emulated"]:
        notes.append(
            f"{', '.join(limits['emulated'])}: this CPU has no bf16 arithmetic (torch emulates it, "
            f"{_rate(limits['peaks']['bfloat16'], 'FLOP')} at the decode MLP's shape against float32's "
            f"{_rate(limits['peaks']['float32'], 'FLOP')} peak); the step runs in float32, as --bf16 falls back to "
            "here."
        )
    for r in below:
        ops = ", ".join(f"{op} {share:.0%}" for op, _, share in r["top_ops"][:4])
        notes.append(
            f"{r['phase']}: {r['fraction']:.1%} of its {r['binding']} bound (goal {r['goal']:.0%}); its profile's self "
            f"CPU time goes to {ops} (third table)."
        )
    return {
        "tables": [
            table(
                f"This machine's limits ({_threads()} threads)", ["dtype", "what", "m x k x n", "rate", ""], limit_rows
            ),
            table(
                f"Each phase of one step against its roofline: {model_name}, {step}, {dtype}",
                ["phase", "GFLOP", "GB", "seconds", "bound by", "achieved", "bound s", "fraction", "goal"],
                phase_table,
                note=f"median of {s.reps} timed runs; the engine's and the trainer's runs alternate",
            ),
            table(
                "Where the time goes in each phase below its goal (top ops by self CPU time, one profiled run)",
                ["phase", "op", "self CPU ms", "share of phase"],
                profile_rows,
            ),
        ],
        "notes": notes,
        "plots": [_plot(rows, out_dir)],
    }


def shaped(text: str) -> Settings:
    """FULL at another step shape, ``ANSWER x GROUP x PROMPT`` as benchmarks/trl_peer_shapes.py names its shapes
    (``128x8x40``): 8 prompts of PROMPT tokens, GROUP samples of ANSWER tokens each."""
    try:
        answer, group, prompt = (int(x) for x in text.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape {text!r}: expected ANSWERxGROUPxPROMPT, e.g. 128x8x40") from None
    if min(answer, group, prompt) < 1:
        raise argparse.ArgumentTypeError(f"--shape {text!r}: every size must be at least 1")
    return replace(FULL, samples=group, prompt_len=prompt, response_len=answer)


def measure(s: Settings, quick: bool, profile: bool = True) -> tuple[list[rc.Phase], dict, str]:
    """The step's phases at ``s`` (a tiny random model when ``quick``, else SmolLM2), the limits probed between its
    runs, and the dtype it computes in."""
    from transformers import AutoConfig

    from benchmarks.common import smollm2_path, tiny_setup
    from miles_async.config.precision import cpu_has_bf16

    bf16_native = torch.cuda.is_available() or cpu_has_bf16()
    dtype = "bfloat16" if bf16_native else "float32"
    with tempfile.TemporaryDirectory() as tmp:
        tiny_model, data, _ = tiny_setup(Path(tmp), n_train=16)
        model = tiny_model if quick else smollm2_path()
        torch.set_num_threads(_threads())
        probes = Probes(measure_limits(AutoConfig.from_pretrained(model), s, bf16_native), s, dtype)
        phases = measure_step(model, data, s, dtype, between=probes, profile=profile)
        return phases, probes.best(), dtype


def run(quick: bool, out_dir: Path, settings: Settings | None = None) -> dict:
    s = settings or (QUICK if quick else FULL)
    phases, limits, dtype = measure(s, quick)
    rows = phase_rows(phases, limits)
    model_name = "tiny random model" if quick else "SmolLM2-135M"
    return {
        "settings": {**asdict(s), "dtypes": [dtype], "model": model_name, "threads": _threads()},
        "limits": limits,
        "phases": rows,
        **report(limits, rows, model_name, s, dtype, out_dir),
    }


# A step with one optimizer step and no KL penalty (the TRL peer's, the quickstart's) runs these phases: its old
# log-probs come from the training pass and it builds no reference model.
STEP_PHASES = ("prefill", "decode", "train fwd+bwd", "optimizer")


def step_bound(s: Settings) -> dict:
    """The roofline of a whole SmolLM2 step at ``s``'s shape: each of ``STEP_PHASES`` measured through our code
    (``s.reps`` timed runs, one counted, no profile) against the limits measured in the same process; the step's
    bound is the sum of its phases' bounds."""
    phases, limits, dtype = measure(s, quick=False, profile=False)
    rows = {r["phase"]: r for r in phase_rows(phases, limits) if r["phase"] in STEP_PHASES}
    return {
        "settings": asdict(s),
        "dtype": dtype,
        "peak": limits["peaks"][dtype],
        "bandwidth": limits["bandwidth"],
        "phases": {
            name: {k: r[k] for k in ("seconds", "bound_seconds", "fraction", "binding", "flops", "bytes")}
            for name, r in rows.items()
        },
        "seconds": sum(r["seconds"] for r in rows.values()),
        "bound_seconds": sum(r["bound_seconds"] for r in rows.values()),
    }


def headline(entry: dict) -> list[tuple[str, str]]:
    limits, rows = entry["limits"], entry["phases"]
    peak = ", ".join(
        f"{d} {_rate(v, 'FLOP')}" + (" (emulated)" if d in limits["emulated"] else "")
        for d, v in limits["peaks"].items()
    )
    out = [
        ("matmul peak (large square; bf16 where the CPU computes it)", peak),
        (
            "matmul at the step's shapes (best of MLP and output projection)",
            ", ".join(f"{d} {_rate(v, 'FLOP')}" for d, v in limits["step_shape_peaks"].items()),
        ),
        ("memory bandwidth (float32 triad)", _rate(limits["bandwidth"], "B")),
    ]
    for r in rows:
        limit = "matmul peak" if r["binding"] == "compute" else "bandwidth"
        out.append(
            (
                f"{r['phase']}: fraction of its roofline bound (goal {r['goal']:.0%})",
                f"{r['fraction']:.1%} of the {limit} ({_rate(r['achieved'], r['unit'])}, {r['seconds']:.3f} s)",
            )
        )
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--shape", type=shaped, default=None, help="the step's shape, ANSWERxGROUPxPROMPT (SmolLM2)")
    p.add_argument("--bound-json", type=Path, default=None, help="only the step's bound (step_bound), to this file")
    a = p.parse_args()
    if a.bound_json is not None:
        import json

        a.bound_json.write_text(json.dumps(step_bound(a.shape or FULL), indent=1) + "\n")
        sys.exit(0)
    result = run(a.quick, Path(tempfile.mkdtemp()), a.shape)
    from benchmarks.common import render_table

    for t in result["tables"]:
        print(render_table(t), "\n")
    print(*result["notes"], sep="\n")

"""Each speed lever of issue 34 against what it replaced, side by side in one run: the two ways alternate, on the
same model, batch and process, and each side's median counts.

    python -m benchmarks.levers [--quick] [--shapes 8x8x40 32x16x40] [--levers training-logprobs ...] [--record]
    python -m benchmarks.run --only levers

The levers, and what each is timed on (SmolLM2-135M through our own code: ``FSDPTrainActor`` and the embedded
engine's sampler; bf16 where the CPU computes it):

- **shared-prefix attention** (``backends/fsdp/prefix_attention.py``): the trainer's passes with the layout's
  attention computing only the blocks its mask opens, against HF's sdpa over the whole ``L x L`` mask; timed on
  the training forward and backward (optimizer step excluded) and on the log-prob pass;
- **chunked log-probs** (``FSDPTrainActor._forward``): the no-gradient log-prob pass projecting and reducing 256
  tokens at a time, against the ``[tokens x vocab]`` float32 logits of the whole micro-batch;
- **chunked training log-probs**: the training pass the same way, each chunk recomputed in the backward, against
  the whole micro-batch's logits (and their log-softmax and entropy terms) kept for the backward; timed on the
  training forward and backward, and the peak resident memory of the step above its start (``VmHWM``, reset
  before each round);
- **no old-log-prob pass** (``PolicyMixin.prepare``: one optimizer step per rollout, no KL): the step without the
  separate forward, against the step with it (the pass is timed in the same rounds);
- **fused AdamW** (``backends/fsdp/worker.make_optimizer``): torch's fused CPU kernel against its default
  (``foreach``) on the policy's parameters;
- **growing KV cache** (``inference/embedded/kv_cache.py``): the embedded engine's decode of a step's generation
  (every prompt GROUP times, ANSWER tokens each) with its cache appending into spare columns, against transformers'
  ``DynamicCache`` concatenating every step; at ENGINE_SHAPES unless ``--shapes`` says;
- **decode attention by matmuls** (``inference/embedded/decode_attention.py``): the same decode with a step's
  one-token attention as two matmuls, against HF's sdpa (torch's CPU flash kernel); float32 only;
- **inverse-CDF sampler** (``inference/embedded/sampling.draw``): one token per row of ``[rows x vocab]``
  probabilities, against ``torch.multinomial``;
- **answer slots as long as their answers** (``backends/shared_prefix.py``): the trainer's log-prob pass and training
  forward and backward on groups whose answers spread from 0.42 of the cap to the cap (a long tail), against the
  same answers each padded to the cap with untrained tokens, which is what slots padded to the longest answer cost;
- **torch.compile** of the policy's forward (a lever tried, not kept; at the first shape of a full run, or
  ``--compile``): the training pass compiled against eager, at one fixed batch shape (its best case), and the seconds
  that compiling took.

Each lever's shape is a step of 8 prompts (``ANSWERxGROUPxPROMPT`` as ``benchmarks/trl_peer_shapes.py`` names
them); the attention lever matters most where groups are large.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

ROUNDS, QUICK_ROUNDS = 3, 1
SHAPES, QUICK_SHAPES = ("8x8x40", "32x16x40"), ("4x4x12",)
# The engine's levers matter most where answers are long.
ENGINE_SHAPES = ("32x16x40", "128x8x40")
# The levers by name (--levers); torch.compile runs where asked (--compile), the sampler in every run.
TRAINER_LEVERS = ("attention", "chunked-logprobs", "training-logprobs", "fused-adamw", "tight-slots")
ENGINE_LEVERS = {"kv-cache": "growing KV cache", "decode-attention": "decode attention by matmuls"}
LEVERS = TRAINER_LEVERS + tuple(ENGINE_LEVERS)


def lever_row(lever: str, measured: str, shape: str, before: Sequence[float], after: Sequence[float]) -> dict:
    """One lever's before and after: the medians of their alternated rounds and the speed-up of the lever."""
    b, a = statistics.median(before), statistics.median(after)
    return {
        "lever": lever,
        "measured": measured,
        "shape": shape,
        "before": list(before),
        "after": list(after),
        "before_median": b,
        "after_median": a,
        "speedup": b / a if a > 0 else None,
    }


def verdict(row: dict) -> str:
    """Whether the lever beats what it replaced beyond the noise of its rounds, by the smaller of two exact
    two-sided p-values: the sign test on the rounds' pairs (the sides alternate, so each round pairs a before with
    an after under the same load) and, where the two sides' ranges separate, the chance of that under no difference
    (``2 / C(2n, n)``). Beyond noise at p <= 0.05: three rounds can never show it, six won of six can."""
    before, after = row["before"], row["after"]
    n = len(before)
    if n < 2:
        return "one round: no noise measured"
    won = sum(b > a for b, a in zip(before, after, strict=True))
    tail = sum(math.comb(n, i) for i in range(min(won, n - won) + 1))
    p = min(1.0, 2 * tail / 2**n)
    if max(after) < min(before) or max(before) < min(after):
        p = min(p, 2 / math.comb(2 * n, n))
    ratios = [b / a for b, a in zip(before, after, strict=True) if a > 0]
    spread = f"won {won} of {n} rounds, {min(ratios):.3f}-{max(ratios):.3f}x, p {p:.2g}"
    better = won > n - won
    if p > 0.05 and won in (0, n):
        return f"{'better' if better else 'worse'} in every round, too few rounds to tell from noise ({spread})"
    if p > 0.05:
        return f"within noise ({spread})"
    if row.get("unit"):
        return f"{'less' if better else 'more'} beyond noise ({spread})"
    return f"{'faster' if better else 'slower'} beyond noise ({spread})"


def alternate(before: Callable[[], Any], after: Callable[[], Any], rounds: int) -> tuple[list[float], list[float]]:
    """Seconds of ``rounds`` calls of each, alternating (one warm-up of each first), so both see the same load."""
    times: tuple[list[float], list[float]] = ([], [])
    for r in range(rounds + 1):
        for fn, out in ((before, times[0]), (after, times[1])):
            t0 = time.perf_counter()
            fn()
            if r:
                out.append(time.perf_counter() - t0)
    return times


# ---- the levers (I/O: real model, real actor) ----


def peak_above_start(fn: Callable[[], Any]) -> tuple[Any, float]:
    """``fn()`` and the most resident memory it added, in bytes: the peak (``VmHWM``, reset to the current size
    first through ``/proc/self/clear_refs``) less the resident size at its start."""
    from benchmarks.train_memory import status_kib

    Path("/proc/self/clear_refs").write_text("5")
    start = status_kib("VmRSS")
    out = fn()
    return out, (status_kib("VmHWM") - start) * 1024.0


def whole_logits_forward(actor: Any, model: Any, mb: Any, temperature: float = 1.0, with_entropy: bool = False):
    """``FSDPTrainActor._forward`` as it was before the chunked log-probs: the micro-batch's whole ``[B, R, V]``
    float32 logits, their log-probs and entropies taken from them at once (and, with a gradient, all kept for the
    backward)."""
    from miles_async.algorithms.losses import entropy_from_logits, logprobs_from_logits
    from miles_async.backends.fsdp.actor import response_hidden

    actor._route(mb)
    with actor._autocast():
        hidden, head = response_hidden(model, mb, actor.device, actor.module.config._attn_implementation)
        logits = head(hidden).float()
    logits = actor._sampled_logits(logits, temperature)
    logprobs = logprobs_from_logits(logits, mb.response_ids.to(actor.device))
    return logprobs, entropy_from_logits(logits) if with_entropy else None


def _attention(actor: Any, name: str) -> Callable[[], None]:
    def use() -> None:
        for model in (actor.module, actor.ref_model):
            if model is not None:
                model.set_attn_implementation(name)

    return use


def trainer_levers(
    model: Path,
    data: Path,
    shape: str,
    rounds: int,
    dtype: str,
    compile_forward: bool = False,
    levers: Sequence[str] = TRAINER_LEVERS,
) -> list[dict]:
    from benchmarks import roofline, train_step
    from benchmarks import roofline_core as rc
    from miles_async.backends.fsdp import prefix_attention
    from miles_async.backends.fsdp.prefix_attention import SHARED_PREFIX_SDPA

    s = roofline.shaped(shape)
    batch = roofline.step_batch(model, s)
    actor = roofline._actor(model, data, s, dtype, steps=4 * rounds + 8)
    idx = list(range(len(batch)))
    assert actor.module.config._attn_implementation == SHARED_PREFIX_SDPA, "--shared-prefix is on by default"
    rows = []
    rollout = iter(range(10**6))

    peaks: dict[str, list[float]] = {}

    def phase_rounds(variants: dict[str, Callable[[], None]]) -> dict[str, list[list[Any]]]:
        """The trainer's phases (``roofline_core.actor_phases``) under each variant, alternating; round 0 warms up.
        Each round's peak memory above its start goes to ``peaks``."""
        out: dict[str, list[list[Any]]] = {name: [] for name in variants}
        for r in range(rounds + 1):
            for name, setup in variants.items():
                setup()
                got, peak = peak_above_start(lambda: rc.actor_phases(actor, batch, next(rollout), "time"))
                if r:
                    out[name].append(got)
                    peaks.setdefault(name, []).append(peak)
        return out

    if "training-logprobs" in levers:
        # the training pass's whole logits against the chunks recomputed in the backward (the log-prob pass runs
        # whole too while the old way is set, unused here)
        whole = {
            "whole": lambda: setattr(actor, "_forward", lambda *a, **k: whole_logits_forward(actor, *a, **k)),
            "chunked": lambda: actor.__dict__.pop("_forward", None),
        }
        phases = phase_rounds(whole)
        before, after = ([p[2].seconds for p in phases[k]] for k in whole)
        rows.append(lever_row("chunked training log-probs", "train fwd+bwd", shape, before, after))
        row = lever_row(
            "chunked training log-probs", "peak memory of the step above its start, GB", shape,
            [b / 1e9 for b in peaks["whole"]], [a / 1e9 for a in peaks["chunked"]],
        )  # fmt: skip
        rows.append({**row, "unit": "GB"})
    if "attention" in levers:
        # shared-prefix attention: the trainer's phases with HF's sdpa, then split (forced: where it does not pay,
        # production keeps HF's, and this row shows why)
        prefix_attention.MIN_SCORE_RATIO, kept_ratio = 0.0, prefix_attention.MIN_SCORE_RATIO
        try:
            phases = phase_rounds(
                {"sdpa": _attention(actor, "sdpa"), SHARED_PREFIX_SDPA: _attention(actor, SHARED_PREFIX_SDPA)}
            )
        finally:
            prefix_attention.MIN_SCORE_RATIO = kept_ratio
        for i, what in ((2, "train fwd+bwd"), (0, "log-prob pass (no gradient)")):
            before = [p[i].seconds for p in phases["sdpa"]]
            after = [p[i].seconds for p in phases[SHARED_PREFIX_SDPA]]
            rows.append(lever_row("shared-prefix attention", what, shape, before, after))

        # no old-log-prob pass: the step with the separate forward against the step without it, from the same rounds
        ours = phases[SHARED_PREFIX_SDPA]
        rows.append(
            lever_row(
                "no old-log-prob pass",
                "log-prob pass + train fwd+bwd + optimizer",
                shape,
                [p[0].seconds + p[2].seconds + p[3].seconds for p in ours],
                [p[2].seconds + p[3].seconds for p in ours],
            )
        )

    if "chunked-logprobs" in levers:
        # chunked log-probs: the whole micro-batch's logits, against 256 tokens at a time
        def whole() -> None:
            with torch.no_grad():
                actor._per_sample(lambda mb: whole_logits_forward(actor, actor.module, mb)[0], batch, idx)

        before, after = alternate(whole, lambda: actor._logprobs_of(actor.module, batch, idx, 1.0), rounds)
        rows.append(lever_row("chunked log-probs", "log-prob pass (no gradient)", shape, before, after))

    if "fused-adamw" in levers:
        # fused AdamW: torch's default (foreach) against the fused kernel, on the policy's parameters and gradients
        params = [p for p in actor.module.parameters() if p.requires_grad]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        optimizers = [torch.optim.AdamW(params, lr=1e-9, **kind) for kind in ({"foreach": True}, {"fused": True})]
        before, after = alternate(optimizers[0].step, optimizers[1].step, max(rounds, 3))
        rows.append(lever_row("fused AdamW", "optimizer step", shape, before, after))

    if "tight-slots" in levers:
        # answer slots as long as their answers, against slots padded to the longest (as the layout was): the same
        # groups with a long tail of answer lengths under the cap, alternating with their padded copies; the
        # log-prob pass, then a training step (forward, backward, optimizer: the reference pass left out, it costs
        # what the log-prob pass does)
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(model).vocab_size
        groups = train_step.step_batch(vocab, 0, s.prompts, s.samples, s.prompt_len, s.response_len, as_groups=True)
        padded, tight = (train_step.uneven_batch(groups, s.response_len, pad) for pad in (True, False))
        every = list(range(len(padded)))

        def logprobs(b: Any) -> Callable[[], None]:
            def go() -> None:
                actor.module.eval()
                with torch.no_grad():
                    actor._logprobs_of(actor.module, b, every, 1.0)

            return go

        lengths = train_step.uneven_lengths(s.response_len, s.samples)
        answers = f" (answers {min(lengths)}-{max(lengths)} tokens, mean {statistics.fmean(lengths):.0f})"
        before, after = alternate(logprobs(padded), logprobs(tight), rounds)
        rows.append(lever_row("answer slots as long as their answers", "log-prob pass" + answers, shape, before, after))
        before, after = alternate(
            lambda: actor.train(next(rollout), padded), lambda: actor.train(next(rollout), tight), rounds
        )
        rows.append(lever_row("answer slots as long as their answers", "training step" + answers, shape, before, after))

    if compile_forward:
        # torch.compile of the policy's forward (its backward compiles with it); the batch keeps one shape, so this
        # is its best case: a run's answer lengths change the shapes every step.
        eager = actor.module.forward
        compiled = torch.compile(eager, dynamic=False)
        t0 = time.perf_counter()
        forwards = {"eager": eager, "compiled": compiled}
        compiled_phases = phase_rounds(
            {k: lambda f=f: setattr(actor.module, "forward", f) for k, f in forwards.items()}
        )
        actor.module.forward = eager
        row = lever_row(
            "torch.compile",
            "train fwd+bwd",
            shape,
            [p[2].seconds for p in compiled_phases["eager"]],
            [p[2].seconds for p in compiled_phases["compiled"]],
        )
        row["seconds_with_compiling"] = time.perf_counter() - t0
        row["measured"] += f" (these rounds, compiling included: {row['seconds_with_compiling']:.0f} s)"
        rows.append(row)
    return rows


def engine_lever(model: Path, shape: str, rounds: int, dtype: str, lever: str) -> dict:
    """The engine's decode of one step's generation at ``shape``, the lever off and on, alternating on one engine
    (``roofline_core.engine_phases``: every answer runs to its cap)."""
    from transformers import DynamicCache

    from benchmarks import roofline
    from benchmarks import roofline_core as rc
    from miles_async.inference.embedded import decode_attention, kv_cache
    from miles_async.inference.embedded.decode_attention import DECODE_SDPA
    from miles_async.inference.embedded.engine import Engine

    s = roofline.shaped(shape)
    batch = roofline.step_batch(model, s)
    prompts = [batch.tokens[i][: batch.prompt_lengths[i]] for i in range(0, len(batch), s.samples)]
    engine = Engine(str(model), dtype=getattr(torch, dtype), max_running_requests=s.prompts * s.samples)
    lm = engine.lm
    decode_attention.register()  # where the engine's default leaves it out
    variants: dict[str, Callable[[], None]] = {
        "kv-cache": {
            "before": lambda: setattr(lm, "new_cache", lambda: DynamicCache(config=lm.config)),
            "after": lambda: setattr(lm, "new_cache", lambda: kv_cache.new_cache(lm.config)),
        },
        "decode-attention": {
            "before": lambda: lm.model.set_attn_implementation("sdpa"),
            "after": lambda: lm.model.set_attn_implementation(DECODE_SDPA),
        },
    }[lever]
    engine.start()
    times: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for r in range(rounds + 1):
            for name, setup in variants.items():
                setup()
                decode = rc.engine_phases(engine, prompts, s.samples, s.response_len, "time")[1]
                print(f"[levers] {lever} {shape} round {r} {name}: {decode.seconds:.2f} s", file=sys.stderr, flush=True)
                if r:
                    times[name].append(decode.seconds)
    finally:
        engine.shutdown()
    return lever_row(ENGINE_LEVERS[lever], "decode of a step's generation", shape, times["before"], times["after"])


def sampler_lever(vocab: int, batch: int, rounds: int) -> dict:
    from miles_async.inference.embedded.sampling import draw

    probs = torch.softmax(torch.randn(batch, vocab), dim=-1)
    before, after = alternate(lambda: torch.multinomial(probs, 1), lambda: draw(probs, None), max(rounds, 5) * 4)
    return lever_row("inverse-CDF sampler", f"one token for each of {batch} rows", f"{batch}x{vocab}", before, after)


# ---- report ----


def split_used(shape: str) -> bool:
    """Whether production splits the shared-prefix attention at ``shape`` (``prefix_attention.worth_splitting``)."""
    from benchmarks.roofline import shaped
    from miles_async.backends.fsdp.prefix_attention import worth_splitting

    s = shaped(shape)
    return worth_splitting(s.prompt_len, s.samples, s.response_len)


def _lever_name(r: dict) -> str:
    if r["lever"] != "shared-prefix attention":
        return r["lever"]
    return r["lever"] + (" (used at this shape)" if split_used(r["shape"]) else " (not used at this shape)")


def summarize(rows: list[dict], rounds: int, model_name: str, dtype: str) -> dict:
    from benchmarks.common import table
    from miles_async.backends.fsdp.prefix_attention import MIN_SCORE_RATIO

    body = [
        [
            _lever_name(r),
            r["measured"],
            r["shape"],
            f"{r['before_median']:.3g} {r.get('unit', 's')}",
            f"{r['after_median']:.3g} {r.get('unit', 's')}",
            "-" if r["speedup"] is None else f"{r['speedup']:.2f}x",
            verdict(r),
        ]
        for r in rows
    ]
    return {
        "rows": rows,
        "tables": [
            table(
                f"Each lever against what it replaced, {model_name}, {dtype}: medians, the two ways alternating in one "
                "process",
                ["lever", "measured", "shape", "before", "after", "before / after", "verdict"],
                body,
                f"{rounds} rounds each after a warm-up (the sampler and the optimizer more: they take milliseconds); "
                "shapes ANSWERxGROUPxPROMPT, 8 prompts a step; the shared-prefix attention split wherever measured, "
                f"used where the dense layout has at least {MIN_SCORE_RATIO:g}x its scores",
            )
        ],
    }


def run(
    quick: bool,
    out_dir: Path,
    shapes: Sequence[str] | None = None,
    compile_forward: bool | None = None,
    levers: Sequence[str] = LEVERS,
    rounds: int | None = None,
    dtype: str | None = None,
) -> dict:
    """benchmarks.run's entry: the levers at SHAPES (quick: a tiny model at QUICK_SHAPES), torch.compile at the first
    shape of a full run (``compile_forward``: whether to, whatever the mode); ``levers``: the trainer's to run;
    ``dtype``: bfloat16 where the CPU computes it, else float32, unless given (decode attention acts in float32
    only)."""
    compile_forward = not quick if compile_forward is None else compile_forward
    from transformers import AutoConfig

    from benchmarks.common import smollm2_path, tiny_setup
    from miles_async.config.precision import cpu_has_bf16

    dtype = dtype or ("bfloat16" if cpu_has_bf16() else "float32")
    rounds = rounds or (QUICK_ROUNDS if quick else ROUNDS)
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        tiny_model, data, _ = tiny_setup(Path(tmp), n_train=16)
        model = tiny_model if quick else smollm2_path()
        if set(levers) & set(TRAINER_LEVERS):
            for i, shape in enumerate(shapes or (QUICK_SHAPES if quick else SHAPES)):
                # torch.compile at the first shape only: compiling takes minutes on 2 cores
                rows += trainer_levers(model, data, shape, rounds, dtype, compile_forward and i == 0, levers)
        for lever in (name for name in ENGINE_LEVERS if name in levers):
            for shape in shapes or (QUICK_SHAPES if quick else ENGINE_SHAPES):
                rows.append(engine_lever(model, shape, rounds, dtype, lever))
        rows.append(sampler_lever(AutoConfig.from_pretrained(model).vocab_size, 64, rounds))
    return {**summarize(rows, rounds, "tiny random model" if quick else "SmolLM2-135M", dtype), "dtype": dtype}


def headline(entry: dict) -> list[tuple[str, str]]:
    return [
        (
            f"lever: {_lever_name(r)}, {r['measured']} ({r['shape']}{', ' + r['dtype'] if 'dtype' in r else ''})",
            f"{r['before_median']:.3g} {r.get('unit', 's')} -> {r['after_median']:.3g} {r.get('unit', 's')} "
            f"({r['speedup']:.2f}x; {verdict(r)})",
        )
        for r in entry["rows"]
    ]


def main(argv: list[str] | None = None) -> int:
    from benchmarks import record
    from benchmarks.common import machine_info, render_table
    from benchmarks.run import measured

    argv = sys.argv[1:] if argv is None else argv

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shapes", nargs="+", default=None, metavar="SHAPE", help="e.g. 8x8x40 32x16x40")
    ap.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile of the policy's forward at the first shape (minutes; default: in a full run)",
    )
    ap.add_argument(
        "--levers",
        nargs="+",
        choices=LEVERS,
        default=list(LEVERS),
        help="the levers to run (default: all; the sampler's runs in every run)",
    )
    ap.add_argument("--out", type=Path, default=None, help="a folder for the rows' results.json")
    ap.add_argument(
        "--record",
        action="store_true",
        help="store the run in benchmarks/results/results.json (stamped with this command; it replaces the levers "
        "entry of this machine and precision only)",
    )
    ap.add_argument("--rounds", type=int, default=None, help=f"rounds of each side (default {ROUNDS}; quick 1)")
    ap.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default=None,
        help="default: bfloat16 where the CPU computes it, else float32 (decode attention acts in float32 only)",
    )
    args = ap.parse_args(argv)
    machine = machine_info()
    result = measured(
        lambda: run(
            args.quick, Path(tempfile.mkdtemp()), args.shapes, args.compile, args.levers, args.rounds, args.dtype
        ),
        args.quick,
        machine,
    )
    if args.record:
        results = record.load()
        key = record.put(results, "levers", result, record.command_line("benchmarks.levers", argv), machine)
        record.save(results)
        print(f"recorded in {record.RESULTS} as {key!r}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    for t in result["tables"]:
        print(render_table(t), "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())

"""The TRL peer over a set of task shapes: seconds per step of train_async.py and of TRL's GRPOTrainer when the
answers are longer, the groups smaller or larger, or the prompts longer than the quickstart's.

    python -m benchmarks.trl_peer_shapes [--steps 10] [--only 32x4x40 ...] [--out DIR]
    python -m benchmarks.run --only trl_peer_shapes [--quick]

Each shape (answer tokens, group size, prompt tokens) runs both sides as ``benchmarks/trl_peer.py`` does (TRL's
runner follows our launcher's own flags; both train on the same prompts in the same order, at the same precision),
ours ``--synchronous`` (on-policy, as TRL is), 8 prompts a step, 10 steps a side, a held-out eval before the first
step and after the last (one sample a prompt: accuracy is not the point here; both sides take evals out of the
clock). The prompts are the quickstart's multiplication questions:

- answers of 32 tokens or more ask for the working (``Explain your steps, then give the number.``) so that the
  answers use the length they are given; the quickstart's ask for the bare number and end in a few tokens;
- ~300-token prompts carry a preamble of worked additions (the same for every prompt, so shared-prefix training
  shares it within a group as it would a long system prompt).

Reported per shape: the median seconds per step of each side, their ratio against the 5x goal, and the mean answer
and prompt lengths each side ran (sampled answers end at EOS, so the answer token count is a cap). Where TRL's steps
take many minutes each (``Shape.trl_steps``), TRL runs the first few of our steps' prompts, and its median is of
those. Each shape also gets the roofline of our step (``benchmarks/roofline.py``'s ``step_bound``: the least time
its prefill, decode, training and optimizer step can take on this machine, at the run's mean lengths), so that a
missed goal says how close to that bound the goal would need our step to run.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.common import finish_stamp, kept_machine, median, ran_stamp, table
from benchmarks.trl_peer import prepare_assets, run_kept
from benchmarks.trl_peer_report import ratio

GOAL = 5.0
STEPS, QUICK_STEPS = 10, 2
PROMPTS_PER_STEP = 8
LONG_PROMPT = 300
# Worked additions in the long prompts' preamble: ~13 tokens each with SmolLM2's tokenizer, so 20 of them and the
# chat template's ~44 make ~300.
PREAMBLE_EXAMPLES = 20
_BARE_NUMBER = re.compile(r"(Answer with just|Reply with only|Give only) the (final )?number\.$")
WORKING = "Explain your steps, then give the number."


@dataclass(frozen=True)
class Shape:
    answer: int  # --rollout-max-response-len
    group: int  # --n-samples-per-prompt
    prompt: int  # prompt tokens, roughly (40: the quickstart's; 300: with the preamble)
    trl_steps: int | None = None  # TRL's steps where they take many minutes each; None: as many as ours
    max_tokens: int | None = None  # --max-tokens-per-gpu (both sides) where the default's micro-batch is too big

    @property
    def name(self) -> str:
        return f"{self.answer}x{self.group}x{self.prompt}"

    def launcher_args(self) -> list[str]:
        return [
            "--synchronous",
            "--rollout-batch-size",
            str(PROMPTS_PER_STEP),
            "--n-samples-per-prompt",
            str(self.group),
            "--rollout-max-response-len",
            str(self.answer),
            "--eval-max-response-len",
            str(self.answer),
            "--n-samples-per-eval-prompt",
            "1",
            *(["--max-tokens-per-gpu", str(self.max_tokens)] if self.max_tokens else []),
        ]


# TRL's steps at the long shapes take minutes each on 2 cores (its first at 32x8x300 ran past 13 minutes with the
# 64 rows of ~330 tokens in one micro-batch, before the runner took our token budget): their medians are of fewer.
SHAPES = (
    Shape(8, 8, 40),
    Shape(32, 4, 40),
    Shape(32, 16, 40),
    # At the default 8,192 tokens a micro-batch, 7 groups of 8 answers of up to 128 tokens took our trainer to
    # 20 GB and out of memory on a 24 GB machine (not profiled: their float32 logits are 1.4 GB a copy).
    Shape(128, 8, 40, trl_steps=3, max_tokens=4096),
    Shape(32, 8, 300, trl_steps=3),
)
QUICK_SHAPES = (Shape(8, 2, 40), Shape(16, 2, 300))


# ---- the prompts (pure) ----


def preamble(examples: int = PREAMBLE_EXAMPLES, seed: int = 0) -> str:
    rng = random.Random(seed)
    worked = " ".join(
        f"{a} + {b} = {a + b}." for a, b in ((rng.randint(10, 99), rng.randint(10, 99)) for _ in range(examples))
    )
    return f"Worked examples of addition, for practice: {worked}\n\n"


def shaped_prompt(prompt: str, shape: Shape) -> str:
    """The quickstart prompt ``prompt`` as ``shape`` asks it: the working asked for when answers may be long, the
    preamble in front when prompts are long."""
    if shape.answer >= 32:
        asked, n = _BARE_NUMBER.subn(WORKING, prompt)
        if n != 1:
            raise ValueError(f"no bare-number request to replace in the prompt {prompt!r}")
        prompt = asked
    return (preamble() if shape.prompt >= LONG_PROMPT else "") + prompt


def write_shaped_data(source: Path, shape: Shape, out: Path) -> Path:
    """train.jsonl and eval.jsonl of ``source`` with every prompt shaped; labels and uids kept."""
    out.mkdir(parents=True, exist_ok=True)
    for split in ("train.jsonl", "eval.jsonl"):
        rows = [json.loads(x) for x in (source / split).read_text().splitlines() if x.strip()]
        (out / split).write_text(
            "".join(json.dumps({**r, "prompt": shaped_prompt(r["prompt"], shape)}) + "\n" for r in rows)
        )
    return out


def prompt_tokens(model: Path, data: Path) -> float:
    """Mean prompt length in tokens, chat template included, over the shaped train split."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    rows = [json.loads(x) for x in (data / "train.jsonl").read_text().splitlines() if x.strip()]
    texts = [
        tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True, tokenize=False)
        for r in rows
    ]
    return sum(len(tok(t)["input_ids"]) for t in texts) / len(texts)


# ---- the result (pure) ----


def _mean(xs: Sequence[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def shape_row(shape: Shape, raw: dict) -> dict:
    """The shape's medians and ratio; with its roofline (``raw["roofline"]``, ``roofline.step_bound``), the least
    time our step's phases can take here, the fraction of it our step reaches, and the fraction it would need for
    the goal (our step at TRL's over ``GOAL``)."""
    ours, trl = median(raw["ours"]["step_seconds"]), median(raw["trl"]["step_seconds"])
    row = {
        "shape": shape.name,
        "answer": shape.answer,
        "group": shape.group,
        "prompt_tokens": raw["prompt_tokens"],
        "ours_median": ours,
        "trl_median": trl,
        "ratio": ratio(trl, ours),
        "ours_steps": len(raw["ours"]["step_seconds"]),
        "trl_steps": len(raw["trl"]["step_seconds"]),
        "ours_answer_tokens": _mean(raw["ours"]["response_len_mean"]),
        "trl_answer_tokens": _mean(raw["trl"]["response_len_mean"]),
    }
    bound = raw.get("roofline")
    if bound is not None:
        row["roofline"] = bound
        row["bound_seconds"] = bound["bound_seconds"]
        row["ours_fraction"] = bound["bound_seconds"] / ours
        row["goal_fraction"] = bound["bound_seconds"] * GOAL / trl
    return row


def roofline_settings(shape: Shape, raw: dict) -> Any:
    """The roofline's step at the lengths the shape's run had: its mean prompt and our mean answer, rounded."""
    from benchmarks.roofline import FULL

    answer = max(1, round(_mean(raw["ours"]["response_len_mean"]) or shape.answer))
    return replace(
        FULL, prompts=PROMPTS_PER_STEP, samples=shape.group, prompt_len=round(raw["prompt_tokens"]), response_len=answer
    )


def _n(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _steps(r: dict, steps: int) -> str:
    """The median's step counts where a side ran other than ``steps``."""
    if r["ours_steps"] == r["trl_steps"] == steps:
        return ""
    return f" ({r['ours_steps']} / {r['trl_steps']} steps)"


def _miss_note(r: dict) -> str:
    b = r["roofline"]
    phases = ", ".join(
        f"{name} {p['seconds']:.1f} s ({p['fraction']:.0%} of its {p['bound_seconds']:.2f} s)"
        for name, p in b["phases"].items()
    )
    return (
        f"{r['shape']}: {GOAL:.0f}x TRL's {r['trl_median']:.1f} s needs our step at {r['trl_median'] / GOAL:.1f} s, "
        f"{r['goal_fraction']:.0%} of the least time its phases can take here ({r['bound_seconds']:.1f} s at "
        f"{b['peak'] / 1e9:.0f} GFLOP/s and {b['bandwidth'] / 1e9:.0f} GB/s); it runs at {r['ours_fraction']:.0%}. "
        f"Its phases in the roofline's run ({b['seconds']:.1f} s in all): {phases}."
    )


def summarize(rows: Sequence[dict], steps: int) -> dict:
    body = [
        [
            r["shape"],
            f"{r['answer']} / {r['group']} / {r['prompt_tokens']:.0f}",
            _n(r["ours_median"], ".1f"),
            _n(r["trl_median"], ".1f") + _steps(r, steps),
            _n(r["ratio"], ".2f") + "x",
            f"{_n(r['ours_answer_tokens'], '.1f')} / {_n(r['trl_answer_tokens'], '.1f')}",
            _n(r.get("bound_seconds"), ".1f"),
            _pct(r.get("ours_fraction")),
            _pct(r.get("goal_fraction")),
            "met" if r["ratio"] is not None and r["ratio"] >= GOAL else "missed",
        ]
        for r in rows
    ]
    missed = [r for r in rows if "roofline" in r and (r["ratio"] is None or r["ratio"] < GOAL)]
    return {
        "steps": steps,
        "shapes": list(rows),
        "tables": [
            table(
                f"Seconds per step by task shape, train_async.py (--synchronous) vs TRL GRPOTrainer, median of {steps} "
                "steps a side unless said",
                [
                    "shape",
                    "answer cap / group / prompt tokens",
                    "ours s/step",
                    "TRL s/step",
                    "TRL / ours",
                    "answer tokens, ours / TRL",
                    "our step's bound s",
                    "ours at, of the bound",
                    f"{GOAL:.0f}x needs, of the bound",
                    f"goal {GOAL:.0f}x",
                ],
                body,
                "8 prompts a step; prompt tokens: the train split's mean with the chat template; answer tokens: the "
                "mean sampled length (answers end at EOS or the cap); our step's bound: the roofline's least time for "
                "its prefill, decode, training and optimizer step at this shape (benchmarks/roofline.py's "
                "step_bound, at the run's mean prompt and answer lengths), and the fractions of it our step reaches "
                f"and would need for {GOAL:.0f}x",
            )
        ],
        "notes": [_miss_note(r) for r in missed],
    }


def _headline_result(r: dict, steps: int) -> str:
    out = f"{r['ours_median']:.1f} s vs {r['trl_median']:.1f} s{_steps(r, steps)} ({r['ratio']:.2f}x; goal {GOAL:.0f}x)"
    if "roofline" in r and r["ratio"] < GOAL:
        out += (
            f"; our step at {r['ours_fraction']:.0%} of its roofline bound ({r['bound_seconds']:.1f} s), "
            f"{GOAL:.0f}x needs {r['goal_fraction']:.0%}"
        )
    return out


def headline(entry: dict) -> list[list[str]]:
    return [
        [
            f"seconds per step, train_async.py vs TRL GRPOTrainer, SmolLM2-135M, shape {r['shape']} (answer cap x "
            "group x prompt tokens)",
            _headline_result(r, entry["steps"]),
        ]
        for r in entry["shapes"]
    ]


# ---- running (I/O) ----


def step_bound_apart(s: Any) -> dict:
    """``roofline.step_bound`` at ``s`` in a process of its own: its model, engine and trainer (~6 GB at SmolLM2)
    leave with it, where in this one they stayed through the next shape's runs (which then ran out of memory)."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bound.json"
        shape = f"{s.response_len}x{s.samples}x{s.prompt_len}"
        cmd = [sys.executable, "-m", "benchmarks.roofline", "--shape", shape, "--bound-json", str(out)]
        subprocess.run(cmd, check=True, cwd=Path(__file__).resolve().parents[1], timeout=3600)
        return json.loads(out.read_text())


def _kept(path: Path, shape: Shape, steps: int) -> dict | None:
    """The raw result kept at ``path`` if it ran this shape's flags for ``steps`` steps (TRL: the shape's own count
    where it has one)."""
    if not path.exists():
        return None
    raw = json.loads(path.read_text())
    full = len(raw["ours"]["step_seconds"]) == steps and len(raw["trl"]["step_seconds"]) == (shape.trl_steps or steps)
    return raw if raw.get("launcher_args") == shape.launcher_args() and full else None


def measure(shapes: Sequence[Shape], steps: int, work: Path, roofline: bool = True, run_missing: bool = True) -> dict:
    """Each shape's raw result is kept in ``work``/SHAPE.json with the commit and date it ran at; one kept there with
    the same flags and steps is read instead of run again (the set takes hours on 2 cores: a cut run goes on where
    it stopped, and a shape can be run alone first). ``roofline``: each shape's step bound (SmolLM2), measured once
    and kept with it. Without ``run_missing``, a shape with no kept result is named in the notes, not run."""
    model, data = prepare_assets()
    rows, ran, missing = [], [], []
    for shape in shapes:
        path = work / f"{shape.name}.json"
        raw = _kept(path, shape, steps)
        if raw is None and not run_missing:
            missing.append(shape.name)
            continue
        if raw is None:
            shaped = write_shaped_data(data, shape, work / shape.name)
            print(f"[trl_peer_shapes] shape {shape.name}", file=sys.stderr, flush=True)
            stamp = ran_stamp()
            trl_steps = min(shape.trl_steps, steps) if shape.trl_steps else None
            raw = run_kept(steps, steps, shape.launcher_args(), shaped, trl_steps)
            raw["prompt_tokens"] = prompt_tokens(model, shaped)
            raw["ran"] = finish_stamp(stamp)
            path.write_text(json.dumps(raw, indent=1) + "\n")
        if roofline and "roofline" not in raw:
            print(f"[trl_peer_shapes] shape {shape.name}: the roofline of our step", file=sys.stderr, flush=True)
            stamp = ran_stamp()
            raw["roofline"] = {**step_bound_apart(roofline_settings(shape, raw)), "ran": finish_stamp(stamp)}
            path.write_text(json.dumps(raw, indent=1) + "\n")
        rows.append(shape_row(shape, raw))
        ran.append(raw.get("ran"))
    entry = summarize(rows, steps)
    entry["notes"] += [
        f"{name}: not measured yet (python -m benchmarks.trl_peer_shapes --only {name})" for name in missing
    ]
    if all(ran):
        entry["machine"] = kept_machine(ran)
    return entry


def run(quick: bool, out_dir: Path) -> dict:
    """benchmarks.run's entry: the five shapes, 10 steps a side, each shape's raw result kept in
    ``out_dir``/trl_peer_shapes_runs/ (and read back when its flags match); quick: two small shapes, 2 steps a side,
    in ``out_dir``/trl_peer_shapes_quick/."""
    if quick:
        return measure(QUICK_SHAPES, QUICK_STEPS, out_dir / "trl_peer_shapes_quick", roofline=False)
    return measure(SHAPES, STEPS, out_dir / "trl_peer_shapes_runs")


def main(argv: list[str] | None = None) -> int:
    from benchmarks.common import RECORD_HELP, write_entry

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=STEPS, help="steps a side for each shape")
    ap.add_argument("--only", nargs="+", default=None, metavar="SHAPE", help="shapes by name, e.g. 32x4x40")
    ap.add_argument("--out", type=Path, default=Path("outputs/trl_peer_shapes"))
    ap.add_argument("--record", action="store_true", help=RECORD_HELP)
    ap.add_argument("--no-roofline", action="store_true", help="skip each shape's step bound (run it later)")
    ap.add_argument("--kept-only", action="store_true", help="sum up the kept shapes; run none")
    args = ap.parse_args(argv)
    by_name = {s.name: s for s in SHAPES}
    unknown = sorted(set(args.only or ()) - set(by_name))
    if unknown:
        ap.error(f"--only {' '.join(unknown)}: the shapes are {', '.join(by_name)}")
    picked = [by_name[n] for n in args.only] if args.only else SHAPES
    entry = measure(picked, args.steps, args.out, roofline=not args.no_roofline, run_missing=not args.kept_only)
    write_entry(entry, args.out, "trl_peer_shapes" if args.record else None, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())

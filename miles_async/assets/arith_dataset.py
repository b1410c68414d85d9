"""Arithmetic prompt datasets with exact integer labels for RL post-training.

Each record is ``{"prompt": str, "label": str, "uid": str}``; ``prompt`` is the
plain user message (the trainer applies the chat template) and ``label`` the
decimal answer. Train and eval are split on the *unordered* operand pair, so
eval measures problems the policy never got a reward on (``3 * 7`` and
``7 * 3`` always land on the same side).

Every template explicitly asks for the bare number. SmolLM2-135M-Instruct
mostly knows the single-digit table but habitually echoes the equation
("7 * 8 = 56") or rambles. Measured on the seed-0 eval split (bf16, max 32
new tokens): greedy, the last integer is right 55% of the time but the first
only 10%; sampled at temperature 1 they drop to 27% and 11%. Either way the
knowledge for a much higher score is already there, so RL has a reachable
target: format (answer first, stop early) plus sharper recall.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path

Record = dict[str, str]

MUL_TEMPLATES: tuple[str, ...] = (
    "What is {a} * {b}? Answer with just the number.",
    "What is {a} times {b}? Answer with just the number.",
    "Compute {a} * {b}. Reply with only the number.",
    "Multiply {a} by {b}. Give only the final number.",
)

ADD_TEMPLATES: tuple[str, ...] = (
    "What is {a} + {b}? Answer with just the number.",
    "What is {a} plus {b}? Answer with just the number.",
    "Compute {a} + {b}. Reply with only the number.",
    "Add {a} and {b}. Give only the final number.",
)

# 0 is left out: "x * 0" needs no multiplication knowledge, and the model's
# habitual echo "0 * 5 = 0" already earns a first-integer reward, which
# rewards the very format RL should unlearn. 1 stays: "7 * 1" has the same
# echo problem but is what keeps the base accuracy above zero (on 2..9 the
# base first-integer accuracy is ~0-2%), so GRPO sees some success early.
MUL_OPERANDS = range(1, 10)
ADD_OPERANDS = range(10, 100)


def _split_pairs(
    pairs: Sequence[tuple[int, int]],
    eval_fraction: float,
    rng: random.Random,
    difficulty: Callable[[int, int], int],
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Hold out one random pair from each run of similar difficulty.

    With only 45 pairs a plain shuffle can easily put three "1 * x" facts
    into a 9-pair eval set and make the benchmark look easier than training;
    stratifying on the result keeps eval's difficulty in line with train's.
    """
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    ranked = sorted(pairs, key=lambda p: (difficulty(*p), rng.random()))
    n_eval = min(len(ranked) - 1, max(1, round(eval_fraction * len(ranked))))
    eval_pairs = []
    for i in range(n_eval):
        stratum = ranked[i * len(ranked) // n_eval : (i + 1) * len(ranked) // n_eval]
        eval_pairs.append(rng.choice(stratum))
    held = set(eval_pairs)
    return sorted(p for p in pairs if p not in held), sorted(held)


def _records(
    pairs: Sequence[tuple[int, int]],
    templates: Sequence[str],
    op: Callable[[int, int], int],
    task: str,
) -> list[Record]:
    out = []
    for lo, hi in pairs:
        orders = [(lo, hi)] if lo == hi else [(lo, hi), (hi, lo)]
        for a, b in orders:
            for k, template in enumerate(templates):
                out.append({"prompt": template.format(a=a, b=b), "label": str(op(a, b)), "uid": f"{task}-{a}-{b}-t{k}"})
    return out


def write_records(records: Sequence[Record], path: Path) -> Path:
    """Write records as JSONL, or Parquet when ``path`` ends in ``.parquet``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        columns = ("prompt", "label", "uid")
        table = pa.table({c: pa.array([r[c] for r in records], type=pa.string()) for c in columns})
        pq.write_table(table, path)
    else:
        with open(path, "w") as fh:
            for r in records:
                fh.write(json.dumps(r) + "\n")
    return path


def read_records(path: Path) -> list[Record]:
    """Read records written by :func:`write_records` (JSONL or Parquet)."""
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def write_splits(
    out_dir: Path, train: Sequence[Record], eval_: Sequence[Record], parquet: bool = False
) -> tuple[Path, Path]:
    """Write ``train.jsonl``/``eval.jsonl`` (plus ``.parquet`` twins if asked); return the JSONL paths."""
    out_dir = Path(out_dir)
    if parquet:
        write_records(train, out_dir / "train.parquet")
        write_records(eval_, out_dir / "eval.parquet")
    return write_records(train, out_dir / "train.jsonl"), write_records(eval_, out_dir / "eval.jsonl")


def make_multiplication_dataset(
    out_dir: Path,
    seed: int = 0,
    eval_fraction: float = 0.2,
    templates: Sequence[str] = MUL_TEMPLATES,
    parquet: bool = False,
) -> tuple[Path, Path]:
    """Single-digit ``a * b`` (a, b in 1..9), split on the unordered pair.

    Both operand orders and every template are emitted for each pair, on both
    sides, so the splits differ only in which facts they ask about: 81 ordered
    facts x 4 templates = 324 prompts, of which the 9 held-out pairs (at the
    default eval_fraction) give 60-68 eval prompts depending on how many
    squares they include.
    """
    rng = random.Random(seed)
    pairs = [(a, b) for a in MUL_OPERANDS for b in MUL_OPERANDS if a <= b]
    mul = lambda a, b: a * b  # noqa: E731
    train_pairs, eval_pairs = _split_pairs(pairs, eval_fraction, rng, mul)
    return write_splits(
        out_dir,
        _records(train_pairs, templates, mul, "mul"),
        _records(eval_pairs, templates, mul, "mul"),
        parquet=parquet,
    )


def make_addition_dataset(
    out_dir: Path,
    seed: int = 0,
    eval_fraction: float = 0.2,
    max_train: int | None = 2000,
    max_eval: int | None = 200,
    templates: Sequence[str] = ADD_TEMPLATES,
    parquet: bool = False,
) -> tuple[Path, Path]:
    """Two-digit ``a + b`` (a, b in 10..99), split on the unordered pair.

    There are 4095 unordered pairs, so unlike multiplication each prompt gets
    one random template and the splits are subsampled to ``max_train`` /
    ``max_eval`` prompts (``None`` keeps everything).
    """
    rng = random.Random(seed)
    pairs = [(a, b) for a in ADD_OPERANDS for b in ADD_OPERANDS if a <= b]
    train_pairs, eval_pairs = _split_pairs(pairs, eval_fraction, rng, lambda a, b: a + b)

    def records(split_pairs: list[tuple[int, int]], cap: int | None) -> list[Record]:
        ordered = [(a, b) for lo, hi in split_pairs for a, b in ({(lo, hi), (hi, lo)})]
        ordered.sort()
        rng.shuffle(ordered)
        if cap is not None:
            ordered = ordered[:cap]
        out = []
        for a, b in ordered:
            k = rng.randrange(len(templates))
            out.append({"prompt": templates[k].format(a=a, b=b), "label": str(a + b), "uid": f"add-{a}-{b}-t{k}"})
        return out

    return write_splits(out_dir, records(train_pairs, max_train), records(eval_pairs, max_eval), parquet=parquet)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write arithmetic train/eval prompt splits.")
    parser.add_argument("--task", choices=("mul", "add"), default="mul")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-fraction", type=float, default=0.2)
    parser.add_argument(
        "--format",
        choices=("jsonl", "parquet"),
        default="jsonl",
        help="parquet writes train/eval.parquet in addition to the JSONL files",
    )
    args = parser.parse_args(argv)
    make = make_multiplication_dataset if args.task == "mul" else make_addition_dataset
    train, eval_ = make(args.out, seed=args.seed, eval_fraction=args.eval_fraction, parquet=args.format == "parquet")
    print(train)
    print(eval_)


if __name__ == "__main__":
    main()

"""The example's prompts: three-digit by two-digit multiplication, a product SmolLM2-135M-Instruct does not
compute reliably alone but always gets with the calculator.

SmolLM2's chat template has no tool role and does not render ``tools=``, so each prompt is a chat (a list of
messages): a system message that describes the calculator, two worked examples as earlier turns (a call in the
exact format ``rollout.tools.parse_tool_calls`` reads, the tool's response, the answer), then the question.
Train and eval are split on the operand pair, so eval asks only problems the policy was never rewarded on.

    python -m examples.tool_calculator.data --out DIR   # writes DIR/train.jsonl and DIR/eval.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'
SYSTEM = (
    "You have a calculator tool. To use it, reply with only a tool call. "
    "The result comes back in <tool_response> tags. Then reply with just the final number."
)
# Worked examples, as earlier turns of the chat. Measured with transformers on SmolLM2-135M-Instruct at
# temperature 1: with the format only described in the system message (even with a sample call in it) 0 of 20
# replies were a tool call; with one worked example the model mostly imitates the tool's response itself; with
# two, the untrained model calls the tool in about a fifth of its replies (19% of the held-out samples).
EXAMPLES = ((123, 45), (618, 72))
QUESTIONS = (
    "What is {a} * {b}?",
    "What is {a} times {b}?",
    "Compute {a} * {b}.",
    "Multiply {a} by {b}.",
)


def worked_example(a: int, b: int) -> list[dict]:
    """One solved problem in the exact format ``rollout.multi_turn`` produces: call, tool response, answer."""
    return [
        {"role": "user", "content": QUESTIONS[0].format(a=a, b=b)},
        {"role": "assistant", "content": CALL % f"{a} * {b}"},
        {"role": "user", "content": f"<tool_response>\n{a * b}\n</tool_response>"},
        {"role": "assistant", "content": str(a * b)},
    ]


def record(a: int, b: int, template: int) -> dict:
    messages = [{"role": "system", "content": SYSTEM}]
    for x, y in EXAMPLES:
        messages += worked_example(x, y)
    messages.append({"role": "user", "content": QUESTIONS[template].format(a=a, b=b)})
    return {"prompt": messages, "label": str(a * b), "uid": f"mul-{a}-{b}-t{template}"}


def make_dataset(out_dir: Path, seed: int = 0, n_train: int = 2000, n_eval: int = 64) -> tuple[Path, Path]:
    """``n_train`` and ``n_eval`` prompts ``a * b`` with a in 100..999 and b in 10..99, no pair on both sides."""
    if n_train < 1 or n_eval < 1:
        raise ValueError(f"n_train and n_eval must be at least 1, got {n_train} and {n_eval}")
    rng = random.Random(seed)
    pairs: set[tuple[int, int]] = set()
    while len(pairs) < n_train + n_eval:
        pair = (rng.randint(100, 999), rng.randint(10, 99))
        if pair not in EXAMPLES:
            pairs.add(pair)
    ordered = sorted(pairs)
    rng.shuffle(ordered)
    splits = {"eval": ordered[:n_eval], "train": ordered[n_eval:]}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in ("train", "eval"):
        path = out_dir / f"{name}.jsonl"
        with open(path, "w") as fh:
            for a, b in splits[name]:
                fh.write(json.dumps(record(a, b, rng.randrange(len(QUESTIONS)))) + "\n")
        paths.append(path)
    return paths[0], paths[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write the tool-calculator example's train/eval prompts.")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n-train", type=int, default=2000)
    parser.add_argument("--n-eval", type=int, default=64)
    args = parser.parse_args(argv)
    for path in make_dataset(args.out, args.seed, args.n_train, args.n_eval):
        print(path)


if __name__ == "__main__":
    main()

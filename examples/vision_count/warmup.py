"""Supervised training on the labelled images (``sft.jsonl``), and the accuracy of a model on held-out images.

Two uses, one loop:
- the warm-up that gives the RL run a policy which sees something: a fixed number of steps from the built model
  (``--steps``), stopped well short of solving the task;
- the RL run's control: the same training continued from the warm-up for the RL run's wall time
  (``--minutes``), so the comparison is "RL" against "more of what came before it", in equal time.

The language model is frozen (it already answers with a digit); the vision tower, trained from scratch, and its
merger learn. Every prompt has the same tokens but for its image (one question, 112x112 images of 16 tokens), so
a batch needs no padding.

    python -m examples.vision_count.warmup --model IN --data DIR --out OUT (--steps N | --minutes M) [--seed S]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

# The warm-up's budget (the docs page states it): steps of BATCH labelled images, at LR.
BATCH = 16
LR = 1e-3
WARMUP_STEPS = 300


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Counter:
    """The model, its processor and the encoded examples of one data folder."""

    def __init__(self, model_dir: Path, data_dir: Path):
        import torch
        from PIL import Image

        from miles_async.vision.hf import chat_messages, load_processor, model_class

        self.processor = load_processor(str(model_dir))
        self.model = model_class(str(model_dir)).from_pretrained(str(model_dir), dtype=torch.float32)
        tok = self.processor.tokenizer
        self.digits = [tok.convert_tokens_to_ids(str(d)) for d in range(10)]
        self.end = tok.convert_tokens_to_ids("<|im_end|>")

        def encode(name: str) -> dict[str, Any]:
            recs = _records(data_dir / f"{name}.jsonl")
            images = [Image.open(data_dir / r["images"][0]).convert("RGB") for r in recs]
            text = self.processor.apply_chat_template(
                chat_messages(recs[0]["prompt"], 1), add_generation_prompt=True, tokenize=False
            )
            enc = self.processor(text=[text] * len(recs), images=images, return_tensors="pt")
            labels = torch.tensor([int(r["label"]) for r in recs])
            return dict(enc, labels=labels)

        self.sft, self.eval = encode("sft"), encode("eval")
        self.patches = self.sft["pixel_values"].shape[0] // len(self.sft["labels"])

    def _rows(self, data: dict[str, Any], idx: list[int]) -> dict[str, Any]:
        import torch

        pix = torch.cat([data["pixel_values"][i * self.patches : (i + 1) * self.patches] for i in idx])
        return dict(
            input_ids=data["input_ids"][idx],
            attention_mask=data["attention_mask"][idx],
            mm_token_type_ids=data["mm_token_type_ids"][idx],
            pixel_values=pix,
            image_grid_thw=data["image_grid_thw"][idx],
        )

    def accuracy(self, batch: int = 50) -> dict[str, float]:
        """Greedy accuracy and the mean probability of the right digit (a temperature-1 sample's chance of
        answering right) over the held-out images."""
        import torch

        n = len(self.eval["labels"])
        right, prob = 0, 0.0
        self.model.eval()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            for start in range(0, n, batch):
                idx = list(range(start, min(n, start + batch)))
                logits = self.model(**self._rows(self.eval, idx)).logits[:, -1].float()
                p = logits.softmax(-1)
                gold = torch.tensor(self.digits)[self.eval["labels"][idx]]
                right += int((logits.argmax(-1) == gold).sum())
                prob += float(p.gather(1, gold[:, None]).sum())
        return {"greedy": right / n, "p_correct": prob / n}

    def train(self, seed: int, steps: int | None, seconds: float | None, curve: Path | None, every_s: float) -> None:
        """SFT on ``sft`` for ``steps`` steps or ``seconds`` of training (evaluation time not counted)."""
        import torch

        torch.manual_seed(seed)
        rng = random.Random(seed)
        for name, p in self.model.named_parameters():
            p.requires_grad_(".visual." in f".{name}")
        opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=LR)
        n = len(self.sft["labels"])
        order: list[int] = []
        trained, step, next_eval = 0.0, 0, 0.0
        while (steps is None or step < steps) and (seconds is None or trained < seconds):
            if curve is not None and trained >= next_eval:
                _log(curve, {"step": step, "train_s": round(trained, 1), **self.accuracy()})
                next_eval += every_s
            t0 = time.perf_counter()
            if len(order) < BATCH:
                order += rng.sample(range(n), n)
            idx, order = order[:BATCH], order[BATCH:]
            rows = self._rows(self.sft, idx)
            gold = torch.tensor(self.digits)[self.sft["labels"][idx]]
            ids = torch.cat([rows["input_ids"], gold[:, None], torch.full_like(gold[:, None], self.end)], 1)
            rows["input_ids"], rows["attention_mask"] = ids, torch.ones_like(ids)
            rows["mm_token_type_ids"] = torch.cat([rows["mm_token_type_ids"], torch.zeros_like(ids[:, -2:])], 1)
            self.model.train()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = self.model(**rows).logits[:, -3:-1].float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, -2:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            trained += time.perf_counter() - t0
        if curve is not None:
            _log(curve, {"step": step, "train_s": round(trained, 1), **self.accuracy()})


def _log(path: Path, rec: dict) -> None:
    print(json.dumps(rec), file=sys.stderr, flush=True)
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(rec) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="the model folder to start from")
    parser.add_argument("--data", type=Path, required=True, help="the folder data.py wrote")
    parser.add_argument("--out", type=Path, help="where to save the trained model (none: not saved)")
    budget = parser.add_mutually_exclusive_group(required=True)
    budget.add_argument("--steps", type=int, help="optimizer steps")
    budget.add_argument("--minutes", type=float, help="minutes of training (evaluations not counted)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--curve", type=Path, help="append held-out accuracy here as training goes")
    parser.add_argument("--eval-every-s", type=float, default=60.0, help="seconds of training between evaluations")
    args = parser.parse_args()
    counter = Counter(args.model, args.data)
    seconds = None if args.minutes is None else args.minutes * 60
    counter.train(args.seed, args.steps, seconds, args.curve, args.eval_every_s)
    if args.out is not None:
        counter.model.save_pretrained(args.out)
        counter.processor.save_pretrained(args.out)
        print(args.out)


if __name__ == "__main__":
    main()

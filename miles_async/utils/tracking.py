"""Metrics sinks: one JSONL line per step always; wandb and tensorboard when asked."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the type only: utils/ sits below config/
    from miles_async.config import Config


logger = logging.getLogger(__name__)

# wandb's own step only grows, and a background eval finishes after later training steps were
# logged, so with one axis wandb drops it. Each kind of record carries its own step instead.
STEP_KEYS = {"train": "train/step", "eval": "eval/step"}


def _clean(metrics: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in metrics.items():
        if hasattr(v, "item"):
            v = v.item()
        if isinstance(v, float) and not math.isfinite(v):
            v = None
        out[k] = v
    return out


def _numeric(record: dict[str, Any]) -> dict[str, int | float]:
    return {k: v for k, v in record.items() if isinstance(v, (int, float))}


class Tracker:
    """Writes ``metrics.jsonl`` (train steps) and ``eval.jsonl`` under the output folder; with
    ``--use-wandb`` the run's whole configuration goes to wandb too."""

    def __init__(self, cfg: Config):
        self.cfg = cfg.tracking
        self.dir = Path(self.cfg.output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.dir / "metrics.jsonl"
        self.eval_path = self.dir / "eval.jsonl"
        self._wandb = None
        self._tb = None
        self._last_eval: dict[str, Any] = {}
        self._wandb_axes: set[str] = set()
        if self.cfg.use_wandb:
            import wandb

            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
            self._wandb = wandb.init(
                project=self.cfg.wandb_project,
                group=self.cfg.wandb_group,
                name=self.cfg.wandb_run_name,
                config=dataclasses.asdict(cfg),
                mode=mode,
                dir=str(self.dir),
            )
            for step_key in STEP_KEYS.values():
                self._wandb.define_metric(step_key)
            self._wandb.define_metric("eval/*", step_metric=STEP_KEYS["eval"])
        if self.cfg.use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=self.cfg.tensorboard_dir or str(self.dir / "tensorboard"))

    def _write(self, path: Path, record: dict) -> None:
        with path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")
            fh.flush()

    def log(self, step: int, metrics: dict[str, Any], kind: str = "train") -> None:
        cleaned = _clean(metrics)
        record = {"step": step, **cleaned}
        if kind == "eval":
            # Background evals finish at any time; the next train line repeats the latest
            # one (with the step it measured), so every line shows the current accuracy.
            self._last_eval = {"eval/step": step, **{k: v for k, v in record.items() if k.endswith("/accuracy")}}
            self._write(self.eval_path, record)
        else:
            self._write(self.metrics_path, {**record, **self._last_eval})
        # wandb and tensorboard get only this record's own values: the repeated eval would be a
        # second, wrongly placed point of the same curve.
        if self._wandb is not None:
            self._log_wandb(kind, step, _numeric(cleaned))
        if self._tb is not None:
            for k, v in _numeric(cleaned).items():
                self._tb.add_scalar(k, v, step)

    def _log_wandb(self, kind: str, step: int, values: dict[str, int | float]) -> None:
        step_key = STEP_KEYS[kind]
        if kind == "train":
            # Train metrics sit under many prefixes (rollout/, train/, time/, ...): each gets the
            # training step as its x axis the first time it is seen.
            for axis in {k.split("/", 1)[0] + "/*" if "/" in k else k for k in values} - self._wandb_axes:
                self._wandb.define_metric(axis, step_metric=step_key)
                self._wandb_axes.add(axis)
        # No step=: wandb counts log calls, and the x axis of each metric is its own step key.
        self._wandb.log({**values, step_key: step})

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
        if self._tb is not None:
            self._tb.close()


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    p = Path(path)
    if not p.is_file():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]

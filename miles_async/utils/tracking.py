"""Metrics sinks: one JSONL line per step always; wandb and tensorboard when asked."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from miles_async.config import TrackingConfig

logger = logging.getLogger(__name__)


def _clean(metrics: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in metrics.items():
        if hasattr(v, "item"):
            v = v.item()
        if isinstance(v, float) and not math.isfinite(v):
            v = None
        out[k] = v
    return out


class Tracker:
    """Writes ``metrics.jsonl`` (train steps) and ``eval.jsonl`` under the output folder."""

    def __init__(self, cfg: TrackingConfig, run_config: dict | None = None):
        self.cfg = cfg
        self.dir = Path(cfg.output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.dir / "metrics.jsonl"
        self.eval_path = self.dir / "eval.jsonl"
        self._wandb = None
        self._tb = None
        self._last_eval: dict[str, Any] = {}
        if cfg.use_wandb:
            import wandb

            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
            self._wandb = wandb.init(project=cfg.wandb_project, group=cfg.wandb_group, name=cfg.wandb_run_name,
                                     config=run_config or {}, mode=mode, dir=str(self.dir))
        if cfg.use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=cfg.tensorboard_dir or str(self.dir / "tensorboard"))

    def _write(self, path: Path, record: dict) -> None:
        with path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")
            fh.flush()

    def log(self, step: int, metrics: dict[str, Any], kind: str = "train") -> None:
        record = {"step": step, **_clean(metrics)}
        if kind == "eval":
            # Background evals finish at any time; the next train line repeats the latest
            # one (with the step it measured), so every line shows the current accuracy.
            self._last_eval = {"eval/step": step, **{k: v for k, v in record.items() if k.endswith("/accuracy")}}
        else:
            record.update(self._last_eval)
        self._write(self.eval_path if kind == "eval" else self.metrics_path, record)
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=step)
        if self._tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step":
                    self._tb.add_scalar(k, v, step)

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

"""--check-config: every check that needs no worker (flags, files, config.json against the model flags, data keys,
plugins), then the resolved configuration and the worker plan are printed instead of a run.

The plan lists each group of workers the run starts (the actor's training workers, the critic's, the rollout
engines) with how many there are, the GPUs each takes and the placement-group bundles reserved for them on a Ray
cluster with GPUs (``config.placement``).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import yaml

from miles_async.config import Config
from miles_async.config.declare import flag, group
from miles_async.config.machine import Machine
from miles_async.config.placement import worker_plan
from miles_async.utils.urls import redact_url

GROUPS = (
    group(
        "logging and debugging",
        flag(
            "--check-config",
            action="store_true",
            help="check everything that needs no worker (flags, files, --hf-checkpoint's config.json against the "
            "model flags, data keys, plugins), print the resolved configuration and the worker plan, and "
            "exit: 0 when the run would start, 2 with the reason otherwise. What only the job's machine can "
            "tell (GPUs, Transformer Engine, megatron-core, the engines' packages) is a warning",
        ),
    ),
)


def _redacted(value: Any) -> Any:
    """``value`` with every http(s) URL in it redacted (a --rm-url's user, password or query may be a secret)."""
    if isinstance(value, dict):
        return {k: _redacted(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_redacted(v) for v in value]
    if isinstance(value, str) and value.startswith(("http://", "https://")):
        return redact_url(value)
    return value


def render(cfg: Config) -> str:
    """The report --check-config prints: configuration, worker plan, warnings, verdict."""
    plain = _redacted(json.loads(json.dumps(dataclasses.asdict(cfg), default=str)))
    plain.pop("warnings", None)
    plan = worker_plan(cfg)
    gpus = Machine.cuda_devices()
    lines = ["# resolved configuration", yaml.safe_dump(plain, sort_keys=False).rstrip(), "", "# worker plan"]
    lines += [f"  {g.line()}" for g in plan]
    lines.append(
        f"  GPUs asked for: {sum(g.workers * g.gpus_per_worker for g in plan)}; visible on this machine: "
        f"{gpus}" + ("" if gpus else " (here every worker and engine would run on the CPU)")
    )
    lines += ["", f"# warnings ({len(cfg.warnings)})"] + [f"  - {w}" for w in cfg.warnings]
    lines += ["", "check-config: OK, the run would start"]
    return "\n".join(lines)

"""--check-config: every check that needs no worker (flags, files, config.json against the model flags, data keys,
plugins), then the resolved configuration and the worker plan are printed instead of a run.

The plan lists each group of workers the run starts (the actor's training workers, the critic's, the rollout
engines) with how many there are and the GPUs each takes. Placement groups will add each group's bundles and
nodes to the same rows (``WorkerGroup``), so the printing stays one function of the plan.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import yaml

from miles_async.config import Config, TrainConfig
from miles_async.config.declare import flag, group
from miles_async.config.machine import Machine

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


@dataclass(frozen=True)
class WorkerGroup:
    name: str  # "actor", "critic", "rollout"
    workers: int  # processes (training ranks) or engines
    gpus_per_worker: int  # on a machine with GPUs; without, each worker runs on the CPU
    detail: str  # what the workers are: backend and parallel layout, or the engine

    def line(self) -> str:
        unit = "engine" if self.name == "rollout" else "worker"
        return (
            f"{self.name}: {_count(self.workers, unit)} x {_count(self.gpus_per_worker, 'GPU')} = "
            f"{_count(self.workers * self.gpus_per_worker, 'GPU')}; {self.detail}"
        )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' if n != 1 else ''}"


def _trainer(name: str, cfg: TrainConfig, workers: int) -> WorkerGroup:
    if cfg.backend == "megatron":
        m = cfg.megatron
        layout = (
            f"megatron TP {m.tensor_model_parallel_size} x PP {m.pipeline_model_parallel_size} x CP "
            f"{m.context_parallel_size}, data parallel {workers // m.model_parallel_size}"
        )
    else:
        layout = f"fsdp (torch DDP), data parallel {workers}"
    return WorkerGroup(name, workers, 1, layout)


def worker_plan(cfg: Config) -> tuple[WorkerGroup, ...]:
    groups = [_trainer("actor", cfg.train, cfg.cluster.num_train_workers)]
    if cfg.critic is not None:
        groups.append(_trainer("critic", cfg.critic, cfg.cluster.num_critic_workers))
    engine = cfg.engine
    groups.append(
        WorkerGroup(
            "rollout",
            engine.num_engines,
            engine.num_gpus_per_engine,
            f"{engine.backend} engines, weights by {engine.weight_update_method}",
        )
    )
    return tuple(groups)


def render(cfg: Config) -> str:
    """The report --check-config prints: configuration, worker plan, warnings, verdict."""
    plain = json.loads(json.dumps(dataclasses.asdict(cfg), default=str))
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

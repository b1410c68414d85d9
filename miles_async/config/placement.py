"""Where each worker group goes: the plan of Ray placement-group bundles, and whether a cluster can hold it.

Pure: ``--check-config`` prints the plan and ``miles_async.ray.placement`` reserves it. As in Miles, on a Ray
cluster with GPUs every group gets a placement group (PACK): the actor and the critic one bundle of one GPU per
training rank (ranks ordered by node, so a tensor-parallel group stays on one node where it can), the rollout one
bundle per engine holding all of that engine's GPUs, so an engine never spans nodes. Without GPUs in the cluster
nothing is reserved and every worker runs on the CPU (a laptop run).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from miles_async.config import Config, TrainConfig

STRATEGY = "PACK"  # fill a node before the next, like Miles' placement groups


@dataclass(frozen=True)
class WorkerGroup:
    name: str  # "actor", "critic", "rollout"
    workers: int  # processes (training ranks) or engines
    gpus_per_worker: int  # one bundle per worker holds this many GPUs
    detail: str  # what the workers are: backend and parallel layout, or the engine
    flags: str  # the flags that size the group, for messages

    @property
    def gpus(self) -> int:
        return self.workers * self.gpus_per_worker

    def line(self) -> str:
        unit = "engine" if self.name == "rollout" else "worker"
        return (
            f"{self.name}: {_count(self.workers, unit)} x {_count(self.gpus_per_worker, 'GPU')} = "
            f"{_count(self.gpus, 'GPU')}; {self.detail}; placement group of {_count(self.workers, 'bundle')} "
            f"x {_count(self.gpus_per_worker, 'GPU')} ({STRATEGY})"
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
        if m.expert_model_parallel_size > 1:
            layout += f"; experts EP {m.expert_model_parallel_size}"
    else:
        layout = f"fsdp (torch DDP), data parallel {workers}"
    return WorkerGroup(name, workers, 1, layout, f"--{name}-num-nodes x --{name}-num-gpus-per-node")


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
            "--rollout-num-gpus / --rollout-num-gpus-per-engine",
        )
    )
    return tuple(groups)


def unplaceable(plan: Sequence[WorkerGroup], node_gpus: Sequence[float]) -> str | None:
    """Why a cluster whose alive nodes have ``node_gpus`` GPUs cannot hold ``plan``'s bundles, or None.

    Bundles go largest first, each to the fullest node it fits on (how PACK fills nodes); Ray decides in the
    end, so this catches what can never fit (and says which flag to change) instead of waiting on it."""
    cluster = ", ".join(f"{g:g}" for g in node_gpus) or "none"
    widest = max(node_gpus, default=0)
    for g in plan:
        if g.gpus_per_worker > widest:
            what = "an engine" if g.name == "rollout" else "a training rank"
            return (
                f"{what} needs {_count(g.gpus_per_worker, 'GPU')} on one node ({g.flags}), but the largest node "
                f"of the Ray cluster has {widest:g} (GPUs per node: {cluster})"
            )
    need = sum(g.gpus for g in plan)
    if need > sum(node_gpus):
        parts = ", ".join(f"{g.name} {g.gpus}" for g in plan)
        return (
            f"the run needs {need} GPUs ({parts}; set by {'; '.join(g.flags for g in plan)}) and the Ray cluster "
            f"has {sum(node_gpus):g} (GPUs per node: {cluster})"
        )
    free = sorted(node_gpus, reverse=True)
    bundles = sorted((g.gpus_per_worker for g in plan for _ in range(g.workers)), reverse=True)
    for size in bundles:
        fits = [i for i, f in enumerate(free) if f >= size]
        if not fits:
            return (
                f"the bundles ({', '.join(f'{g.name} {g.workers} x {g.gpus_per_worker}' for g in plan)} GPUs) do "
                f"not fit on the Ray cluster's nodes (GPUs per node: {cluster}): change {plan[-1].flags}"
            )
        best = min(fits, key=lambda i: free[i])
        free[best] -= size
    return None

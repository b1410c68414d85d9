"""Where the run's processes go: flags, checks and the typed ``ClusterConfig``."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from miles_async.config.algorithm import CRITIC
from miles_async.config.declare import at_least, flag, group, positive
from miles_async.config.engine import FAULT_TOLERANCE


@dataclass(frozen=True)
class ClusterConfig:
    ray_address: str | None
    num_train_workers: int
    num_critic_workers: int = 0
    placement_timeout: float = 300.0
    # --use-fault-tolerance: restarts of the training workers over the run (from the last checkpoint, with the
    # rollout side rewound to it); None: a dead training worker ends the run.
    max_trainer_restarts: int | None = None


GROUPS = (
    group(
        "cluster",
        flag("--ray-address", default=None, help="join an existing Ray cluster instead of starting a local one"),
        flag(
            "--placement-timeout",
            type=float,
            default=300.0,
            check=positive(),
            help="seconds to wait for Ray to grant the placement groups (on a cluster with GPUs); then the run "
            "fails, naming the group it could not place",
        ),
        flag(
            "--actor-num-nodes",
            help="nodes the training workers run on (--actor-num-gpus-per-node workers each)",
            type=int,
            default=1,
            check=at_least(1),
        ),
        flag(
            "--actor-num-gpus-per-node",
            type=int,
            default=1,
            check=at_least(1),
            help="training workers per node (CPU processes when no GPU is present)",
        ),
        flag(
            "--max-trainer-restarts",
            type=int,
            default=3,
            check=at_least(0),
            effect_needs=FAULT_TOLERANCE,
            help="restarts of the training workers over the run: when one dies, the actor (and critic) groups "
            "are rebuilt from the last complete checkpoint (else the initial model), the rollout side rewinds to "
            "that checkpoint's data position and the run goes on from there; one more death fails the run. "
            "Without --use-fault-tolerance a dead training worker ends the run",
        ),
    ),
    group(
        "critic (--advantage-estimator ppo)",
        flag(
            "--critic-num-nodes",
            type=int,
            default=None,
            check=at_least(1),
            needs=CRITIC,
            help="default: --actor-num-nodes",
        ),
        flag(
            "--critic-num-gpus-per-node",
            type=int,
            default=None,
            check=at_least(1),
            needs=CRITIC,
            help="default: --actor-num-gpus-per-node",
        ),
    ),
)


def num_train_workers(ns: argparse.Namespace) -> int:
    return ns.actor_num_nodes * ns.actor_num_gpus_per_node


def num_critic_workers(ns: argparse.Namespace) -> int:
    if ns.advantage_estimator != "ppo":
        return 0
    return (ns.critic_num_nodes or ns.actor_num_nodes) * (ns.critic_num_gpus_per_node or ns.actor_num_gpus_per_node)


def build(ns: argparse.Namespace) -> ClusterConfig:
    return ClusterConfig(
        ray_address=ns.ray_address,
        num_train_workers=num_train_workers(ns),
        num_critic_workers=num_critic_workers(ns),
        placement_timeout=ns.placement_timeout,
        max_trainer_restarts=ns.max_trainer_restarts if ns.use_fault_tolerance else None,
    )

"""Ray placement groups for the run's worker groups, and where each process ended up.

``reserve`` turns ``config.placement``'s plan into one placement group per group (actor, critic, rollout) on a
Ray cluster that has GPUs, after checking the cluster can hold it at all (``unplaceable``), and waits for Ray to
grant them within ``--placement-timeout``: a cluster that is short of GPUs fails the run with what it has, never
leaves it waiting. Training ranks take their bundles in node order; each engine takes one bundle with all of its
GPUs, so Ray's ``CUDA_VISIBLE_DEVICES`` for that bundle is what the engine uses.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from miles_async.config.placement import STRATEGY, WorkerGroup, unplaceable
from miles_async.utils.async_utils import WaitTimeout, wait_for

logger = logging.getLogger(__name__)


class PlacementError(RuntimeError):
    """The Ray cluster cannot hold the run's worker groups."""


@dataclass(frozen=True)
class GroupPlacement:
    """One worker group's placement group; worker ``i`` goes to bundle ``order[i]``."""

    name: str
    group: PlacementGroup
    order: tuple[int, ...]
    gpus_per_worker: int

    def options(self, worker: int) -> dict:
        """Ray actor options that put worker ``worker`` on its bundle with the bundle's GPUs."""
        return {
            "num_gpus": self.gpus_per_worker,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.group,
                placement_group_bundle_index=self.order[worker],
                placement_group_capture_child_tasks=False,
            ),
        }


def node_gpus() -> list[float]:
    """GPUs of each alive node of the Ray cluster this process is connected to."""
    return [float(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n["Alive"]]


def _node_order(group: PlacementGroup) -> tuple[int, ...]:
    """Bundle indices sorted by the node Ray put them on, so neighbouring ranks share a node."""
    nodes = placement_group_table(group)["bundles_to_node_id"]
    return tuple(sorted(nodes, key=lambda i: (nodes[i], i)))


async def reserve(plan: tuple[WorkerGroup, ...], timeout: float) -> dict[str, GroupPlacement]:
    """One placement group per group of ``plan``, granted; empty on a cluster without GPUs (CPU run)."""
    gpus = node_gpus()
    if sum(gpus) == 0:
        return {}
    problem = unplaceable(plan, gpus)
    if problem:
        raise PlacementError(problem)
    pending = {g.name: (g, placement_group([{"GPU": g.gpus_per_worker}] * g.workers, strategy=STRATEGY)) for g in plan}
    try:
        for name, (g, pg) in pending.items():
            try:
                await wait_for(pg.ready(), timeout, f"Ray to grant the {name} placement group (--placement-timeout)")
            except WaitTimeout as e:
                raise PlacementError(
                    f"{e}: {g.workers} bundle(s) of {g.gpus_per_worker} GPU(s) ({g.flags}); the cluster's nodes "
                    f"have {', '.join(f'{x:g}' for x in node_gpus())} GPUs, some possibly held by other jobs"
                ) from None
    except BaseException:
        release({name: GroupPlacement(name, pg, (), 0) for name, (_, pg) in pending.items()})
        raise
    placed = {name: GroupPlacement(name, pg, _node_order(pg), g.gpus_per_worker) for name, (g, pg) in pending.items()}
    for p in placed.values():
        nodes = placement_group_table(p.group)["bundles_to_node_id"]
        logger.info("%s placement: bundles on nodes %s", p.name, [nodes[i][:8] for i in p.order])
    return placed


def release(placed: dict[str, GroupPlacement]) -> None:
    for p in placed.values():
        try:
            remove_placement_group(p.group)
        except Exception as e:  # noqa: BLE001 - releasing must not hide the run's own outcome
            logger.warning("could not remove the %s placement group: %r", p.name, e)


def where(role: str, index: int, pid: int | None = None) -> dict:
    """This Ray worker's place: node, address, the GPUs Ray gave it and the CPU cores it may run on (``pid`` of
    the process it runs, if not itself). Written to processes.json, so a run's record shows where everything ran."""
    connected = ray.is_initialized()  # not in a plain process (a test driving the controller): no node to name
    return {
        "role": role,
        "index": index,
        "pid": pid if pid is not None else os.getpid(),
        "node_id": ray.get_runtime_context().get_node_id() if connected else None,
        "node_ip": ray.util.get_node_ip_address(),
        "gpu_ids": [str(g) for g in ray.get_gpu_ids()] if connected else [],
        "cpus": _cpus(pid if pid is not None else 0),
    }


def _cpus(pid: int) -> list[int] | None:
    try:
        return sorted(os.sched_getaffinity(pid))
    except OSError:  # the process is gone already
        return None

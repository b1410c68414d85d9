"""Placement groups on a Ray cluster with GPUs: real Ray placement groups, real engine servers started by their
EngineHost actors, real fault-tolerant restarts.

Stand-in: the GPUs. Ray is started here with 3 logical GPUs (``num_gpus=3``), so its accounting, bundles and
``CUDA_VISIBLE_DEVICES`` are real while every engine computes on the CPU. The multi-node case runs in
tests/scripts/test_rehearsal_cluster.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from urllib.parse import urlparse

import pytest
import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

from miles_async.arguments import parse_args
from miles_async.config import FaultToleranceConfig
from miles_async.config.placement import worker_plan
from miles_async.ray.inference_controller import InferenceController
from miles_async.ray.placement import PlacementError, release, reserve, where
from tests import ray_cluster


@pytest.fixture(scope="module")
def gpu_ray():
    with ray_cluster.separate(num_gpus=3) as address:
        ray.init(address=address, logging_level="WARNING")
        yield
        ray.shutdown()


def _cfg(tiny_model, tiny_task, tmp_path, *extra: str):
    train, _ = tiny_task
    return parse_args(
        [
            "--use-tis", "--hf-checkpoint", str(tiny_model), "--prompt-data", str(train), "--rm-type", "first_integer",
            "--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--rollout-num-threads", "1", "--output-dir", str(tmp_path), *extra,
        ]
    )  # fmt: skip


@ray.remote(num_cpus=0)
class Rank:
    """Stands where a training rank would: on an actor bundle, reporting its place."""

    def where(self) -> dict:
        return where("actor", 0)


def _visible_devices(pid: int) -> str | None:
    env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    found = [e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"CUDA_VISIBLE_DEVICES=")]
    return found[0] if found else None


def test_each_engine_runs_on_its_own_bundle_and_a_restarted_one_comes_back_on_it(
    gpu_ray, tiny_model, tiny_task, tmp_path
):
    cfg = _cfg(tiny_model, tiny_task, tmp_path, "--rollout-num-gpus", "2")
    ft = FaultToleranceConfig(health_check_interval=0.2, health_check_timeout=1.0, max_engine_restarts=1)
    engine_cfg = dataclasses.replace(cfg.engine, fault_tolerance=ft)
    placed = asyncio.run(reserve(worker_plan(cfg), timeout=60))
    controller = None
    try:
        assert set(placed) == {"actor", "rollout"}
        rank = Rank.options(**placed["actor"].options(0)).remote()
        actor_gpus = ray.get(rank.where.remote())["gpu_ids"]
        controller = (
            ray.remote(InferenceController).options(num_cpus=0).remote(engine_cfg, str(tmp_path), placed["rollout"])
        )
        urls = ray.get(controller.start.remote(), timeout=180)
        before = ray.get(controller.placement.remote())
        engine_gpus = [p["gpu_ids"] for p in before]
        # one GPU each, none shared with the other engine or the actor's rank
        assert all(len(g) == 1 for g in engine_gpus + [actor_gpus]), (before, actor_gpus)
        assert len({g[0] for g in engine_gpus + [actor_gpus]}) == 3, (before, actor_gpus)
        for p in before:
            assert _visible_devices(p["pid"]) == p["gpu_ids"][0]  # the server itself got its bundle's GPU
        assert {urlparse(u).hostname for u in urls} == {ray.util.get_node_ip_address()}  # reachable, not loopback

        os.kill(before[0]["pid"], signal.SIGKILL)
        t0 = time.monotonic()
        while ray.get(controller.health_metrics.remote()).get("engine/restarts", 0) < 1:
            assert time.monotonic() - t0 < 120, "engine 0 was not restarted"
            time.sleep(0.2)
        after = ray.get(controller.placement.remote())
        assert after[0]["pid"] != before[0]["pid"]
        assert after[0]["gpu_ids"] == before[0]["gpu_ids"] and after[0]["node_id"] == before[0]["node_id"]
        assert _visible_devices(after[0]["pid"]) == before[0]["gpu_ids"][0]
        assert ray.get(controller.weight_versions.remote()) == [0, 0]
    finally:
        if controller is not None:
            ray.get(controller.dispose.remote(), timeout=60)
            ray.kill(controller)
        release(placed)


def test_an_engine_wider_than_every_node_is_refused_before_anything_waits(gpu_ray, tiny_model, tiny_task, tmp_path):
    cfg = _cfg(tiny_model, tiny_task, tmp_path, "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "4")
    with pytest.raises(PlacementError, match=r"an engine needs 4 GPUs on one node \(--rollout-num-gpus"):
        asyncio.run(reserve(worker_plan(cfg), timeout=60))


def test_gpus_held_by_another_job_fail_the_run_after_the_placement_timeout(gpu_ray, tiny_model, tiny_task, tmp_path):
    cfg = _cfg(tiny_model, tiny_task, tmp_path)
    other = placement_group([{"GPU": 2}])  # another job's: 1 of 3 GPUs left, the run needs 2
    ray.get(other.ready(), timeout=30)
    try:
        before = set(placement_group_table())
        t0 = time.monotonic()
        with pytest.raises(PlacementError, match="--placement-timeout"):
            asyncio.run(reserve(worker_plan(cfg), timeout=3))
        assert time.monotonic() - t0 < 30
        left = {k: v for k, v in placement_group_table().items() if k not in before and v["state"] != "REMOVED"}
        assert not left, left  # what it reserved on the way is given back
    finally:
        remove_placement_group(other)

"""Fault tolerance and --check-weight-update-equal against real engine servers and a real trainer.

The InferenceController runs here in-process (not as a Ray actor); ``Handle`` gives it and its
listener the ``obj.method.remote(...)`` shape the driver code uses.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import os
import signal
import time

import pytest
import torch

from miles_async.arguments import parse_args
from miles_async.config import FaultToleranceConfig
from miles_async.inference.embedded.client import EmbeddedEngineClient
from miles_async.inference.fault_tolerance import EngineState
from miles_async.ray.inference_controller import InferenceController
from miles_async.utils.weight_checksum import first_mismatch
from miles_async.weights.driver import WeightMismatchError, check_weight_update_equal
from miles_async.weights.http import push_buckets
from miles_async.weights.source import iter_buckets
from miles_async.weights.update import WeightUpdate


class Handle:
    """``handle.method.remote(*args)`` -> awaitable, like a Ray actor handle, around a local object."""

    def __init__(self, obj):
        self.obj = obj

    def __getattr__(self, name):
        fn = getattr(self.obj, name)

        class Method:
            @staticmethod
            async def remote(*args):
                result = fn(*args)
                return await result if inspect.isawaitable(result) else result

        return Method


class LocalGroup:
    """TrainGroup's ``call`` around one local trainer."""

    def __init__(self, actor):
        self.actor = actor

    async def call(self, method, *args):
        return await asyncio.to_thread(getattr(self.actor, method), *args)


@pytest.fixture
def cfg(tiny_model, tiny_task, tmp_path):
    train, _ = tiny_task
    return parse_args(
        [
            "--use-tis",
            "--hf-checkpoint",
            str(tiny_model),
            "--prompt-data",
            str(train),
            "--rollout-batch-size",
            "2",
            "--n-samples-per-prompt",
            "2",
            "--num-rollout",
            "2",
            "--rm-type",
            "first_integer",
            "--rollout-dtype",
            "bfloat16",
            "--keep-cpu-bf16",  # the checks below push bf16 bytes, on any CPU
            "--rollout-num-threads",
            "1",
            "--check-weight-update-equal",
            "--output-dir",
            str(tmp_path),
        ]
    )


def _perturbed_weights(model_path, seed: int) -> list[tuple[str, torch.Tensor]]:
    """The model's weights, changed (so they differ from what an engine loads from disk)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    return [(n, p.detach() + 0.01 * torch.randn(p.shape, generator=g)) for n, p in model.named_parameters()]


def test_check_weight_update_equal_passes_and_catches_a_corrupted_update(cfg, tmp_path):
    from miles_async.backends.fsdp.actor import FSDPTrainActor

    async def go():
        controller = InferenceController(cfg.engine, str(tmp_path))
        await controller.start()
        try:
            actor = FSDPTrainActor(cfg.train, rank=0, world_size=1, total_optimizer_steps=1)
            handle, group = Handle(controller), LocalGroup(actor)
            urls = await controller.begin_weight_update()
            await asyncio.to_thread(
                actor.push_weights,
                WeightUpdate(
                    version=1,
                    route="http",
                    dtype="bfloat16",
                    timeout=60,
                    targets=tuple(urls),
                    api_key=cfg.engine.api_key,
                ),
            )
            await controller.end_weight_update()
            await check_weight_update_equal(cfg, handle, group, 1)  # bf16 on both sides: identical bytes

            # Corrupt one tensor on the engine, as a broken update would.
            name, good = next((n, p) for n, p in actor.module.named_parameters() if "layers.0.mlp" in n)
            async with EmbeddedEngineClient(urls[0], timeout=60, api_key=cfg.engine.api_key) as c:
                await c.update_weights_from_tensors([(name, good.detach().to(torch.bfloat16) + 1)], flush=True)
            with pytest.raises(WeightMismatchError) as err:
                await check_weight_update_equal(cfg, handle, group, 1)
            assert name in str(err.value) and urls[0] in str(err.value) and "weight version 1" in str(err.value)
        finally:
            await controller.dispose()

    asyncio.run(go())


def test_a_killed_engine_is_restarted_with_the_current_weights(cfg, tmp_path, tiny_model):
    """SIGKILL one of two engines: it leaves the router at once, comes back on a new port holding the
    weight version (and bytes) the others hold, and only then rejoins the router."""
    ft = FaultToleranceConfig(health_check_interval=0.2, health_check_timeout=2.0, max_engine_restarts=2)
    engine_cfg = dataclasses.replace(cfg.engine, num_engines=2, fault_tolerance=ft)

    class Listener:
        def __init__(self):
            self.calls = []

        def set_engines(self, urls, fatal):
            self.calls.append((urls, fatal))

    async def go():
        controller = InferenceController(engine_cfg, str(tmp_path))
        urls = await controller.start()
        listener = Listener()
        await controller.attach(Handle(listener))
        try:
            await controller.begin_weight_update()
            weights = _perturbed_weights(tiny_model, seed=1)
            await push_buckets(iter_buckets(weights, torch.bfloat16, 1 << 16), urls, 7, 60, api_key=engine_cfg.api_key)
            await controller.end_weight_update()
            old_pid = controller.engines[1].pid
            t_kill = time.monotonic()
            os.kill(old_pid, signal.SIGKILL)
            while controller.health_metrics()["engine/restarts"] < 1:
                assert time.monotonic() - t_kill < 120, controller.supervisor.engines
                await asyncio.sleep(0.1)
            restarted = controller.engines[1]
            assert restarted.pid != old_pid and (await restarted.state())[0]
            assert controller.all_engine_pids() == [controller.engines[0].pid, old_pid, restarted.pid]
            assert controller.supervisor.state(1) == EngineState.HEALTHY
            # told both at attach; out of the router as soon as detected, back only once seeded, at its new URL
            assert listener.calls[0] == (urls, None)
            assert listener.calls[1] == ([urls[0]], None)
            assert listener.calls[-1] == ([urls[0], restarted.url], None)
            assert await controller.weight_versions() == [7, 7]
            sums = await controller.weights_checksums()
            assert first_mismatch(sums[urls[0]], sums[restarted.url]) is None
        finally:
            await controller.dispose()

    asyncio.run(go())


def test_an_engine_that_stops_answering_is_replaced(cfg, tmp_path):
    """SIGSTOP: the process lives but answers nothing. Failed health checks in a row quarantine it; it is
    killed and replaced, and the other engine serves meanwhile."""
    ft = FaultToleranceConfig(health_check_interval=0.2, health_check_timeout=0.5, max_engine_restarts=1)
    engine_cfg = dataclasses.replace(cfg.engine, num_engines=2, fault_tolerance=ft)

    async def go():
        controller = InferenceController(engine_cfg, str(tmp_path))
        urls = await controller.start()
        try:
            hung = controller.engines[0].pid
            os.kill(hung, signal.SIGSTOP)
            t0 = time.monotonic()
            while controller.supervisor.serving() != [1]:
                assert time.monotonic() - t0 < 10, controller.supervisor.engines
                await asyncio.sleep(0.05)
            # detected within a few check intervals (2 checks of at most 0.5 s each, 0.2 s apart)
            assert time.monotonic() - t0 < 3
            assert "did not answer" in controller.supervisor.engines[0].last_error
            while controller.health_metrics()["engine/restarts"] < 1:
                assert time.monotonic() - t0 < 120, controller.supervisor.engines
                await asyncio.sleep(0.1)
            assert not os.path.exists(f"/proc/{hung}") or open(f"/proc/{hung}/stat").read().split()[2] == "Z"
            assert controller.serving_urls() == [controller.engines[0].url, urls[1]]
            assert await controller.weight_versions() == [0, 0]
        finally:
            await controller.dispose()

    asyncio.run(go())


def test_with_no_engine_left_the_run_fails_naming_the_engine_and_its_log(cfg, tmp_path):
    ft = FaultToleranceConfig(health_check_interval=0.2, health_check_timeout=1.0, max_engine_restarts=0)
    engine_cfg = dataclasses.replace(cfg.engine, num_engines=1, fault_tolerance=ft)

    class Listener:
        fatal = None

        def set_engines(self, urls, fatal):
            Listener.fatal = fatal

    async def go():
        controller = InferenceController(engine_cfg, str(tmp_path))
        await controller.start()
        await controller.attach(Handle(Listener()))
        try:
            os.kill(controller.engines[0].pid, signal.SIGKILL)
            t0 = time.monotonic()
            while Listener.fatal is None:
                assert time.monotonic() - t0 < 10
                await asyncio.sleep(0.05)
            assert "engine 0: gave_up after 0 restart(s)" in Listener.fatal
            assert "exited with code -9" in Listener.fatal and "engine_0.log" in Listener.fatal
            assert "serving" in Listener.fatal.splitlines()[-1]  # the log tail is included
            with pytest.raises(RuntimeError, match="no inference engine is left serving"):
                await controller.begin_weight_update()
        finally:
            await controller.dispose()

    asyncio.run(go())

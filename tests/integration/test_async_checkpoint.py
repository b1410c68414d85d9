"""Checkpoints written in the background (--async-save) by real Ray training workers through ``Run.save``, and the
checkpoint files read back with ``torch.load(weights_only=True)``.

A background write is held up by a real file-system condition: a named pipe (FIFO) where the worker writes its
first part, ``rng_rank0.pt``. Opening a FIFO for writing blocks until someone opens it for reading, so the write
stays in flight, deterministically, until the test reads the pipe. No engine runs: the rollout executor saves only
its data position, and the engine address it is given is never asked anything.
"""

from __future__ import annotations

import asyncio
import io
import os
import random

import numpy as np
import pytest
import ray
import torch

from miles_async.arguments import parse_args
from miles_async.backends.fsdp import checkpoint
from miles_async.backends.fsdp.actor import FSDPTrainActor
from miles_async.backends.fsdp.checkpoint import DCP_DIR
from miles_async.backends.fsdp.worker import TRAIN_STATE
from miles_async.ray.rollout_executor import RolloutExecutor
from miles_async.ray.train_group import TrainGroup
from miles_async.rollout.batch import RolloutBatch, to_train_batch
from miles_async.rollout.sample import Sample
from miles_async.run import Run
from miles_async.utils.checkpoint import POINTER, CheckpointError, iteration_dir
from tests.flag_helpers import tiny_train_flags


def _batch(seed: int) -> RolloutBatch:
    rng = random.Random(seed)
    groups = []
    for g in range(4):
        prompt = [rng.randrange(6, 40) for _ in range(4)]
        group = []
        for i in range(4):
            n = rng.randrange(1, 5)
            response = [rng.randrange(6, 40) for _ in range(n)]
            group.append(
                Sample(
                    uid=f"{g}-{i}",
                    group_index=g,
                    index=i,
                    prompt="",
                    prompt_tokens=prompt,
                    response_tokens=response,
                    rollout_logprobs=[-3.0] * n,
                    reward=float(rng.random() < 0.5),
                )
            )
        groups.append(group)
    return to_train_batch(groups)


def _cfg(tiny_model, tiny_task, tmp_path, *extra: str):
    train, _ = tiny_task
    return parse_args(
        tiny_train_flags(tiny_model, train, tmp_path / "out", "--lr", "1e-2", "--save", str(tmp_path / "ckpt"), *extra)
    )


async def _run(cfg) -> Run:
    """A Run whose trainer is one real torch-backend worker and whose rollout executor holds the data position."""
    run = Run(cfg)
    run.actor = TrainGroup(cfg.train, cfg.cluster, 1, 10, None, None)
    await run.actor.init()
    run.executor = ray.remote(RolloutExecutor).remote(
        cfg.rollout, cfg.eval, cfg.engine, ["http://127.0.0.1:9"], None, None, None
    )
    return run


async def _weights(run: Run) -> dict[str, torch.Tensor]:
    # Each worker runs in a WorkerHost (miles_async/ray/worker_host.py): the module is its worker's.
    ref = run.actor.actors[0].__ray_call__.remote(
        lambda host: {k: v.clone() for k, v in host.worker.module.state_dict().items()}
    )
    return await ref


async def _train(run: Run, rollout_id: int) -> None:
    await run.actor.train(rollout_id, ray.put(_batch(rollout_id)), 1.0)


def _blocking_part(save_dir, rollout_id: int):
    """A FIFO where the worker writes its first part of checkpoint ``rollout_id``: the write waits for a reader."""
    part = iteration_dir(save_dir, rollout_id) / "actor" / "rng_rank0.pt"
    part.parent.mkdir(parents=True)
    os.mkfifo(part)
    return part


async def _release(part) -> bytes:
    """Reads the FIFO to its end: the blocked write goes on, and what it wrote comes back."""
    return await asyncio.wait_for(asyncio.to_thread(part.read_bytes), 120)


def test_a_background_save_returns_before_its_write_and_moves_the_pointer_only_after(
    shared_ray, tiny_model, tiny_task, tmp_path
):
    """Run.save returns while the worker's write is blocked; the next step trains meanwhile; the pointer and the
    COMPLETE marker appear only once the write finished, and the checkpoint holds the weights of the step boundary,
    not those of the step that trained during the write."""
    cfg = _cfg(tiny_model, tiny_task, tmp_path, "--save-interval", "1")
    assert cfg.checkpoint.async_save  # the default
    save_dir = cfg.checkpoint.save

    async def scenario():
        run = await _run(cfg)
        try:
            await _train(run, 0)
            boundary = await _weights(run)
            part = _blocking_part(save_dir, 0)
            await asyncio.wait_for(run.save(0), 60)  # returns with the write blocked on the FIFO
            assert not (save_dir_path / POINTER).exists()
            assert not (iteration_dir(save_dir, 0) / "COMPLETE").exists()
            await _train(run, 1)  # training goes on beside the blocked write
            run.check_save()  # the write is in flight, not failed
            later = await _weights(run)
            rng = torch.load(io.BytesIO(await _release(part)), weights_only=True)
            await asyncio.wait_for(run.wait_save(), 60)
            return boundary, later, rng
        finally:
            await run.dispose()

    save_dir_path = tmp_path / "ckpt"
    boundary, later, rng = asyncio.run(scenario())
    assert (save_dir_path / POINTER).read_text().strip() == "0"
    assert (iteration_dir(save_dir, 0) / "COMPLETE").is_file()
    assert set(rng) >= {"python", "numpy", "torch"}
    saved = _saved_weights(cfg, iteration_dir(save_dir, 0) / "actor")
    assert saved.keys() == boundary.keys()
    assert all(torch.equal(saved[k], boundary[k]) for k in saved)
    assert any(not torch.equal(saved[k], later[k]) for k in saved)  # step 1 moved the live weights, not the copy
    train_state = torch.load(iteration_dir(save_dir, 0) / "actor" / TRAIN_STATE, weights_only=True)
    assert train_state["optimizer_steps"] == 1


def _saved_weights(cfg, folder) -> dict[str, torch.Tensor]:
    """The weights of a checkpoint's role folder, read by the backend's own loader into a fresh worker."""
    actor = FSDPTrainActor(cfg.train, 0, 1, 10)
    checkpoint.load(actor.module, None, folder, None)
    return actor.module.state_dict()


def test_at_most_one_save_in_flight(shared_ray, tiny_model, tiny_task, tmp_path):
    """While checkpoint 0 is still being written, the save of checkpoint 1 waits: it has copied nothing and written
    nothing; once 0 is written, 1 goes ahead and the pointer reaches it."""
    cfg = _cfg(tiny_model, tiny_task, tmp_path, "--save-interval", "1")
    save_dir = cfg.checkpoint.save

    async def scenario():
        run = await _run(cfg)
        try:
            await _train(run, 0)
            part = _blocking_part(save_dir, 0)
            await asyncio.wait_for(run.save(0), 60)
            await _train(run, 1)
            second = asyncio.ensure_future(run.save(1))
            await asyncio.sleep(3)
            assert not second.done()
            assert not iteration_dir(save_dir, 1).exists()  # not even the rollout executor's part
            await _release(part)
            await asyncio.wait_for(second, 60)
            await asyncio.wait_for(run.wait_save(), 60)
        finally:
            await run.dispose()

    asyncio.run(scenario())
    assert (tmp_path / "ckpt" / POINTER).read_text().strip() == "1"
    assert all((iteration_dir(save_dir, i) / "COMPLETE").is_file() for i in (0, 1))


def test_a_failed_background_write_is_raised_at_the_next_save_naming_its_folder(
    shared_ray, tiny_model, tiny_task, tmp_path
):
    """The worker cannot write its weights (a folder stands where its shard file goes): the save itself returned,
    the next save raises naming the iteration folder, and the pointer never moved to it."""
    cfg = _cfg(tiny_model, tiny_task, tmp_path, "--save-interval", "1")
    save_dir = cfg.checkpoint.save
    (iteration_dir(save_dir, 0) / "actor" / DCP_DIR / "__0_0.distcp").mkdir(parents=True)

    async def scenario():
        run = await _run(cfg)
        try:
            await _train(run, 0)
            await asyncio.wait_for(run.save(0), 60)
            await _train(run, 1)
            with pytest.raises(CheckpointError, match="iter_0000000") as e:
                await asyncio.wait_for(run.save(1), 60)
            return e.value
        finally:
            await run.dispose()

    error = asyncio.run(scenario())
    assert "__0_0.distcp" in str(error.__cause__)
    assert not (tmp_path / "ckpt" / POINTER).exists()
    assert not (iteration_dir(save_dir, 0) / "COMPLETE").exists()


class _Payload:
    """Unpickled, it would create ``marker``: what a tampered checkpoint file could run on --load."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("part", ["rng_rank0.pt", TRAIN_STATE])
def test_a_tampered_checkpoint_file_is_refused_and_its_payload_never_runs(tiny_model, tiny_task, tmp_path, part):
    cfg = _cfg(tiny_model, tiny_task, tmp_path)
    FSDPTrainActor(cfg.train, 0, 1, 10).save(str(tmp_path / "ckpt"), 0)
    path = iteration_dir(tmp_path / "ckpt", 0) / "actor" / part
    marker = tmp_path / "payload-ran"
    torch.save({"state": _Payload(str(marker))}, path)
    with pytest.raises(CheckpointError, match=f"--load: {path} is refused"):
        FSDPTrainActor(cfg.train, 0, 1, 10, str(tmp_path / "ckpt"), 0)
    assert not marker.exists()


def test_an_rng_file_of_the_old_format_is_refused_naming_it(tiny_model, tiny_task, tmp_path):
    """The old format pickled numpy's state as an array, which weights_only does not read."""
    cfg = _cfg(tiny_model, tiny_task, tmp_path)
    FSDPTrainActor(cfg.train, 0, 1, 10).save(str(tmp_path / "ckpt"), 0)
    path = iteration_dir(tmp_path / "ckpt", 0) / "actor" / "rng_rank0.pt"
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}, path)
    # torch may read the old pickle under weights_only (numpy arrays are allowlisted in some versions); either way the
    # file is refused by name, before any state is set.
    with pytest.raises(CheckpointError, match=f"--load: {path} is (refused.*older miles-async|not an RNG state)"):
        FSDPTrainActor(cfg.train, 0, 1, 10, str(tmp_path / "ckpt"), 0)


def test_the_rng_state_round_trips_through_a_weights_only_checkpoint(tiny_model, tiny_task, tmp_path):
    """Python, numpy and torch draw after --load what they drew after the save."""
    cfg = _cfg(tiny_model, tiny_task, tmp_path)
    actor = FSDPTrainActor(cfg.train, 0, 1, 10)
    # Off their seeds, and each with a cached second gaussian that the state must carry.
    random.gauss(0, 1), np.random.normal(), torch.rand(1)  # noqa: B018
    actor.save(str(tmp_path / "ckpt"), 0)
    draws = (random.random(), random.gauss(0, 1), np.random.normal(), torch.rand(3).tolist())
    FSDPTrainActor(cfg.train, 0, 1, 10, str(tmp_path / "ckpt"), 0)
    assert (random.random(), random.gauss(0, 1), np.random.normal(), torch.rand(3).tolist()) == draws

"""The embedded engine on the trainer's node takes its weights through shared memory (``--weight-update-method
tensor``): a real engine server holds the trainer's bytes exactly afterwards, at the new version; no /dev/shm file
outlives the sender, nor a failed or timed-out update; and staging happens while the engine generates, so the
pause only covers the copy into its parameters."""

from __future__ import annotations

import asyncio
import gc
import glob
import os
import socket
import threading
import time
from dataclasses import replace

import pytest
import torch

from miles_async.arguments import parse_args
from miles_async.inference.client import EngineError
from miles_async.inference.embedded.client import EmbeddedEngineClient
from miles_async.inference.embedded.launcher import EmbeddedEngineProcess
from miles_async.utils.api_key import new_api_key
from miles_async.weights import shared_memory
from miles_async.weights.sender import WeightSender
from miles_async.weights.source import iter_buckets
from miles_async.weights.staged import commit, stages
from miles_async.weights.staging import PREFIX, SHM_DIR
from miles_async.weights.update import SHARED_MEMORY, WeightUpdate, route_for

KEY = new_api_key()  # the engine's key, which every call below sends


@pytest.fixture(scope="module")
def engine(tiny_model, tiny_task, tmp_path_factory):
    train, _ = tiny_task
    out = tmp_path_factory.mktemp("shm_engine")
    cfg = parse_args(
        ["--use-tis", "--hf-checkpoint", str(tiny_model), "--prompt-data", str(train), "--rollout-dtype", "float32"]
        + [
            "--rollout-batch-size",
            "2",
            "--n-samples-per-prompt",
            "2",
            "--rm-type",
            "first_integer",
            "--num-rollout",
            "1",
        ]
        + ["--output-dir", str(out)]
    )
    with EmbeddedEngineProcess(replace(cfg.engine, api_key=KEY), 0, str(out)) as proc:
        yield proc


def _ours() -> list[str]:
    """This process's staging files: memfds it holds open, or files in /dev/shm (where there is no memfd)."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own fd, closed by now
            continue
        if target.startswith(f"/memfd:{PREFIX}"):
            held.append(f"{target} {os.stat(f'/proc/self/fd/{fd}').st_ino}")
    return held + glob.glob(os.path.join(SHM_DIR, f"{PREFIX}{os.getpid()}-*"))


def _trained(tiny_model, seed: int) -> dict[str, torch.Tensor]:
    """The tiny model's parameters moved by a seeded random step: what a trainer would send."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    return {n: p.detach() + 0.01 * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


def _update(url: str, version: int, **kw) -> WeightUpdate:
    return WeightUpdate(
        version=version,
        route=route_for("tensor", "embedded"),
        dtype="float32",
        timeout=kw.pop("timeout", 60),
        targets=(url,),
        engine="embedded",
        bucket_bytes=kw.pop("bucket_bytes", 64 << 10),
        api_key=KEY,
        **kw,
    )


def _engine_weights(url: str) -> tuple[dict[str, torch.Tensor], int]:
    async def go():
        async with EmbeddedEngineClient(url, timeout=60, api_key=KEY) as c:
            return await c.get_weights()

    return asyncio.run(go())


def _call(url: str, fn):
    async def go():
        async with EmbeddedEngineClient(url, timeout=60, api_key=KEY) as c:
            return await fn(c)

    return asyncio.run(go())


def _assert_holds(url: str, sent: dict[str, torch.Tensor], version: int) -> None:
    weights, got_version = _engine_weights(url)
    assert got_version == version
    assert _call(url, lambda c: c.model_info())["weight_version"] == version
    for name, t in sent.items():
        assert torch.equal(weights[name], t), name


def test_the_embedded_engine_takes_the_shared_memory_route():
    assert route_for("tensor", "embedded") == SHARED_MEMORY
    assert stages("embedded") and not stages("sglang")


def test_a_push_lands_bitwise_and_leaves_no_file_once_the_sender_closes(engine, tiny_model):
    # Another test's sender, unreachable but not yet collected, may still hold files in this (xdist) process, and
    # its finalizer closes them whenever the collector runs: collect now, and count only this sender's files.
    gc.collect()
    before = set(_ours())

    def this_senders() -> list[str]:
        return sorted(set(_ours()) - before)

    sender = WeightSender()
    try:
        for version, seed in ((4, 1), (5, 2)):
            sent = _trained(tiny_model, seed)
            metrics = sender.push(iter_buckets(sent.items(), torch.float32, 64 << 10), _update(engine.url, version))
            assert metrics["weights/bytes"] == sum(t.numel() * 4 for t in sent.values())
            _assert_holds(engine.url, sent, version)
            if version == 4:
                files = this_senders()
                assert len(files) > 1  # one file per bucket
        assert this_senders() == files  # the second update reused the first one's files
    finally:
        sender.close()
    assert this_senders() == []


def test_an_engine_on_another_node_gets_the_bytes_over_http(engine, tiny_model, monkeypatch):
    # One machine cannot host another node: the node check is the one thing stood in for.
    monkeypatch.setattr(shared_memory, "on_this_node", lambda url: False)
    sent = _trained(tiny_model, 6)
    _, version = _engine_weights(engine.url)
    sender = WeightSender()
    try:
        sender.push(iter_buckets(sent.items(), torch.float32, 64 << 10), _update(engine.url, version + 1))
        staged = sender.push(
            iter_buckets(sent.items(), torch.float32, 64 << 10), _update(engine.url, version + 2, stage_only=True)
        )
        assert staged["staged_urls"] == []  # left for the plain push once the engines are paused
    finally:
        sender.close()
    _assert_holds(engine.url, sent, version + 1)


def test_a_refused_update_changes_nothing_and_leaves_no_file(engine, tiny_model):
    before, version = _engine_weights(engine.url)
    bad = list(_trained(tiny_model, 3).items()) + [("model.no_such_layer.weight", torch.zeros(3))]
    sender = WeightSender()
    try:
        with pytest.raises(EngineError, match="no_such_layer"):
            sender.push(iter_buckets(bad, torch.float32, 64 << 10), _update(engine.url, version + 1))
        assert _ours() == []
    finally:
        sender.close()
    after, still = _engine_weights(engine.url)
    assert still == version
    assert all(torch.equal(after[n], t) for n, t in before.items())


def test_a_timed_out_update_leaves_no_file(tiny_model):
    # A server that accepts connections and never answers: the engine's stage call times out.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept():
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    sender = WeightSender()
    try:
        t0 = time.monotonic()
        with pytest.raises(Exception) as err:
            sender.push(
                iter_buckets(_trained(tiny_model, 4).items(), torch.float32, 64 << 10), _update(url, 1, timeout=1.5)
            )
        assert time.monotonic() - t0 < 30
        assert "timeout" in type(err.value).__name__.lower() or "timed out" in str(err.value).lower()
        assert _ours() == []
    finally:
        sender.close()
        stop.set()
        thread.join(5)
        for s in held:
            s.close()
        listener.close()


def test_staging_runs_while_generating_and_the_commit_swaps_between_two_steps(engine, tiny_model):
    _, v0 = _engine_weights(engine.url)
    sent = _trained(tiny_model, 5)
    sender = WeightSender()

    async def scenario():
        async with EmbeddedEngineClient(engine.url, timeout=120, api_key=KEY) as c:
            params = {"temperature": 0.0, "max_new_tokens": 500, "min_new_tokens": 500, "ignore_eos": True}
            gen = asyncio.create_task(c.generate([1, 2, 3, 4], params))
            while (await c.load())["num_running_reqs"] == 0:
                await asyncio.sleep(0.01)
            steps0 = (await c.load())["decode_steps"]
            staged = await asyncio.to_thread(
                sender.push,
                iter_buckets(sent.items(), torch.float32, 64 << 10),
                _update(engine.url, v0 + 1, stage_only=True),
            )
            assert staged["staged_urls"] == [engine.url]
            # Staged, not applied: the engine still serves the old version and kept decoding meanwhile.
            assert (await c.model_info())["weight_version"] == v0
            await asyncio.sleep(0.2)
            assert (await c.load())["decode_steps"] > steps0
            assert not gen.done()
            await c.pause("in_place")
            await commit([engine.url], v0 + 1, 60, "embedded", False, KEY)
            await c.resume()
            return await gen

    try:
        out = asyncio.run(scenario())
    finally:
        sender.close()
    versions = out["meta_info"]["output_token_weight_versions"]
    # The request ran across the update: old tokens, then new ones, switching once.
    assert versions[0] == v0 and versions[-1] == v0 + 1
    switches = [i for i in range(1, len(versions)) if versions[i] != versions[i - 1]]
    assert len(switches) == 1
    _assert_holds(engine.url, sent, v0 + 1)
    assert _ours() == []


def test_the_engine_keeps_its_mapping_of_a_reused_file_and_drops_the_others(tiny_model):
    from transformers import AutoModelForCausalLM

    from miles_async.inference.embedded.weights import ShmMaps, map_staged
    from miles_async.weights.staging import StagingBuffer

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    sent = _trained(tiny_model, 7)
    buf, maps = StagingBuffer(), ShmMaps()
    try:
        segments, _ = buf.write(iter_buckets(sent.items(), torch.float32, 64 << 10))
        first = map_staged(model, segments, 1, maps)
        segments_again, _ = buf.write(iter_buckets(sent.items(), torch.float32, 64 << 10))
        assert segments_again == segments
        again = map_staged(model, segments_again, 2, maps)
        # The same mapping, not a new one (mapping a file again costs about as much as the copy).
        assert all(again.tensors[n].data_ptr() == first.tensors[n].data_ptr() for n in sent)
        assert all(torch.equal(again.tensors[n], t) for n, t in sent.items())
        fewer = map_staged(model, segments[:1], 3, maps)
        assert len(maps._maps) == 1 and len(fewer.tensors) < len(sent)
    finally:
        buf.close()
    # What is left is the "engine's" side (a mapping holds its file): gone with the mappings and their views.
    assert _ours() != []
    maps.clear()
    del first, again, fewer
    assert _ours() == []


def test_the_engine_maps_only_staging_files(engine):
    for path, why in (
        ("/etc/hostname", "is not a file in /dev/shm"),
        (f"/proc/{os.getpid()}/fd/0", "not a weight staging memfd"),
    ):
        segments = [{"path": path, "tensors": [["model.norm.weight", "float32", [64], 0]]}]
        with pytest.raises(EngineError, match=why):
            _call(engine.url, lambda c, s=segments: c.stage_weights_from_shm(s, 99))


def test_a_commit_without_its_stage_is_refused(engine):
    _, version = _engine_weights(engine.url)
    with pytest.raises(EngineError, match="no staged update of weight version"):
        _call(engine.url, lambda c: c.commit_staged_weights(version + 7))
    assert _engine_weights(engine.url)[1] == version

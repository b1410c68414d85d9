"""Every engine answers only callers that hold the run's API key, on loopback too (``inference/auth.py``).

Real embedded servers, started the way a run starts them: one by an ``EngineHost`` (a placed engine: it listens
on this node's address, as on a Ray cluster with GPUs), one by the inference controller with ``--engine-host`` set
to that address. The key is the run's own, made by ``parse_args``; nothing here hands it to the servers by hand.
Checked: without the key or with a wrong one, generate, the weight updates, abort, pause and the model info
answer 401 (through raw HTTP, the engine client, the router and the weight routes, each naming the engine and
saying the key was missing or refused); with it, all of them work; ``/health`` stays open (as SGLang's does);
the server gets the key in a 0600 file, removed when it stops, never on its command line or in its environment;
the key is in no printed or dumped configuration. Every route, listed from the server's router, is tried in
tests/integration/test_red_team.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from dataclasses import replace

import pytest
import ray
import requests
import torch

from miles_async.arguments import parse_args
from miles_async.config.report import render
from miles_async.inference.auth import KEY_FILE_ENV
from miles_async.inference.client import EngineError
from miles_async.inference.engines import make_client, make_engine_process
from miles_async.inference.launcher import EngineStartError
from miles_async.inference.router import make_router
from miles_async.ray.engine_host import EngineHost
from miles_async.ray.inference_controller import InferenceController
from miles_async.utils.api_key import API_KEY_ENV, ApiKey
from miles_async.weights.driver import weight_update
from miles_async.weights.sender import WeightSender

GREEDY = {"temperature": 0.0, "max_new_tokens": 4}
LONG = {"temperature": 1.0, "max_new_tokens": 200, "min_new_tokens": 200}
WRONG = ApiKey("not-the-run-key")


def _cfg(tiny_model, tiny_task, tmp_path, *extra: str):
    train, _ = tiny_task
    return parse_args(
        [
            "--use-tis", "--hf-checkpoint", str(tiny_model), "--prompt-data", str(train), "--rm-type", "first_integer",
            "--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--rollout-num-threads", "1", "--rollout-dtype", "float32", "--output-dir", str(tmp_path), *extra,
        ]
    )  # fmt: skip


@pytest.fixture(scope="module")
def cfg(tiny_model, tiny_task, tmp_path_factory, monkeypatch_module):
    monkeypatch_module.delenv(API_KEY_ENV, raising=False)
    return _cfg(tiny_model, tiny_task, tmp_path_factory.mktemp("auth_out"))


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def placed(cfg, tmp_path_factory):
    """A placed engine: the EngineHost of bundle 0, as PlacedEngine runs it on its node (here, as a plain object)."""
    log_dir = tmp_path_factory.mktemp("placed_logs")
    host = EngineHost(cfg.engine, 0, str(log_dir))
    info = asyncio.run(host.start())
    try:
        asyncio.run(host.wait_healthy(120))
        key_path = host.proc.key_path
        yield info["url"], log_dir, host
    finally:
        asyncio.run(host.stop())
    assert not key_path.exists()  # the key's file goes with its server


def _prompt() -> list[int]:
    return [5, 6, 7, 8]


# Each guarded call: method, path, JSON body or raw bytes. The two weight updates carry bodies the engine refuses
# (400) once past the key; one that lands is the test below, through the trainer's sender.
GUARDED = {
    "generate": ("POST", "/generate", {"input_ids": [5, 6, 7, 8], "sampling_params": GREEDY}),
    "update_weights_from_tensor": ("POST", "/update_weights_from_tensor", b"x"),
    "update_weights_from_disk": ("POST", "/update_weights_from_disk", {"model_path": "/nonexistent"}),
    "abort_request": ("POST", "/abort_request", {"abort_all": True}),
    "pause_generation": ("POST", "/pause_generation", {"mode": "abort"}),
    "get_model_info": ("GET", "/get_model_info", None),
    "get_weights": ("GET", "/get_weights", None),
}


def _raw(url: str, key: ApiKey | None) -> dict[str, int]:
    """Status of each guarded call made by hand (``requests``), with ``key`` or without any."""
    h = {"Authorization": f"Bearer {key.reveal()}"} if key else {}
    out = {}
    for name, (method, path, body) in GUARDED.items():
        kw = {"data": body} if isinstance(body, bytes) else {"json": body}
        out[name] = requests.request(method, url + path, headers=h, timeout=30, **kw).status_code
    return out


def test_a_placed_engine_listens_beyond_loopback_and_requires_the_run_key(cfg, placed):
    url, log_dir, _ = placed
    assert url.startswith(f"http://{ray.util.get_node_ip_address()}:")  # the node's address, as on a cluster
    assert set(_raw(url, None).values()) == {401}
    assert set(_raw(url, WRONG).values()) == {401}
    with_key = _raw(url, cfg.engine.api_key)
    assert with_key["generate"] == with_key["get_model_info"] == with_key["abort_request"] == 200, with_key
    assert with_key["update_weights_from_tensor"] == with_key["update_weights_from_disk"] == 400  # past the key
    auth = {"Authorization": f"Bearer {cfg.engine.api_key.reveal()}"}
    assert requests.post(url + "/continue_generation", headers=auth, timeout=30).status_code == 200
    assert requests.get(url + "/health", timeout=10).status_code == 200  # the probe stays open, as SGLang's
    assert cfg.engine.api_key.reveal() not in "".join(p.read_text() for p in log_dir.glob("*.log"))


def test_the_client_sends_the_key_and_names_the_engine_when_it_is_missing_or_refused(cfg, placed):
    url, _, _ = placed
    key = cfg.engine.api_key

    async def go(k):
        async with make_client("embedded", url, 30, k) as c:
            out = await c.generate(_prompt(), GREEDY)
            return out, await c.model_info()

    out, info = asyncio.run(go(key))
    assert len(out["output_ids"]) == 4 and info["weight_version"] == 0
    for k, why in ((None, "no API key was sent"), (WRONG, "the API key it was sent was refused")):
        with pytest.raises(EngineError) as e:
            asyncio.run(go(k))
        assert e.value.status == 401 and e.value.url == url and why in str(e.value), str(e.value)


def test_abort_with_the_key_ends_a_running_request_and_without_it_is_refused(cfg, placed):
    url, _, _ = placed

    async def go():
        async with make_client("embedded", url, 60, cfg.engine.api_key) as c, make_client("embedded", url, 60) as bare:
            task = asyncio.create_task(c.generate(_prompt(), LONG, rid="long-1"))
            deadline = time.monotonic() + 30
            while (await c.load())["num_running_reqs"] == 0:
                assert time.monotonic() < deadline, "the request never started"
                await asyncio.sleep(0.05)
            with pytest.raises(EngineError, match="no API key was sent"):
                await bare.abort(rid="long-1")
            await c.abort(rid="long-1")
            return await asyncio.wait_for(task, 30)

    out = asyncio.run(go())
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(out["output_ids"]) < LONG["max_new_tokens"]


def test_the_router_sends_the_key_and_a_refusal_is_not_taken_for_a_dead_engine(cfg, placed):
    url, _, _ = placed

    async def go(key, retry: bool):
        router = make_router([url], 30, backend="embedded", api_key=key, retry=retry, cooldown=0.1)
        try:
            return await router.generate(_prompt(), GREEDY)
        finally:
            await router.close()

    assert len(asyncio.run(go(cfg.engine.api_key, retry=False))["output_ids"]) == 4
    for retry in (False, True):
        with pytest.raises(EngineError) as e:
            asyncio.run(asyncio.wait_for(go(WRONG, retry), 20))  # refused at once, never retried elsewhere
        assert e.value.status == 401 and "refused" in str(e.value) and "may have died" not in str(e.value)


def test_a_weight_update_reaches_the_engine_with_the_key_and_is_refused_without(cfg, placed, tiny_model):
    """The trainer's sender, with the update the driver builds from the config (the http route)."""
    url, _, _ = placed
    update = replace(weight_update(cfg, 1), targets=(url,))
    assert update.api_key == cfg.engine.api_key
    hidden = json.loads((tiny_model / "config.json").read_text())["hidden_size"]
    bucket = [("model.norm.weight", torch.full((hidden,), 0.5))]
    sender = WeightSender()
    with pytest.raises(EngineError, match="no API key was sent"):
        sender.push([bucket], replace(update, api_key=None))
    sender.push([bucket], update)

    async def version():
        async with make_client("embedded", url, 30, cfg.engine.api_key) as c:
            return (await c.model_info())["weight_version"]

    assert asyncio.run(version()) == 1


def test_the_controller_probes_and_drives_engines_beyond_loopback_with_the_key(cfg, tmp_path):
    """--engine-host set to this node's address: the controller's readiness wait, its clients (versions, pause,
    resume) and the health probe all pass, so each sends the key the engine requires."""
    node = ray.util.get_node_ip_address()
    engine_cfg = replace(cfg.engine, host=node)

    async def go():
        controller = InferenceController(engine_cfg, str(tmp_path))
        try:
            urls = await controller.start()
            bare = await asyncio.to_thread(requests.get, urls[0] + "/get_model_info", timeout=10)
            assert bare.status_code == 401  # the engine does require the key
            await controller.pause("abort")
            await controller.resume()
            healthy = await controller.clients[0].health()
            return urls, await controller.weight_versions(), healthy
        finally:
            await controller.dispose()

    urls, versions, healthy = asyncio.run(go())
    assert urls[0].startswith(f"http://{node}:") and versions == [0] and healthy


def test_an_engine_without_a_key_is_refused_before_it_starts_on_loopback_too(cfg, tmp_path):
    for host in (ray.util.get_node_ip_address(), "127.0.0.1"):
        proc = make_engine_process(replace(cfg.engine, host=host, api_key=None), 0, str(tmp_path))
        with pytest.raises(EngineStartError, match="without an API key"):
            proc.start()
        assert proc.proc is None


def test_the_server_gets_the_key_in_a_private_file_only(placed):
    """The placed engine's server: the key is in the 0600 file its environment names, in neither its command line
    nor its environment (both readable by other users of the node: ``ps``, /proc); the file goes when it stops."""
    url, _, host = placed
    key = host.proc.cfg.api_key.reveal()
    pid, key_path = host.proc.proc.pid, host.proc.key_path
    assert (key_path.stat().st_mode & 0o777) == 0o600 and key_path.read_text() == key
    environ = dict(
        entry.split(b"=", 1) for entry in open(f"/proc/{pid}/environ", "rb").read().split(b"\0") if b"=" in entry
    )
    assert environ[KEY_FILE_ENV.encode()] == str(key_path).encode()
    assert key.encode() not in open(f"/proc/{pid}/environ", "rb").read()
    assert key.encode() not in open(f"/proc/{pid}/cmdline", "rb").read()


def test_the_key_is_random_per_run_or_the_users_and_never_printed(cfg, tiny_model, tiny_task, tmp_path, monkeypatch):
    key = cfg.engine.api_key.reveal()
    assert len(key) >= 32
    other = _cfg(tiny_model, tiny_task, tmp_path)
    assert other.engine.api_key.reveal() != key
    dumps = [repr(cfg), str(cfg.engine), render(cfg), json.dumps(dataclasses.asdict(cfg)), repr(weight_update(cfg, 1))]
    assert not any(key in d for d in dumps)
    monkeypatch.setenv(API_KEY_ENV, "users-own-key")
    assert _cfg(tiny_model, tiny_task, tmp_path).engine.api_key.reveal() == "users-own-key"

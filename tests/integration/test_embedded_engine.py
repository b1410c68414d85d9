"""Integration tests of the embedded CPU inference server.

The real server runs as a subprocess on a free 127.0.0.1 port and serves a
tiny random Llama built here (no hub access).  Requests go through
``EngineClient`` so the client is exercised too.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import pytest
import torch

from miles_async.inference.client import EngineClient, EngineError

REPO_ROOT = Path(__file__).resolve().parents[2]
# Slows each decode step a little so pause/abort land while a 200-token
# generation is still running, even on a fast machine.
STEP_DELAY_S = 0.004


def _tiny_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=2,
        bos_token_id=1,
        pad_token_id=0,
        tie_word_embeddings=True,
        # With the default 0.02 init the tied embeddings dominate and greedy
        # decoding just repeats the last prompt token for *any* weights,
        # which would hide weight-update bugs.
        initializer_range=0.2,
    )


def _make_model(seed: int) -> Any:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(_tiny_config()).eval()


def _save_model(path: Path, seed: int) -> Path:
    _make_model(seed).save_pretrained(path, safe_serialization=True)
    return path


def _load_local(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProc:
    def __init__(self, model_dir: Path, log_path: Path, extra: list[str] | None = None):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [
            sys.executable,
            "-m",
            "miles_async.inference.embedded.server",
            "--model-path",
            str(model_dir),
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--num-threads",
            "1",
            "--seed",
            "0",
            "--max-running-requests",
            "16",
            "--step-delay",
            str(STEP_DELAY_S),
            *(extra or []),
        ]
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def wait_healthy(self, timeout: float = 100.0) -> None:
        async def probe() -> bool:
            async with EngineClient(self.url, timeout=2.0) as c:
                return await c.health()

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            if asyncio.run(probe()):
                return
            time.sleep(0.2)
        raise RuntimeError(f"server not healthy after {timeout}s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread() -> Any:
    # Reference forwards here are tiny; with the servers competing for the
    # same 2 cores, multi-threaded OpenMP only adds spin-wait contention.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("embedded_models")
    return {
        "base": _save_model(root / "base", seed=0),
        "alt": _save_model(root / "alt", seed=1),
        "alt2": _save_model(root / "alt2", seed=2),
    }


@pytest.fixture(scope="module")
def server(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    srv = ServerProc(model_dirs["base"], tmp_path_factory.mktemp("logs") / "server.log")
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


def run(fn: Callable[[EngineClient], Awaitable[Any]], url: str, timeout: float = 30.0) -> Any:
    async def main() -> Any:
        async with EngineClient(url, timeout=timeout) as client:
            return await fn(client)

    return asyncio.run(main())


async def _restore_base(client: EngineClient, base: Path) -> None:
    info = await client.model_info()
    await client.update_weights_from_disk(str(base), info["weight_version"] + 1)


async def _wait_running(client: EngineClient, n: int, timeout: float = 20.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        load = await client._request("GET", "/get_load")
        if load["num_running_reqs"] >= n:
            return load
        await asyncio.sleep(0.01)
    raise AssertionError(f"never saw {n} running requests")


GREEDY = {"temperature": 0.0, "max_new_tokens": 24}
LONG = {"temperature": 1.0, "max_new_tokens": 200, "min_new_tokens": 200}


def _prompts(n: int) -> list[list[int]]:
    # Different lengths so batching really needs left padding.
    return [[1] + [(7 * i + 3 * j) % 60 + 3 for j in range(2 + (i % 5) * 3)] for i in range(n)]


def _hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    out: list[int] = []
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(max_new_tokens):
            tok = int(model(input_ids=ids).logits[0, -1].argmax())
            out.append(tok)
            if tok == 2:
                break
            ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
    return out


@pytest.mark.timeout(120)
def test_health_model_info_and_generate(server: ServerProc, model_dirs: dict[str, Path]) -> None:
    async def body(c: EngineClient) -> tuple[bool, dict, dict]:
        return (
            await c.health(),
            await c.model_info(),
            await c.generate([1, 5, 6, 7], {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True}),
        )

    healthy, info, res = run(body, server.url)
    assert healthy
    assert info["model_path"] == str(model_dirs["base"])
    assert info["is_generation"] is True
    assert isinstance(info["weight_version"], int)

    meta = res["meta_info"]
    assert len(res["output_ids"]) == meta["completion_tokens"] == 8
    assert meta["prompt_tokens"] == 4
    assert meta["finish_reason"]["type"] == "length"
    lps = meta["output_token_logprobs"]
    assert len(lps) == meta["completion_tokens"]
    assert all(lp <= 0.0 for lp, _, _ in lps)
    assert [tok for _, tok, _ in lps] == res["output_ids"]
    assert meta["weight_version"] == info["weight_version"]
    assert meta["output_token_weight_versions"] == [info["weight_version"]] * 8
    assert res["text"] == ""  # no tokenizer in the folder


@pytest.mark.timeout(120)
def test_stop_token_included_and_min_new_tokens(server: ServerProc) -> None:
    prompt = [1, 9, 10, 11]

    async def body(c: EngineClient) -> tuple[dict, dict, dict]:
        free = await c.generate(prompt, {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True})
        stop_at = free["output_ids"][3]
        stopped = await c.generate(
            prompt, {"temperature": 0.0, "max_new_tokens": 10, "stop_token_ids": [stop_at], "ignore_eos": True}
        )
        forced = await c.generate(
            prompt,
            {"temperature": 1.0, "max_new_tokens": 30, "min_new_tokens": 30, "stop_token_ids": [stop_at]},
        )
        return free, stopped, forced

    free, stopped, forced = run(body, server.url)
    stop_at = free["output_ids"][3]
    first = free["output_ids"].index(stop_at)
    assert stopped["output_ids"] == free["output_ids"][: first + 1]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}
    assert len(forced["output_ids"]) == 30
    assert stop_at not in forced["output_ids"] and 2 not in forced["output_ids"]


@pytest.mark.timeout(120)
def test_greedy_alone_equals_batched(server: ServerProc, model_dirs: dict[str, Path]) -> None:
    prompts = _prompts(8)
    target = prompts[3]

    async def body(c: EngineClient) -> tuple[dict, list[dict], dict, dict]:
        alone = await c.generate(target, GREEDY)
        before = await c._request("GET", "/get_load")

        async def staggered(i: int, p: list[int]) -> dict:
            # The second half arrives while the first half is decoding, so it
            # is merged into a running batch rather than prefilled with it.
            await asyncio.sleep(0.0 if i < 4 else 0.03)
            return await c.generate(p, GREEDY)

        batched = await asyncio.gather(*(staggered(i, p) for i, p in enumerate(prompts)))
        after = await c._request("GET", "/get_load")
        return alone, batched, before, after

    alone, batched, before, after = run(body, server.url)
    assert batched[3]["output_ids"] == alone["output_ids"]
    # Real batching happened: several rows per forward.
    steps = after["decode_steps"] - before["decode_steps"]
    tokens = after["decode_tokens"] - before["decode_tokens"]
    assert after["max_batch_size"] >= 4
    assert tokens > steps * 2
    # And every row matches a plain unbatched HF greedy decode.
    ref = _load_local(model_dirs["base"])
    for p, res in zip(prompts, batched):
        assert res["output_ids"] == _hf_greedy(ref, p, GREEDY["max_new_tokens"])


@pytest.mark.timeout(120)
def test_logprobs_match_hf_forward(server: ServerProc, model_dirs: dict[str, Path]) -> None:
    prompts = _prompts(5)
    params = [
        # A greedy row in the batch exercises the mixed greedy/sampled path;
        # its log-probs are documented to be at temperature 1.
        {"temperature": 0.0, "max_new_tokens": 16},
        {"temperature": 1.0, "max_new_tokens": 16},
        {"temperature": 1.0, "max_new_tokens": 16},
        {"temperature": 0.7, "top_k": 5, "max_new_tokens": 16},
        {"temperature": 1.3, "top_p": 0.8, "max_new_tokens": 16},
    ]

    async def body(c: EngineClient) -> list[dict]:
        return await asyncio.gather(*(c.generate(p, sp) for p, sp in zip(prompts, params)))

    results = run(body, server.url)
    ref = _load_local(model_dirs["base"])
    for prompt, sp, res in zip(prompts, params, results):
        out = res["output_ids"]
        assert out, "expected at least one token"
        got = torch.tensor([lp for lp, _, _ in res["meta_info"]["output_token_logprobs"]])
        with torch.no_grad():
            logits = ref(input_ids=torch.tensor([prompt + out])).logits[0].float()
        step_logits = logits[len(prompt) - 1 : len(prompt) - 1 + len(out)] / (sp["temperature"] or 1.0)
        if sp["temperature"] == 0.0:
            assert out == step_logits.argmax(-1).tolist()
        if "top_k" in sp:
            kth = step_logits.topk(sp["top_k"], dim=-1).values[:, -1:]
            step_logits = step_logits.masked_fill(step_logits < kth, float("-inf"))
        if "top_p" in sp:
            probs = step_logits.softmax(-1)
            sorted_p, order = probs.sort(-1, descending=True)
            drop_sorted = (sorted_p.cumsum(-1) - sorted_p) > sp["top_p"]
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            step_logits = step_logits.masked_fill(drop, float("-inf"))
        expected = step_logits.log_softmax(-1).gather(-1, torch.tensor(out)[:, None]).squeeze(-1)
        assert torch.allclose(got, expected, atol=1e-4), (sp, got, expected)


@pytest.mark.timeout(120)
def test_pause_abort_then_continue(server: ServerProc) -> None:
    prompts = _prompts(4)

    async def body(c: EngineClient) -> tuple[list[dict], bool, dict]:
        tasks = [asyncio.create_task(c.generate(p, LONG)) for p in prompts]
        await _wait_running(c, len(prompts))
        await c.pause("abort")
        aborted = await asyncio.wait_for(asyncio.gather(*tasks), 10)
        # Accepted while paused, but must wait for continue_generation.
        late = asyncio.create_task(c.generate(prompts[0], {"temperature": 0.0, "max_new_tokens": 5}))
        await asyncio.sleep(0.3)
        waited = not late.done()
        await c.resume()
        return aborted, waited, await asyncio.wait_for(late, 10)

    aborted, waited, late = run(body, server.url)
    for res in aborted:
        meta = res["meta_info"]
        assert meta["finish_reason"]["type"] == "abort"
        assert 0 < len(res["output_ids"]) < 200
        assert len(meta["output_token_logprobs"]) == len(res["output_ids"])
    assert waited, "a request sent while paused finished before continue_generation"
    assert late["meta_info"]["finish_reason"]["type"] in ("length", "stop")
    assert len(late["output_ids"]) >= 1


@pytest.mark.timeout(120)
def test_pause_in_place_weight_update_continue(server: ServerProc, model_dirs: dict[str, Path]) -> None:
    alt = _make_model(seed=1).state_dict()
    names = [n for n in alt if n != "lm_head.weight"]
    half = len(names) // 2

    async def body(c: EngineClient) -> tuple[int, dict, int, int]:
        v0 = (await c.model_info())["weight_version"]
        task = asyncio.create_task(c.generate([1, 4, 5, 6], LONG))
        await _wait_running(c, 1)
        await asyncio.sleep(0.05)
        await c.pause("in_place")
        frozen = (await c._request("GET", "/get_load"))["decode_steps"]
        await asyncio.sleep(0.2)
        still = (await c._request("GET", "/get_load"))["decode_steps"]
        # Two buckets; the version flips with the last one.
        await c.update_weights_from_tensors([(n, alt[n]) for n in names[:half]], None, flush=False)
        r = await c.update_weights_from_tensors([(n, alt[n]) for n in names[half:]], v0 + 1, flush=True)
        assert r["weight_version"] == v0 + 1
        await c.resume()
        res = await asyncio.wait_for(task, 20)
        await _restore_base(c, model_dirs["base"])
        return v0, res, frozen, still

    v0, res, frozen, still = run(body, server.url)
    assert frozen == still, "decoding continued while paused in place"
    versions = res["meta_info"]["output_token_weight_versions"]
    assert res["meta_info"]["finish_reason"]["type"] == "length"
    assert len(versions) == len(res["output_ids"]) == 200
    assert v0 in versions and v0 + 1 in versions
    switch = versions.index(v0 + 1)
    assert versions[:switch] == [v0] * switch and versions[switch:] == [v0 + 1] * (200 - switch)
    assert res["meta_info"]["weight_version"] == v0 + 1


@pytest.mark.timeout(120)
def test_update_weights_from_disk_and_tensor(server: ServerProc, model_dirs: dict[str, Path]) -> None:
    prompt = [1, 20, 21, 22, 23]
    alt2 = _make_model(seed=2).state_dict()

    async def body(c: EngineClient) -> dict[str, Any]:
        out: dict[str, Any] = {"v0": (await c.model_info())["weight_version"]}
        out["base"] = (await c.generate(prompt, GREEDY))["output_ids"]
        r = await c.update_weights_from_disk(str(model_dirs["alt"]), out["v0"] + 1)
        out["disk_resp"] = r
        out["info_after_disk"] = await c.model_info()
        out["alt"] = await c.generate(prompt, GREEDY)
        # Tied embeddings: send only lm_head.weight for the shared matrix.
        tensors = [(n, t.to(torch.bfloat16)) for n, t in alt2.items() if n != "model.embed_tokens.weight"]
        out["tensor_resp"] = await c.update_weights_from_tensors(tensors, out["v0"] + 2, flush=True)
        out["alt2"] = await c.generate(prompt, GREEDY)
        try:
            await c.update_weights_from_tensors([("model.no_such.weight", torch.zeros(3))], out["v0"] + 3, True)
        except EngineError as exc:
            out["unknown_error"] = exc
        out["info_after_error"] = await c.model_info()
        try:
            await c.update_weights_from_disk(str(model_dirs["base"] / "missing"), None)
        except EngineError as exc:
            out["disk_error"] = exc
        await _restore_base(c, model_dirs["base"])
        out["restored"] = (await c.generate(prompt, GREEDY))["output_ids"]
        return out

    out = run(body, server.url)
    v0 = out["v0"]
    assert out["disk_resp"]["success"] and out["disk_resp"]["weight_version"] == v0 + 1
    assert out["info_after_disk"]["weight_version"] == v0 + 1
    assert out["info_after_disk"]["model_path"] == str(model_dirs["alt"])
    assert out["alt"]["meta_info"]["weight_version"] == v0 + 1
    assert out["alt"]["output_ids"] != out["base"]
    assert out["alt"]["output_ids"] == _hf_greedy(_load_local(model_dirs["alt"]), prompt, GREEDY["max_new_tokens"])

    assert out["tensor_resp"]["weight_version"] == v0 + 2
    assert out["alt2"]["meta_info"]["weight_version"] == v0 + 2
    assert out["alt2"]["output_ids"] != out["alt"]["output_ids"]
    ref2 = _make_model(seed=2)
    ref2.load_state_dict({n: t.to(torch.bfloat16).float() for n, t in alt2.items()})
    assert out["alt2"]["output_ids"] == _hf_greedy(ref2, prompt, GREEDY["max_new_tokens"])

    err = out["unknown_error"]
    assert err.status == 400 and "model.no_such.weight" in str(err)
    assert "/update_weights_from_tensor" in str(err) and server.url in str(err)
    assert out["info_after_error"]["weight_version"] == v0 + 2
    assert out["disk_error"].status == 400
    assert out["restored"] == out["base"]


@pytest.mark.timeout(120)
def test_abort_request_by_rid(server: ServerProc) -> None:
    async def body(c: EngineClient) -> tuple[dict, dict, dict]:
        task = asyncio.create_task(c.generate([1, 30, 31], LONG, rid="victim"))
        other = asyncio.create_task(c.generate([1, 32, 33], {**LONG, "max_new_tokens": 60, "min_new_tokens": 60}))
        await _wait_running(c, 2)
        await asyncio.sleep(0.05)
        resp = await c.abort(rid="victim")
        return await asyncio.wait_for(task, 10), await asyncio.wait_for(other, 20), resp

    victim, other, resp = run(body, server.url)
    assert resp["num_aborted"] == 1
    assert victim["meta_info"]["id"] == "victim"
    assert victim["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(victim["output_ids"]) < 200
    # Aborting one row must not disturb its batch neighbour.
    assert other["meta_info"]["finish_reason"]["type"] == "length"
    assert len(other["output_ids"]) == 60


@pytest.mark.timeout(120)
def test_flush_cache_mid_generation_keeps_greedy_output(server: ServerProc) -> None:
    """Flushing drops the KV cache; running rows are re-prefilled and must continue identically."""
    params = {"temperature": 0.0, "max_new_tokens": 120, "ignore_eos": True}
    prompt = [1, 44, 45, 46, 47]

    async def body(c: EngineClient) -> tuple[dict, dict, dict]:
        plain = await c.generate(prompt, params)
        before = await c._request("GET", "/get_load")
        task = asyncio.create_task(c.generate(prompt, params))
        await _wait_running(c, 1)
        await asyncio.sleep(0.1)
        await c.flush_cache()
        await c.pause("in_place")
        await c.flush_cache()  # must be safe while paused, too
        await c.resume()
        flushed = await asyncio.wait_for(task, 20)
        return plain, flushed, {"before": before, "after": await c._request("GET", "/get_load")}

    plain, flushed, loads = run(body, server.url)
    assert flushed["output_ids"] == plain["output_ids"]
    # The flushes really forced extra prefills (1 for the request, 1-2 re-prefills).
    assert loads["after"]["prefill_batches"] - loads["before"]["prefill_batches"] >= 2


@pytest.mark.timeout(120)
def test_max_running_requests_and_abort_all(server: ServerProc) -> None:
    prompts = _prompts(20)  # the server runs with --max-running-requests 16

    async def body(c: EngineClient) -> tuple[dict, list[dict], dict]:
        tasks = [asyncio.create_task(c.generate(p, LONG)) for p in prompts]
        load = await _wait_running(c, 16)
        await asyncio.sleep(0.05)
        load = await c._request("GET", "/get_load")
        resp = await c.abort(abort_all=True)
        return load, await asyncio.wait_for(asyncio.gather(*tasks), 10), resp

    load, results, resp = run(body, server.url)
    assert load["num_running_reqs"] == 16
    assert load["num_waiting_reqs"] == 4
    assert resp["num_aborted"] == 20
    assert all(r["meta_info"]["finish_reason"]["type"] == "abort" for r in results)
    started = [r for r in results if r["output_ids"]]
    assert len(started) == 16  # the 4 queued ones never got a slot


@pytest.mark.timeout(120)
def test_bad_requests_are_400(server: ServerProc) -> None:
    async def body(c: EngineClient) -> list[EngineError]:
        errors = []
        for payload in (
            {"sampling_params": {"max_new_tokens": 4}},
            {"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}},
            {"input_ids": [1, 999]},
            {"input_ids": [1, 2], "sampling_params": {"frequency_penalty": 0.5}},
        ):
            try:
                await c._request("POST", "/generate", json_body=payload)
            except EngineError as exc:
                errors.append(exc)
        return errors

    errors = run(body, server.url)
    assert len(errors) == 4
    assert all(e.status == 400 and e.endpoint == "/generate" for e in errors)
    assert "input_ids" in str(errors[0])
    assert "sampling_params.temperature" in str(errors[1])
    assert "input_ids" in str(errors[2])
    assert "sampling_params.frequency_penalty" in str(errors[3])


@pytest.mark.timeout(120)
def test_client_timeout_raises_and_frees_slot(server: ServerProc) -> None:
    async def body(c: EngineClient) -> tuple[EngineError | None, dict]:
        err = None
        try:
            await c.generate([1, 40, 41], LONG, timeout=0.2)
        except EngineError as exc:
            err = exc
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            load = await c._request("GET", "/get_load")
            if load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0:
                break
            await asyncio.sleep(0.02)
        return err, load

    err, load = run(body, server.url)
    assert err is not None and "timed out" in str(err) and "/generate" in str(err)
    # The server noticed the disconnect and dropped the request well before 200 tokens.
    assert load["num_running_reqs"] == 0


@pytest.mark.timeout(120)
def test_sigterm_exits_promptly(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    srv = ServerProc(model_dirs["base"], tmp_path / "sigterm.log")
    try:
        srv.wait_healthy()

        async def body(c: EngineClient) -> Any:
            task = asyncio.create_task(c.generate([1, 3, 4], LONG))
            await _wait_running(c, 1)
            srv.proc.send_signal(signal.SIGTERM)
            try:
                return await asyncio.wait_for(task, 10)
            except EngineError as exc:
                return exc

        t0 = time.monotonic()
        inflight = run(body, srv.url)
        code = srv.proc.wait(timeout=8)
        elapsed = time.monotonic() - t0
    finally:
        srv.stop()
    assert elapsed < 8
    assert code == 0, srv.log_tail()
    # The in-flight request got an answer (its partial output) rather than hanging.
    assert isinstance(inflight, dict), inflight
    assert inflight["meta_info"]["finish_reason"]["type"] == "abort"


@pytest.mark.timeout(120)
def test_dead_decode_thread_fails_requests(model_dirs: dict[str, Path]) -> None:
    """In-process: if the decode thread dies, pending and later requests get 500, health 500."""
    from aiohttp.test_utils import TestServer

    from miles_async.inference.embedded.engine import Engine
    from miles_async.inference.embedded.server import build_app

    engine = Engine(str(model_dirs["base"]), dtype=torch.float32)

    def broken_forward(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("simulated kernel failure")

    engine.model.forward = broken_forward
    engine.start()

    async def main() -> tuple[list[Any], bool, Any]:
        srv = TestServer(build_app(engine), host="127.0.0.1")
        await srv.start_server()
        url = str(srv.make_url("")).rstrip("/")
        try:
            async with EngineClient(url, timeout=10) as c:
                first = await asyncio.gather(
                    *(c.generate([1, 2, 3], GREEDY) for _ in range(3)), return_exceptions=True
                )
                later = await asyncio.gather(c.generate([1, 2, 3], GREEDY), return_exceptions=True)
                return first + later, await c.health(), await asyncio.gather(c.pause(), return_exceptions=True)
        finally:
            await srv.close()

    results, healthy, pause = asyncio.run(main())
    assert not healthy
    for r in results + pause:
        assert isinstance(r, EngineError) and r.status == 500, r
        assert "simulated kernel failure" in str(r)


@pytest.mark.timeout(120)
def test_identical_prompts_share_one_prefill(server: ServerProc, model_dirs: dict[str, Path]) -> None:
    """A GRPO group sends one prompt n times: it is prefilled once, and every copy still decodes correctly."""
    prompt = _prompts(6)[5]
    params = {"temperature": 1.0, "max_new_tokens": 12}

    async def body(c: EngineClient) -> tuple[list[dict], dict, dict]:
        before = await c._request("GET", "/get_load")
        outs = await asyncio.gather(*(c.generate(prompt, params) for _ in range(8)))
        after = await c._request("GET", "/get_load")
        return outs, before, after

    outs, before, after = run(body, server.url)
    assert after["prefill_rows_deduplicated"] > before["prefill_rows_deduplicated"]
    assert len({tuple(o["output_ids"]) for o in outs}) > 1  # the copies sample independently
    ref = _load_local(model_dirs["base"])
    for res in outs:
        out = res["output_ids"]
        got = torch.tensor([lp for lp, _, _ in res["meta_info"]["output_token_logprobs"]])
        with torch.no_grad():
            logits = ref(input_ids=torch.tensor([prompt + out])).logits[0].float()
        expected = logits[len(prompt) - 1: len(prompt) - 1 + len(out)].log_softmax(-1)
        expected = expected.gather(-1, torch.tensor(out)[:, None]).squeeze(-1)
        assert torch.allclose(got, expected, atol=1e-4)

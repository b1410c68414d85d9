"""The embedded server under test: a tiny random Llama built here (no hub access), the real server as a subprocess
listening on a 127.0.0.1 socket bound here (``--listen-fd``, as its launcher runs it), and what the tests send it.
Requests go through ``EmbeddedEngineClient``, so the client is exercised too. Every server requires ``KEY`` (read
from a 0600 file, as the launcher hands it over), which ``run`` and the probes send."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.engine_doubles import fixed_step_cost_env
from miles_async.inference.auth import KEY_FILE_ENV
from miles_async.inference.embedded.client import EmbeddedEngineClient
from miles_async.utils.api_key import new_api_key
from miles_async.utils.credentials import private_file
from miles_async.utils.ports import bound_socket

REPO_ROOT = Path(__file__).resolve().parents[3]
# Each decode step costs a little more (an engine double), so pause/abort land while a 200-token
# generation is still running, even on a fast machine.
STEP_SECONDS = 0.004

GREEDY = {"temperature": 0.0, "max_new_tokens": 24}
LONG = {"temperature": 1.0, "max_new_tokens": 200, "min_new_tokens": 200}
KEY = new_api_key()  # the key every server here requires


def tiny_config() -> Any:
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


def make_model(seed: int) -> Any:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_config()).eval()


def save_model(path: Path, seed: int) -> Path:
    make_model(seed).save_pretrained(path, safe_serialization=True)
    return path


def load_local(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


# The line the server logs once it listens, naming the port it got.
SERVING = re.compile(r"serving \S+ on http://127\.0\.0\.1:(\d+)")


class ServerProc:
    """``port`` None (the default): the server listens on a socket bound here; a number: ``--port`` (0: the kernel
    picks, and ``port``/``url`` are what the server's log says once ``wait_healthy`` read it)."""

    def __init__(self, model_dir: Path, log_path: Path, extra: list[str] | None = None, port: int | None = None):
        sock = bound_socket("127.0.0.1") if port is None else None
        self.port = sock.getsockname()[1] if sock else port
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [
            sys.executable,
            "-m",
            "miles_async.inference.embedded.server",
            "--model-path",
            str(model_dir),
            *(["--listen-fd", str(sock.fileno())] if sock else ["--port", str(port)]),
            "--dtype",
            "float32",
            "--num-threads",
            "1",
            "--seed",
            "0",
            "--max-running-requests",
            "16",
            *(extra or []),
        ]
        self.key_file = private_file(KEY.reveal(), log_path.with_suffix(".key"))
        env = dict(os.environ, **fixed_step_cost_env(STEP_SECONDS), **{KEY_FILE_ENV: str(self.key_file)})
        env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        self._log = open(log_path, "wb")
        fds = (sock.fileno(),) if sock else ()
        self.proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT, pass_fds=fds
        )
        if sock:
            sock.close()  # the server holds its own copy

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def wait_healthy(self, timeout: float = 100.0) -> None:
        async def probe() -> bool:
            async with EmbeddedEngineClient(self.url, timeout=2.0, api_key=KEY) as c:
                return await c.health()

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self.port == 0 and (said := SERVING.search(self.log_path.read_text(errors="replace"))):
                self.port = int(said[1])
                self.url = f"http://127.0.0.1:{self.port}"
            if self.port != 0 and asyncio.run(probe()):
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


def run(fn: Callable[[EmbeddedEngineClient], Awaitable[Any]], url: str, timeout: float = 30.0) -> Any:
    async def main() -> Any:
        async with EmbeddedEngineClient(url, timeout=timeout, api_key=KEY) as client:
            return await fn(client)

    return asyncio.run(main())


async def restore_base(client: EmbeddedEngineClient, base: Path) -> None:
    info = await client.model_info()
    await client.update_weights_from_disk(str(base), info["weight_version"] + 1)


async def wait_running(client: EmbeddedEngineClient, n: int, timeout: float = 20.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        load = await client.load()
        if load["num_running_reqs"] >= n:
            return load
        await asyncio.sleep(0.01)
    raise AssertionError(f"never saw {n} running requests")


def make_prompts(n: int) -> list[list[int]]:
    # Different lengths so batching really needs left padding.
    return [[1] + [(7 * i + 3 * j) % 60 + 3 for j in range(2 + (i % 5) * 3)] for i in range(n)]


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
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

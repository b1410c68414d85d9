"""SGLang's real server as an engine: ``sglang.launch_server`` in SGLang's own environment.

The server runs as a subprocess of the inference controller (same lifetime rules as the embedded
engine: ``EngineProcess``), with the python of SGLang's virtual environment
(``scripts/setup_sglang_env.sh``); the project's code only talks HTTP to it (``SGLangEngineClient``).

Command line: model, host/port, dtype, ``--max-running-requests`` (--sglang-server-concurrency),
``--tp-size`` (--rollout-num-gpus-per-engine), ``--random-seed``, ``--weight-version`` (the version
the engine starts at), ``--enable-return-routed-experts`` under ``--use-rollout-routing-replay`` (an MoE model:
``/generate`` then returns each token's experts when asked, ``return_routed_experts``), then every
``--sglang-<flag>`` of our command line as ``--<flag>``.
On GPUs an engine takes the ``tp`` GPUs of its slot (``--base-gpu-id``; ``EngineProcess.gpu_slot``) of those
visible to it: on a cluster, its placement bundle's. Without a GPU, SGLang's CPU engine: ``SGLANG_USE_CPU_ENGINE=1`` and
``--device cpu --attention-backend torch_native --disable-cuda-graph --max-total-tokens 32768 --sleep-on-idle``
(each only where the passthrough flags do not set it), plus the CPU stand-ins of
``cpu_shims/`` (beside this module) on the engine's PYTHONPATH (``sgl_kernel``'s CPU ops are not on PyPI).
Every server requires the run's key. SGLang reads it from its command line only (``--api-key``), which ``ps``
shows to every user of the node, so the server is started through ``serve.py`` (``python -m
miles_async.inference.sglang.serve``, this checkout on its PYTHONPATH), which reads the key from the launcher's
0600 file and puts it into ``sys.argv`` before SGLang parses it: the process's command line never holds it. Its log
masks it (SGLang prints every server argument; see ``EngineProcess.start``). SGLang then answers 401 to every
request without it but ``/health*``, ``/ready*`` and ``/metrics*`` (``sglang.srt.utils.auth``; the weight
endpoints are ADMIN_OPTIONAL, which take the key while no ``--admin-api-key`` is set).
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from miles_async.config.engine_kinds import engine_python
from miles_async.inference.client import SERVER_KEEP_ALIVE_S
from miles_async.inference.launcher import ROOT, ServerEngineProcess

CPU_SHIMS = Path(__file__).resolve().parent / "cpu_shims"
SERVE = "miles_async.inference.sglang.serve"  # sglang.launch_server with the key from its file
CPU_DEFAULTS = (
    ("--device", "cpu"),
    ("--attention-backend", "torch_native"),
    ("--disable-cuda-graph", None),
    ("--max-total-tokens", "32768"),
    # An idle scheduler otherwise spins a whole core polling for requests: on a CPU machine that core is the
    # trainer's (or a second engine's). Sleeping, it blocks on its request sockets and wakes as one arrives.
    ("--sleep-on-idle", None),
)


def cpu_shims_dir() -> Path:
    return Path(os.environ.get("MILES_ASYNC_SGLANG_CPU_SHIMS", CPU_SHIMS))


class SGLangEngineProcess(ServerEngineProcess):
    """One SGLang server."""

    def command(self) -> list[str]:
        cfg = self.cfg
        cmd = [
            engine_python("sglang", cfg.sglang_python),
            "-m",
            SERVE,
            "--model-path",
            self.model_path,
            "--host",
            cfg.host,
            "--port",
            str(self.port),
            "--dtype",
            cfg.dtype,
            "--max-running-requests",
            str(cfg.max_running_requests),
            "--tp-size",
            str(cfg.num_gpus_per_engine),
            "--random-seed",
            str(cfg.seed + self.index),
            "--weight-version",
            str(self.weight_version),
        ]
        given = self.given(cfg.sglang_args)
        if cfg.return_routed_experts and "--enable-return-routed-experts" not in given:
            cmd += ["--enable-return-routed-experts"]  # --use-rollout-routing-replay: capture each token's experts
        if cfg.use_gpu:
            if "--base-gpu-id" not in given:
                cmd += ["--base-gpu-id", str(self.gpu_slot * cfg.num_gpus_per_engine)]
        else:
            for flag, value in CPU_DEFAULTS:
                if flag not in given:
                    cmd += [flag] if value is None else [flag, value]
        return cmd + list(cfg.sglang_args)

    def env(self) -> dict:
        env = super().env()
        env.setdefault("SGLANG_TIMEOUT_KEEP_ALIVE", str(SERVER_KEEP_ALIVE_S))
        # SGLang keeps a VLM's vision-tower outputs by image hash across requests (mm_schedule.embedding_cache), and
        # neither a weight update nor /flush_cache clears it: an image seen before an update kept the old tower's
        # embeddings (tests/engines/test_vlm_engines.py). A size of 0 caches none.
        env.setdefault("SGLANG_VLM_CACHE_SIZE_MB", "0")
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(ROOT)]
        if not self.cfg.use_gpu:
            env["SGLANG_USE_CPU_ENGINE"] = "1"
            shims = cpu_shims_dir()
            if shims.is_dir():
                paths.insert(0, str(shims))
        env["PYTHONPATH"] = os.pathsep.join([*paths, str(ROOT)])  # the checkout: serve.py runs from it
        return env

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM to the server alone: it shuts its scheduler and detokenizer down itself (~6 s on a CPU) and
        releases their semaphores; signalling the whole group at once makes them linger until SIGKILL, which
        leaks the semaphores in /dev/shm. Whatever is left after ``grace`` seconds is killed."""
        self._remove_key_file()
        if self.proc is None or self.proc.poll() is not None:
            return
        shm = self._shm_files()
        try:
            os.kill(self.proc.pid, signal.SIGTERM)
            self.proc.wait(grace)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # children still alive, if any
        except (ProcessLookupError, PermissionError):
            pass
        if self.proc.poll() is None:
            self.proc.wait(5)
        for path in shm:  # SGLang leaves its load-snapshot file behind even on a clean exit
            try:
                os.unlink(path)
            except OSError:
                pass

    def _shm_files(self) -> set[str]:
        """The /dev/shm/sglang_loads_* files this server's processes (its process group) have mapped or open."""
        found: set[str] = set()
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    if int(fh.read().rsplit(")", 1)[1].split()[2]) != self.proc.pid:  # field 5: pgrp
                        continue
                with open(f"/proc/{entry}/maps") as fh:
                    found.update(line.split()[-1] for line in fh if "/dev/shm/sglang_loads_" in line)
                for fd in os.listdir(f"/proc/{entry}/fd"):
                    target = os.readlink(f"/proc/{entry}/fd/{fd}")
                    if target.startswith("/dev/shm/sglang_loads_"):
                        found.add(target)
            except (OSError, ValueError, IndexError):
                continue
        return found

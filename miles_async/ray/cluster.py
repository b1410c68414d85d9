"""Ray start-up and per-actor resource options (threads bounded so cores are not oversubscribed)."""

from __future__ import annotations

import logging
import os
import socket
import time

import ray

from miles_async.config import ClusterConfig
from miles_async.utils.credentials import is_secret_name, secrets_withheld

logger = logging.getLogger(__name__)


# The run's own settings reach its workers through their environment (plugin classes, test doubles, log level):
# the driver's MILES_ASYNC_* variables, but never a credential among them.
_SETTING_PREFIX = "MILES_ASYNC_"


def job_env(environ: dict[str, str]) -> dict[str, str]:
    """Every worker's environment additions: offline tokenizers, and the driver's MILES_ASYNC_* settings without
    its secrets. A cluster the run starts would pass its workers the driver's whole environment; one it joins
    (--ray-address) passes them only this, so the same settings hold on both. Pure."""
    settings = {k: v for k, v in environ.items() if k.startswith(_SETTING_PREFIX) and not is_secret_name(k)}
    return {**settings, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


# Ray's driver retries a GCS that does not answer for ever: a run given a dead --ray-address would hang silently.
JOIN_TIMEOUT_S = 60.0


def wait_reachable(address: str, timeout: float) -> None:
    """Wait until the GCS at ``address`` (host:port) accepts connections, or raise naming --ray-address."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return  # "auto" or a client address ray:// : Ray resolves and reports those itself
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=2.0).close()
            return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"--ray-address {address}: nothing accepted a connection there for {timeout:.0f} s ({e}); "
                    "is that Ray cluster's head up?"
                ) from e
            time.sleep(1.0)


def init_ray(cfg: ClusterConfig) -> None:
    if ray.is_initialized():
        return
    env = job_env(dict(os.environ))
    if cfg.ray_address:
        wait_reachable(cfg.ray_address, JOIN_TIMEOUT_S)
        ray.init(address=cfg.ray_address, runtime_env={"env_vars": env}, logging_level=logging.WARNING)
    else:
        # address="local": always a fresh cluster of our own, even if another one runs on this machine. Its
        # processes (GCS, raylet, and the workers the raylet starts) copy this process's environment: they start
        # without its credentials, which only the driver uses (wandb, the control API).
        with secrets_withheld():
            ray.init(
                address="local",
                num_cpus=os.cpu_count(),
                include_dashboard=False,
                runtime_env={"env_vars": env},
                # Ray would start a worker per CPU for tasks the run never sends (its actors each get their own, for
                # their runtime_env): a second of CPU each, and they hold Ray's start-up slots the actors then wait
                # for.
                _system_config={"prestart_worker_first_driver": False},
                logging_level=logging.WARNING,
            )


def actor_options(num_threads: int) -> dict:
    """Resource requests: actors ask for no Ray CPUs (their threads are bounded instead), so a 2-core laptop can
    host the executor, the controller and a trainer at once. GPUs come from placement bundles
    (``ray.placement``), never from here."""
    return {
        "num_cpus": 0,
        "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(num_threads), "MKL_NUM_THREADS": str(num_threads)}},
    }

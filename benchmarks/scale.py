"""How orchestration cost grows with the number of engines and of requests in flight.

N stand-in engines (``benchmarks.http_engine_doubles``: HTTP servers that answer ``/generate`` with one token at
once, all N in one separate process) take the place of real ones, so what a rollout step costs is the
orchestration alone. For each N in {1, 4, 16, 64} and each number of requests in flight (= samples per step,
``--rollout-batch-size`` x ``--n-samples-per-prompt``, with ``--rollout-max-concurrent-requests`` as large so
every sample is in flight at once) in {64, 512, 2048, 8192}, the real ``RolloutExecutor`` (built from
``parse_args`` as a run builds it; its router, data source, generate function, reward and the ``ray.put`` of the
train batch) runs rollout steps against them in this process. What is reported is microseconds per sample,
wall-clock and this process's CPU time, next to a bare Ray actor round trip measured in the same run.

What this leaves out is the loop around the executor (the Ray call to the executor actor and the hand-off of each
batch to the trainer): both are per step, not per sample, and ``benchmarks.orchestration`` measures them through a
real ``train_async.py`` run. ``train_async.py`` cannot be pointed at stand-in engines (it launches its own), and N
real engine processes do not fit this benchmark's machine for N = 64.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from benchmarks.common import ROOT, table, tiny_run_flags, tiny_setup
from benchmarks.orchestration import bare_ray_round_trip_us

ENGINES = (1, 4, 16, 64)
IN_FLIGHT = (64, 512, 2048, 8192)
SAMPLES_PER_PROMPT = 8


@contextlib.contextmanager
def stand_in_engines(n: int, work: Path, timeout: float = 60.0) -> Iterator[list[str]]:
    """``n`` stand-in engines in one child process for the duration of the block: their URLs."""
    url_file = work / f"standin_{n}.urls"
    url_file.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.http_engine_doubles", str(n), str(url_file)], cwd=ROOT, env=env
    )
    try:
        deadline = time.monotonic() + timeout
        while not url_file.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"the stand-in engines exited with code {proc.returncode} before listening")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {n} stand-in engines did not listen within {timeout:.0f} s")
            time.sleep(0.05)
        yield url_file.read_text().split()
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _executor(urls: list[str], model: Path, data: Path, in_flight: int):
    """The real RolloutExecutor, configured as ``train_async.py`` would be with these flags."""
    from miles_async.arguments import parse_args
    from miles_async.ray.rollout_executor import RolloutExecutor

    cfg = parse_args(
        [
            *tiny_run_flags(model, data, in_flight // SAMPLES_PER_PROMPT, SAMPLES_PER_PROMPT, 1, rollout_dtype=None),
            "--rollout-max-concurrent-requests",
            str(in_flight),
            "--num-rollout",
            "1",
            "--use-tis",
        ]
    )
    return RolloutExecutor(cfg.rollout, cfg.eval, cfg.engine, urls)


def executor_path(urls: list[str], model: Path, data: Path, in_flight: int, min_samples: int) -> dict:
    """Rollout steps through the executor: one warm-up step (connections, prompt tokenisation), then at least
    ``min_samples`` samples (3 steps at least); medians per step."""
    steps = max(3, -(-min_samples // in_flight))

    async def go() -> tuple[list[float], list[float]]:
        ex = _executor(urls, model, data, in_flight)
        try:
            await ex.generate(0)
            walls, cpus = [], []
            for i in range(1, steps + 1):
                w0, c0 = time.perf_counter(), time.process_time()
                out = await ex.generate(i)
                walls.append(time.perf_counter() - w0)
                cpus.append(time.process_time() - c0)
                if len(out["data"]) != 1:
                    raise RuntimeError(f"the executor returned {len(out['data'])} batches for one step")
            return walls, cpus
        finally:
            await ex.dispose()

    walls, cpus = asyncio.run(go())
    return {
        "steps": steps,
        "us_per_sample": statistics.median(walls) / in_flight * 1e6,
        "cpu_us_per_sample": statistics.median(cpus) / in_flight * 1e6,
    }


def run(quick: bool, out_dir: Path) -> dict:
    import ray

    engines = (1, 16) if quick else ENGINES
    in_flight = (64, 2048) if quick else IN_FLIGHT
    min_samples = 2048 if quick else 8192
    work = Path(tempfile.mkdtemp(prefix="miles_async_scale_"))
    grid: dict[str, dict] = {}
    try:
        model, data, _ = tiny_setup(work, n_train=max(in_flight) // SAMPLES_PER_PROMPT)
        ray_us = bare_ray_round_trip_us(200 if quick else 1000)
        # The executor puts each train batch in the object store: a local Ray, as in a run's driver.
        ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
        try:
            for n in engines:
                with stand_in_engines(n, work) as urls:
                    for f in in_flight:
                        r = executor_path(urls, model, data, f, min_samples)
                        grid[f"{n}x{f}"] = {"engines": n, "in_flight": f, **r}
                        print(f"scale: {n} engines, {f} in flight: {r['us_per_sample']:.0f} us/sample", flush=True)
        finally:
            ray.shutdown()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    us = {k: v["us_per_sample"] for k, v in grid.items()}
    smallest = f"{min(engines)}x{min(in_flight)}"
    largest = f"{max(engines)}x{max(in_flight)}"
    cpu = {k: v["cpu_us_per_sample"] for k, v in grid.items()}
    ratio, cpu_ratio = us[largest] / us[smallest], cpu[largest] / cpu[smallest]
    spread, cpu_spread = max(us.values()) / min(us.values()), max(cpu.values()) / min(cpu.values())
    rows = [
        [f"{n} engines"]
        + [f"{grid[f'{n}x{f}']['us_per_sample']:.0f} ({grid[f'{n}x{f}']['cpu_us_per_sample']:.0f})" for f in in_flight]
        for n in engines
    ]
    return {
        "results": {
            "bare_ray_round_trip_us": ray_us,
            "grid": grid,
            "largest_over_smallest": ratio,
            "max_over_min": spread,
            "cpu_largest_over_smallest": cpu_ratio,
            "cpu_max_over_min": cpu_spread,
        },
        "tables": [
            table(
                "Orchestration cost per sample against N stand-in engines (router + rollout executor), "
                "us wall (us CPU of the orchestrating process)",
                ["engines \\ requests in flight", *[str(f) for f in in_flight]],
                rows,
                f"largest / smallest setting ({largest} / {smallest}): {ratio:.2f}x wall, {cpu_ratio:.2f}x CPU; "
                f"slowest / fastest cell: {spread:.2f}x wall, {cpu_spread:.2f}x CPU; bare Ray actor round trip, "
                f"same run: {ray_us:.0f} us",
            )
        ],
        "notes": [
            "Measured through the real RolloutExecutor (router, data source, default generate function, reward, "
            "ray.put of the train batch) in the benchmark's process, against N stand-in engines that answer "
            "/generate with one token at once: plain asyncio HTTP/1.1 servers, all N on N ports of one separate "
            "process (on this 2-core machine N interpreters would measure the scheduler).",
            "Every sample of a step is in flight at once (--rollout-max-concurrent-requests = samples per step); "
            f"{SAMPLES_PER_PROMPT} samples per prompt. One warm-up step per cell, then the median step.",
            "Not included: the per-step Ray calls of the loop (to the executor actor, the batch to the trainer); "
            "benchmarks.orchestration measures those through a real train_async.py run with one engine.",
        ],
    }


def headline(entry: dict) -> list[list[str]]:
    r = entry["results"]
    us = [g["us_per_sample"] for g in r["grid"].values()]
    return [
        [
            "orchestration cost per sample, 1-64 stand-in engines x 64-8192 requests in flight",
            f"{min(us):.0f}-{max(us):.0f} us (largest / smallest setting {r['largest_over_smallest']:.2f}x wall, "
            f"{r['cpu_largest_over_smallest']:.2f}x CPU; bare Ray round trip {r['bare_ray_round_trip_us']:.0f} us)",
        ]
    ]

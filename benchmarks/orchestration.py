"""Orchestration overhead: microseconds per sample through the whole path when generation and training cost ~0.

A real synchronous train_async.py run on a tiny model (1 generated token per sample, training replaced by
a zero-second sleep in a trainer double, ``train_doubles.FixedTrainCost``, no weight pushes after the first):
what remains of each step is the path itself (data source, engine HTTP round trips, reward, grouping, Ray
object transfer to the trainer and its hand-off).
Compared with a bare Ray actor round trip measured in the same run. The engine's own compute for the
one-token batches is reported separately (from its busy time) and subtracted.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import run_train_async, table, tiny_run_flags, tiny_setup
from benchmarks.train_doubles import fixed_train_cost_env


def bare_ray_round_trip_us(calls: int) -> float:
    import ray

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:

        @ray.remote(num_cpus=0)
        class Echo:
            def ping(self, x=None):
                return x

        echo = Echo.remote()
        ray.get(echo.ping.remote())
        t0 = time.perf_counter()
        for _ in range(calls):
            ray.get(echo.ping.remote())
        return (time.perf_counter() - t0) / calls * 1e6
    finally:
        ray.shutdown()


def _path_run(out: Path, model: Path, data: Path, prompts: int, samples: int, steps: int) -> dict:
    rows = run_train_async(
        [
            *tiny_run_flags(model, data, prompts, samples, 1, generate="fixed_length_generate"),
            "--synchronous",
            "--num-rollout",
            str(steps),
            "--update-weights-interval",
            str(steps + 1),
            "--use-tis",
        ],
        out,
        extra_env=fixed_train_cost_env(0),
    )
    steady = rows[1:]  # the first step pays for warm-up (first requests, first Ray transfer)
    n = prompts * samples
    step = statistics.median(r["time/step_seconds"] for r in steady)
    engine = statistics.median((1 - r["engine/idle_frac"]) * r["time/step_seconds"] for r in steady)
    return {
        "samples_per_step": n,
        "step_seconds_median": step,
        "engine_busy_seconds_median": engine,
        "us_per_sample": step / n * 1e6,
        "us_per_sample_without_engine": (step - engine) / n * 1e6,
    }


def run(quick: bool, out_dir: Path) -> dict:
    work = Path(tempfile.mkdtemp(prefix="miles_async_orchestration_"))
    try:
        model, train, _ = tiny_setup(work)
        ray_us = bare_ray_round_trip_us(200 if quick else 1000)
        sizes = [(8, 4)] if quick else [(8, 4), (32, 8)]
        paths = {f"{p}x{s}": _path_run(work / f"{p}x{s}", model, train, p, s, 6 if quick else 12) for p, s in sizes}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = [
        [
            name,
            r["samples_per_step"],
            f"{r['step_seconds_median'] * 1e3:.0f}",
            f"{r['us_per_sample']:.0f}",
            f"{r['us_per_sample_without_engine']:.0f}",
            f"{r['us_per_sample_without_engine'] / ray_us:.1f}x",
        ]
        for name, r in paths.items()
    ]
    return {
        "results": {"bare_ray_round_trip_us": ray_us, "paths": paths},
        "tables": [
            table(
                "Orchestration overhead per sample (1-token generation, zero-cost training, synchronous)",
                [
                    "prompts x samples",
                    "samples/step",
                    "step ms (median)",
                    "us/sample",
                    "us/sample without engine compute",
                    "vs bare Ray round trip",
                ],
                rows,
                f"bare Ray actor round trip, same run: {ray_us:.0f} us",
            )
        ],
        "notes": [
            "Every sample makes its own HTTP request to the engine (as with SGLang), so the per-sample "
            "path includes one HTTP round trip and one reward call; the Ray transfer to the trainer is "
            "per batch."
        ],
    }


def headline(entry: dict) -> list[list[str]]:
    r = entry["results"]
    ray_us = r["bare_ray_round_trip_us"]
    return [
        [
            f"orchestration overhead per sample ({name}, zero-cost generation and training)",
            f"{p['us_per_sample_without_engine']:.0f} us = {p['us_per_sample_without_engine'] / ray_us:.2f}x a bare "
            f"Ray round trip ({ray_us:.0f} us)",
        ]
        for name, p in r["paths"].items()
    ]

"""Seconds to push SmolLM2-135M's weights to a running engine, against a plain in-memory copy of the same bytes.

For each dtype (the model is held in that dtype, so every route moves the same bytes and none
pays for a cast), against an engine server running in that dtype:

- ``tensor@<size>``: the trainer's route, ``push_buckets(iter_buckets(...))`` over HTTP, at two
  bucket sizes;
- ``disk``: ``save_pretrained`` into a temporary folder, then ``update_weights_from_disk``
  (save and load are timed separately; the folder is still in the page cache when the engine
  reads it, as it would be on one machine);
- ``shm@<size>``: the same route for an engine on the trainer's node (what ``--weight-update-method tensor``
  now takes into the embedded engine there): ``shared_memory.push_staged``, each bucket written once into a
  reused /dev/shm staging file, the engine maps it and copies it into its parameters;
- ``pause:tensor``, ``pause:shm staged``: how long generation stops for one update (pause_generation to
  continue_generation returning): the http push happens while paused; with shm the trainer writes and the
  engine maps the update before the pause (``stage``, its seconds in the detail column), and the pause only
  covers the commit, the copy into the parameters;
- ``memcopy``: ``copy_`` of every parameter into preallocated tensors, the floor any route pays.

Routes are interleaved within each repetition and every push bumps the weight version, which is
checked through ``/get_model_info`` afterwards. Parameters are the deduplicated
``named_parameters()`` (tied embeddings sent once), exactly what the trainer sends.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import (
    DTYPES,
    engine_config,
    median,
    multiplication_prompts,
    running_engine,
    smollm2_path,
    table,
    torch_threads,
)

MIB = 1024**2
BUCKETS = (64 * MIB, 512 * MIB)
THREADS = 1
TIMEOUT = 600.0


def _engine_version(url: str, key) -> int:
    from miles_async.inference.client import EngineClient

    async def go() -> int:
        async with EngineClient(url, timeout=60, api_key=key) as c:
            return int((await c.model_info())["weight_version"])

    return asyncio.run(go())


def _load_from_disk(url: str, key, folder: Path, version: int) -> dict:
    from miles_async.inference.client import EngineClient

    async def go() -> dict:
        async with EngineClient(url, timeout=TIMEOUT, api_key=key) as c:
            return await c.update_weights_from_disk(str(folder), version)

    return asyncio.run(go())


def _check_version(url: str, key, expected: int, route: str) -> None:
    got = _engine_version(url, key)
    if got != expected:
        raise RuntimeError(f"after a {route} push the engine reports weight_version {got}, expected {expected}")


def run(quick: bool, out_dir: Path) -> dict:
    from transformers import AutoModelForCausalLM

    from miles_async.inference.embedded.client import EmbeddedEngineClient
    from miles_async.weights import shared_memory
    from miles_async.weights.http import push_buckets
    from miles_async.weights.source import iter_buckets
    from miles_async.weights.staged import commit
    from miles_async.weights.staging import StagingBuffer

    reps = 2 if quick else 5
    dtypes = ["bfloat16", "float32"]
    model_path = smollm2_path()
    samples: list[dict] = []
    sizes: dict[str, int] = {}

    with tempfile.TemporaryDirectory(prefix="bench_wsync_") as tmp, torch_threads(THREADS):
        tmp = Path(tmp)
        data, _ = multiplication_prompts(tmp)
        for dtype in dtypes:
            torch_dtype = DTYPES[dtype]
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype).eval()
            params = [p.detach() for _, p in model.named_parameters()]
            nbytes = sum(p.numel() * p.element_size() for p in params)
            sizes[dtype] = nbytes
            dst = [torch.empty_like(p) for p in params]

            def memcopy() -> float:
                t0 = time.perf_counter()
                for d, p in zip(dst, params):
                    d.copy_(p)
                return time.perf_counter() - t0

            def serialize_only(bucket_bytes: int) -> float:
                # The client-side encoding step of the tensor route on its own (the same
                # safetensors.save the client runs per bucket), so its share of a push is visible.
                from safetensors.torch import save

                t0 = time.perf_counter()
                for bucket in iter_buckets(model.named_parameters(), torch_dtype, bucket_bytes):
                    save(dict(bucket))
                return time.perf_counter() - t0

            def push(bucket_bytes: int, version: int) -> float:
                t0 = time.perf_counter()
                sent = asyncio.run(
                    push_buckets(
                        iter_buckets(model.named_parameters(), torch_dtype, bucket_bytes),
                        [eng.url],
                        version,
                        TIMEOUT,
                        api_key=eng.cfg.api_key,
                    )
                )
                secs = time.perf_counter() - t0
                if sent != nbytes:
                    raise RuntimeError(f"push_buckets sent {sent} bytes, expected {nbytes}")
                return secs

            # One staging buffer per bucket size, kept across updates as the trainer's sender keeps its own.
            staging = {bb: StagingBuffer() for bb in BUCKETS}

            def shm_push(bucket_bytes: int, version: int) -> float:
                t0 = time.perf_counter()
                sent = asyncio.run(
                    shared_memory.push_staged(
                        iter_buckets(model.named_parameters(), torch_dtype, bucket_bytes),
                        [eng.url],
                        version,
                        TIMEOUT,
                        "embedded",
                        staging[bucket_bytes],
                        api_key=eng.cfg.api_key,
                    )
                )
                secs = time.perf_counter() - t0
                if sent != nbytes:
                    raise RuntimeError(f"push_staged wrote {sent} bytes, expected {nbytes}")
                return secs

            def paused(during) -> float:
                """Seconds from pause_generation to continue_generation returning, ``during`` run in between."""

                async def go() -> float:
                    async with EmbeddedEngineClient(eng.url, timeout=TIMEOUT, api_key=eng.cfg.api_key) as c:
                        t0 = time.perf_counter()
                        await c.pause("in_place")
                        try:
                            await during()
                        finally:
                            await c.resume()
                        return time.perf_counter() - t0

                return asyncio.run(go())

            def pause_http(version: int) -> float:
                return paused(
                    lambda: push_buckets(
                        iter_buckets(model.named_parameters(), torch_dtype, BUCKETS[-1]),
                        [eng.url],
                        version,
                        TIMEOUT,
                        api_key=eng.cfg.api_key,
                    )
                )

            def pause_shm_staged(version: int) -> tuple[float, float]:
                t0 = time.perf_counter()
                asyncio.run(
                    shared_memory.stage(
                        iter_buckets(model.named_parameters(), torch_dtype, BUCKETS[-1]),
                        [eng.url],
                        version,
                        TIMEOUT,
                        "embedded",
                        staging[BUCKETS[-1]],
                        eng.cfg.api_key,
                    )
                )
                staged = time.perf_counter() - t0
                return staged, paused(lambda: commit([eng.url], version, TIMEOUT, "embedded", True, eng.cfg.api_key))

            # The engine holds the sent dtype even where bf16 decoding would be emulated (a CPU without bf16
            # arithmetic makes the embedded engine serve float32): only weight transfer is timed here.
            cfg = dataclasses.replace(engine_config(model_path, data, dtype, THREADS, out_dir=tmp), dtype=dtype)
            with running_engine(cfg, tmp / f"logs_{dtype}") as eng:
                version = 0
                # First touches fault in fresh pages on both ends; keep them out of the timings.
                memcopy()
                version += 1
                push(BUCKETS[-1], version)
                _check_version(eng.url, eng.cfg.api_key, version, "warm-up")
                for bb in BUCKETS:
                    version += 1
                    shm_push(bb, version)
                    _check_version(eng.url, eng.cfg.api_key, version, "warm-up shm")
                for rep in range(reps):

                    def record(route: str, secs: float, **extra) -> None:
                        samples.append({"dtype": dtype, "route": route, "rep": rep, "seconds": round(secs, 4), **extra})
                        print(f"  {dtype} {route:14s} {secs:7.3f} s", flush=True)

                    record("memcopy", memcopy())
                    for bb in BUCKETS:
                        version += 1
                        route = f"tensor@{bb // MIB}MiB"
                        record(route, push(bb, version), serialize_s=round(serialize_only(bb), 4))
                        _check_version(eng.url, eng.cfg.api_key, version, route)
                    for bb in BUCKETS:
                        version += 1
                        route = f"shm@{bb // MIB}MiB"
                        record(route, shm_push(bb, version))
                        _check_version(eng.url, eng.cfg.api_key, version, route)
                    version += 1
                    record("pause:tensor", pause_http(version))
                    _check_version(eng.url, eng.cfg.api_key, version, "pause:tensor")
                    version += 1
                    staged, pause_s = pause_shm_staged(version)
                    record("pause:shm staged", pause_s, stage_s=round(staged, 4))
                    _check_version(eng.url, eng.cfg.api_key, version, "pause:shm staged")
                    version += 1
                    folder = tmp / f"ckpt_{dtype}_{rep}"
                    t0 = time.perf_counter()
                    model.save_pretrained(folder)
                    saved = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    resp = _load_from_disk(eng.url, eng.cfg.api_key, folder, version)
                    loaded = time.perf_counter() - t0
                    if not resp.get("success"):
                        raise RuntimeError(f"update_weights_from_disk failed: {resp}")
                    _check_version(eng.url, eng.cfg.api_key, version, "disk")
                    record("disk", saved + loaded, save_s=round(saved, 4), load_s=round(loaded, 4))
                    shutil.rmtree(folder)
            for buf in staging.values():
                buf.close()

    routes = (
        ["memcopy"]
        + [f"tensor@{bb // MIB}MiB" for bb in BUCKETS]
        + [f"shm@{bb // MIB}MiB" for bb in BUCKETS]
        + ["disk", "pause:tensor", "pause:shm staged"]
    )
    summary = []
    for dtype in dtypes:
        base = median([s["seconds"] for s in samples if s["dtype"] == dtype and s["route"] == "memcopy"])
        for route in routes:
            pick = [s for s in samples if s["dtype"] == dtype and s["route"] == route]
            secs = median([s["seconds"] for s in pick])
            row = {
                "dtype": dtype,
                "route": route,
                "bytes": sizes[dtype],
                "seconds": round(secs, 4),
                "x_memcopy": round(secs / base, 1),
                "gb_per_s": round(sizes[dtype] / secs / 1e9, 3),
            }
            if route.startswith("tensor@"):
                row["serialize_s"] = round(median([s["serialize_s"] for s in pick]), 4)
            if route == "pause:shm staged":
                row["stage_s"] = round(median([s["stage_s"] for s in pick]), 4)
            if route == "disk":
                row["save_s"] = round(median([s["save_s"] for s in pick]), 4)
                row["load_s"] = round(median([s["load_s"] for s in pick]), 4)
            summary.append(row)

    plot = _plot(summary, dtypes, routes, out_dir)
    rows = []
    for s in summary:
        detail = ""
        if s["route"] == "disk":
            detail = f"save {s['save_s']:.2f} s + load {s['load_s']:.2f} s"
        elif s["route"].startswith("tensor@"):
            detail = f"of which safetensors encoding alone ~{s['serialize_s']:.2f} s"
        elif s["route"].startswith("shm@"):
            detail = "same node: one write into /dev/shm, the engine copies from its mapping"
        elif s["route"] == "pause:tensor":
            detail = "generation stopped for the whole http push (tensor@512MiB)"
        elif s["route"] == "pause:shm staged":
            detail = f"stopped for the commit only; staged before the pause in {s['stage_s']:.2f} s"
        rows.append(
            [s["dtype"], f"{s['bytes'] / MIB:.0f} MiB", s["route"], s["seconds"], s["x_memcopy"], s["gb_per_s"], detail]
        )
    return {
        "settings": {
            "reps": reps,
            "dtypes": dtypes,
            "bucket_bytes": list(BUCKETS),
            "threads": THREADS,
            "model": str(model_path),
        },
        "summary": summary,
        "samples": samples,
        "tables": [
            table(
                "Weight sync, SmolLM2-135M to one engine (seconds, median)",
                ["dtype", "size", "route", "seconds", "x memcopy", "GB/s", "detail"],
                rows,
                note=f"Median of {reps} repetitions; routes interleaved within each. 'x memcopy' = "
                "seconds / seconds of a plain copy_ of the same bytes measured in the same run. "
                "Engine and copy use 1 torch thread. The encoding time is measured separately, right "
                "after each push.",
            )
        ],
        "plots": [plot],
        "notes": [
            "The model is held in the sent dtype, so no route pays a cast; a trainer holding fp32 "
            "master weights adds one cast per parameter to the tensor route when sending bf16.",
            "The disk route's checkpoint is read back from the page cache (same machine, just "
            "written); a cold read from a network file system would be slower.",
            "shm needs the engine on the trainer's node; an embedded engine on another node gets the tensor "
            "route over HTTP. The pause rows time pause_generation to continue_generation, the time "
            "generation is stopped for one update.",
        ],
    }


def _plot(summary: list[dict], dtypes: list[str], routes: list[str], out_dir: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.8 / len(dtypes)
    for k, dtype in enumerate(dtypes):
        rows = {s["route"]: s for s in summary if s["dtype"] == dtype}
        xs = [i + (k - (len(dtypes) - 1) / 2) * width for i in range(len(routes))]
        bars = ax.bar(xs, [rows[r]["seconds"] for r in routes], width, label=dtype)
        for bar, r in zip(bars, routes):
            ax.annotate(
                f"{rows[r]['x_memcopy']:.1f}x" if r != "memcopy" else "1x",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                textcoords="offset points",
                xytext=(0, 3),
                ha="center",
                fontsize=8,
            )
    ax.set_yscale("log")
    ax.set_xticks(range(len(routes)))
    ax.set_xticklabels(routes)
    ax.set_ylabel("seconds (log scale)")
    ax.set_title("Pushing SmolLM2-135M to a running engine (labels: x in-memory copy)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    name = "weight_sync.png"
    fig.savefig(out_dir / name, dpi=110)
    plt.close(fig)
    return name


def headline(entry: dict) -> list[list[str]]:
    rows = []
    for s in entry["summary"]:
        if s["dtype"] == "bfloat16" and s["route"] != "memcopy":
            what = (
                f"generation paused for one SmolLM2 bf16 update, {s['route'].removeprefix('pause:')}"
                if s["route"].startswith("pause:")
                else f"push SmolLM2 bf16 weights to an engine, {s['route']}"
            )
            x = f"{s['x_memcopy']:.1f}" if s["x_memcopy"] < 10 else f"{s['x_memcopy']:.0f}"
            rows.append([what, f"{s['seconds']:.2f} s = {x}x an in-memory copy of the same bytes"])
    return rows

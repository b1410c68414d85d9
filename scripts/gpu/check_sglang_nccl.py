"""SGLang's NCCL weight route on one GPU; see check_sglang_nccl.sh for how to run it and what it checks."""

from __future__ import annotations

import sys
import time

import requests
import torch
from sglang_gpu import PROMPT, NoCopyToCPU, assert_engine_holds, check_args, generate, setup


def main() -> int:
    args = check_args("check_sglang_nccl", bucket_bytes=64 * 1024**2)

    from miles_async.inference.auth import auth_headers
    from miles_async.inference.sglang.launcher import SGLangEngineProcess
    from miles_async.weights.process_group import EngineWeightGroup
    from miles_async.weights.source import iter_buckets

    cfg, model = setup(args, "check_sglang_nccl", torch.bfloat16)
    key = cfg.engine.api_key
    with SGLangEngineProcess(cfg.engine, 0, cfg.tracking.output_dir) as engine:
        url = engine.url
        before = generate(url, key)
        with torch.no_grad():  # the "trained" weights: a visible perturbation
            for _, prm in model.named_parameters():
                prm.add_(torch.randn_like(prm) * 0.05)

        # The trainer's own code path (what train_async runs with --weight-update-method distributed): one NCCL
        # group of this process (rank 0) and the engine's TP ranks, buckets broadcast under their HF names.
        group = EngineWeightGroup([url], cfg.engine.num_gpus_per_engine, "nccl", "127.0.0.1", timeout=300, api_key=key)
        group.connect()
        broadcast_devices: list[str] = []
        real_broadcast = group._broadcast

        def broadcast(tensors):  # what NCCL sends: straight from the GPU
            broadcast_devices.extend(t.device.type for t in tensors)
            return real_broadcast(tensors)

        group._broadcast = broadcast
        t0 = time.perf_counter()
        with NoCopyToCPU() as guard:  # bucketing and the push: no weight copied to the CPU on the way
            sent = group.push(iter_buckets(model.named_parameters(), torch.bfloat16, args.bucket_bytes), 1)
        seconds = time.perf_counter() - t0
        assert not guard.moves, f"weights copied to the CPU on the sending path: {guard.moves}"
        assert broadcast_devices and set(broadcast_devices) == {"cuda"}, broadcast_devices
        print(
            f"update_weights_from_distributed: {sent / 1e6:.1f} MB in buckets of {args.bucket_bytes} bytes, "
            f"{seconds:.3f}s, all {len(broadcast_devices)} tensors broadcast from the GPU"
        )

        info = requests.get(f"{url}/get_model_info", headers=auth_headers(key), timeout=30).json()
        assert str(info["weight_version"]) == "1", info
        assert_engine_holds(url, key, list(model.named_parameters()), torch.bfloat16)
        after = generate(url, key)
        assert after["output_ids"] != before["output_ids"], "outputs did not change"
        with torch.no_grad():
            ids = torch.tensor([PROMPT + after["output_ids"]], device="cuda")
            logits = model(ids).logits[0, len(PROMPT) - 1 : -1].float()
            ref = torch.log_softmax(logits, -1).gather(-1, ids[0, len(PROMPT) :, None])[:, 0].tolist()
        got = [x[0] for x in after["meta_info"]["output_token_logprobs"]]
        worst = max(abs(a - b) for a, b in zip(ref, got))
        assert worst < 0.1, (ref, got)  # bf16 on both sides
        print(f"log-probs vs transformers: max |diff| {worst:.4f}")
        group.close()
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())

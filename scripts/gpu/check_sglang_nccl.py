"""SGLang's NCCL weight route on one GPU; see check_sglang_nccl.sh for how to run it and what it checks."""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time

import requests
import torch


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--sglang-python", required=True)
    p.add_argument("--bucket-bytes", type=int, default=64 * 1024**2)
    args = p.parse_args()
    assert torch.cuda.is_available(), "needs a GPU"

    from transformers import AutoModelForCausalLM

    from miles_async.arguments import parse_args
    from miles_async.assets.tiny_model import make_tiny_model, make_tiny_task_dataset
    from miles_async.inference.sglang.client import SGLangEngineClient
    from miles_async.inference.sglang.launcher import SGLangEngineProcess
    from miles_async.weights.process_group import EngineWeightGroup
    from miles_async.weights.source import iter_buckets

    work = tempfile.mkdtemp(prefix="sglang_nccl_")
    model_dir = args.model or str(make_tiny_model(f"{work}/model", seed=0))
    train, _ = make_tiny_task_dataset(f"{work}/task", n_train=8, n_eval=2, seed=0)
    cfg = parse_args(
        [
            "--hf-checkpoint",
            model_dir,
            "--prompt-data",
            str(train),
            "--rollout-batch-size",
            "1",
            "--rm-type",
            "first_integer",
            "--rollout-backend",
            "sglang",
            "--sglang-python",
            args.sglang_python,
            "--rollout-dtype",
            "bfloat16",
            "--sglang-mem-fraction-static",
            "0.4",
            "--output-dir",
            work,
            "--update-weight-buffer-size",
            str(args.bucket_bytes),
        ]
    )
    assert cfg.engine.use_gpu

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    prompt = [4, 10, 11, 12, 13]
    greedy = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}

    with SGLangEngineProcess(cfg.engine, 0, work) as engine:
        url = engine.url

        def gen() -> dict:
            async def go():
                async with SGLangEngineClient(url, timeout=120) as c:
                    return await c.generate(prompt, greedy)

            return asyncio.run(go())

        before = gen()
        with torch.no_grad():  # the "trained" weights: a visible perturbation
            for _, prm in model.named_parameters():
                prm.add_(torch.randn_like(prm) * 0.05)

        # The trainer's own code path (what train_async runs with --weight-update-method distributed): one NCCL
        # group of this process (rank 0) and the engine's TP ranks, buckets broadcast under their HF names.
        group = EngineWeightGroup([url], cfg.engine.num_gpus_per_engine, "nccl", "127.0.0.1", timeout=300)
        t0 = time.perf_counter()
        sent = group.push(
            iter_buckets(((n, t) for n, t in model.named_parameters()), torch.bfloat16, args.bucket_bytes), 1
        )
        seconds = time.perf_counter() - t0
        print(
            f"update_weights_from_distributed: {sent / 1e6:.1f} MB in buckets of {args.bucket_bytes} bytes, "
            f"{seconds:.3f}s (first push, group set-up included)"
        )

        info = requests.get(f"{url}/get_model_info", timeout=30).json()
        assert str(info["weight_version"]) == "1", info
        after = gen()
        assert after["output_ids"] != before["output_ids"], "outputs did not change"
        with torch.no_grad():
            ids = torch.tensor([prompt + after["output_ids"]], device="cuda")
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
            ref = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0].tolist()
        got = [x[0] for x in after["meta_info"]["output_token_logprobs"]]
        worst = max(abs(a - b) for a, b in zip(ref, got))
        assert worst < 0.1, (ref, got)  # bf16 on both sides
        print(f"log-probs vs transformers: max |diff| {worst:.4f}")
        group.close()
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())

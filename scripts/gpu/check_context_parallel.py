"""Two-GPU check of context parallelism in the Megatron backend: CP 2 gives the log-probs, loss and gradient norm
of CP 1 on the same batch, with Transformer Engine's context-parallel attention.

The data path (each sequence cut into 2 x CP chunks, rank r holding chunks r and 2 x CP - 1 - r, log-probs and
entropies gathered back, the gradients' factor CP taken out by Megatron's DDP) is tested on the CPU in
tests/integration/test_context_parallel.py with a position-wise stand-in model; the attention between the ranks'
chunks is Transformer Engine's, which needs GPUs. This runs the actor itself:

1. reference: one rank, CP 1, ``MegatronTrainActor`` in bf16 on a tiny Llama: the batch's log-probs, then one
   rollout's training step (loss, gradient norm);
2. CP 2: two ranks, one GPU each, the same;
3. the two agree within bf16's rounding (stated below), on both CP ranks.

Needs: 2 CUDA GPUs, a CUDA torch, transformers, megatron-core and Transformer Engine (its flash or fused attention:
CP does not run in fp32). Run: ``python scripts/gpu/check_context_parallel.py``; one JSON line, then OK (exit 0)
or FAILED (exit 1); exit 2 when the machine lacks GPUs or Transformer Engine.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts" / "gpu")]  # the spawned ranks import this file again

# bf16 keeps 8 bits of mantissa: a log-prob of about -3 rounds by ~1e-2, and CP sums attention in another order.
LOGPROB_ATOL = 5e-2
RELATIVE = 2e-2  # loss and gradient norm


def _rank(rank: int, world: int, port: int, model: str, data: str, out: str) -> None:
    from check_megatron_gpu import _batch

    from miles_async.arguments import parse_args
    from miles_async.backends.megatron.actor import MegatronTrainActor

    torch.cuda.set_device(rank)
    flags = ["--use-tis", "--hf-checkpoint", model, "--prompt-data", data, "--rollout-batch-size", "4",
             "--n-samples-per-prompt", "4", "--num-rollout", "1", "--rm-type", "integer", "--lr", "1e-3",
             "--global-batch-size", "16", "--output-dir", out, "--train-backend", "megatron", "--bf16",
             "--actor-num-gpus-per-node", str(world), "--context-parallel-size", str(world)]  # fmt: skip
    actor = MegatronTrainActor(parse_args(flags).train, rank, world, total_optimizer_steps=1)
    actor.init_process_group("127.0.0.1", port)
    batch = _batch()
    rows = list(range(len(batch.tokens)))
    logprobs = actor._logprobs_of(actor.model, batch, rows, 1.0)
    metrics = actor.train(0, batch)
    record = {"logprobs": logprobs, "loss": metrics["train/loss"], "grad_norm": metrics["train/grad_norm"]}
    Path(f"{out}.{rank}").write_text(json.dumps(record))


def _run(world: int, model: str, data: str, out: str) -> list[dict]:
    from tests.ports import spawn_ranks

    codes = spawn_ranks(_rank, world, model, data, out, timeout=280)
    if codes != [0] * world:
        raise RuntimeError(f"CP {world}: ranks exited {codes}")
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]


def main() -> int:
    import importlib.util

    if torch.cuda.device_count() < 2 or importlib.util.find_spec("transformer_engine") is None:
        print(
            "check_context_parallel: needs 2 CUDA GPUs and Transformer Engine (found "
            f"{torch.cuda.device_count()} GPU(s), transformer_engine "
            f"{'installed' if importlib.util.find_spec('transformer_engine') else 'missing'})",
            file=sys.stderr,
        )
        return 2
    from miles_async.assets.tiny_model import make_tiny_model, make_tiny_task_dataset

    tmp = Path(tempfile.mkdtemp(prefix="check_context_parallel_"))
    model = str(make_tiny_model(tmp / "llama", arch="llama"))
    data, _ = make_tiny_task_dataset(tmp / "task", n_train=16, n_eval=4)
    one = _run(1, model, str(data), str(tmp / "cp1"))[0]
    two = _run(2, model, str(data), str(tmp / "cp2"))
    worst = max(abs(a - b) for r in two for i, lp in one["logprobs"].items() for a, b in zip(lp, r["logprobs"][str(i)]))
    close = [math.isclose(one[k], r[k], rel_tol=RELATIVE) for r in two for k in ("loss", "grad_norm")]
    record = {
        "check": "context_parallel",
        "logprob_max_abs_diff": worst,
        "logprob_tolerance": LOGPROB_ATOL,
        "loss": [one["loss"], *(r["loss"] for r in two)],
        "grad_norm": [one["grad_norm"], *(r["grad_norm"] for r in two)],
        "ok": worst <= LOGPROB_ATOL and all(close),
    }
    print(json.dumps(record), flush=True)
    print("OK" if record["ok"] else "FAILED", flush=True)
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

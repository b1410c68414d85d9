"""What the SGLang GPU checks (check_sglang_nccl.py, check_sglang_cuda_ipc.py) share: the engine's config, a
guard that no weight leaves the GPU on the sending path, and the engine's weights read back."""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile

import requests
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

NO_GPU = 2  # exit status without a GPU, as check_megatron_gpu.py


def require_gpu(script: str) -> None:
    if not torch.cuda.is_available():
        print(f"{script}: needs a CUDA GPU (torch {torch.__version__} sees none); nothing checked", file=sys.stderr)
        sys.exit(NO_GPU)


def check_args(script: str, bucket_bytes: int) -> argparse.Namespace:
    """The checks' command line (``[MODEL_DIR] --sglang-python PY [--bucket-bytes N]``); stops without a GPU."""
    p = argparse.ArgumentParser(prog=script)
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--sglang-python", required=True)
    p.add_argument("--bucket-bytes", type=int, default=bucket_bytes)
    args = p.parse_args()
    require_gpu(script)
    return args


def setup(args: argparse.Namespace, script: str, dtype: torch.dtype):
    """(the run's config for one SGLang engine on this GPU, the "trainer" model on this GPU in ``dtype``)."""
    from transformers import AutoModelForCausalLM

    from miles_async.arguments import parse_args
    from miles_async.assets.tiny_model import make_tiny_model, make_tiny_task_dataset

    work = tempfile.mkdtemp(prefix=f"{script}_")
    model_dir = args.model or str(make_tiny_model(f"{work}/model", seed=0))
    train, _ = make_tiny_task_dataset(f"{work}/task", n_train=8, n_eval=2, seed=0)
    cfg = parse_args(
        [
            *("--hf-checkpoint", model_dir, "--prompt-data", str(train), "--rollout-batch-size", "1"),
            *("--rm-type", "first_integer", "--rollout-backend", "sglang", "--sglang-python", args.sglang_python),
            *("--rollout-dtype", "bfloat16", "--sglang-mem-fraction-static", "0.4", "--output-dir", work),
            *("--update-weight-buffer-size", str(args.bucket_bytes), "--use-rollout-logprobs", "--num-rollout", "1"),
        ]
    )
    assert cfg.engine.use_gpu
    return cfg, AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()


PROMPT = [4, 10, 11, 12, 13]


def generate(url: str, key) -> dict:
    """The engine's greedy continuation of ``PROMPT``, with its log-probs."""
    from miles_async.inference.sglang.client import SGLangEngineClient

    async def go():
        async with SGLangEngineClient(url, timeout=120, api_key=key) as c:
            return await c.generate(PROMPT, {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True})

    return asyncio.run(go())


class NoCopyToCPU(TorchDispatchMode):
    """Records every op run in this thread while active that turns a CUDA tensor into a CPU one (a ``.cpu()``,
    ``.to("cpu")`` or ``copy_`` into host memory, however reached)."""

    def __init__(self):
        super().__init__()
        self.moves: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if any(t.is_cuda for t in ins) and any(t.device.type == "cpu" for t in outs):
            self.moves.append(str(func))
        return out


def assert_engine_holds(url: str, key, named: list[tuple[str, torch.Tensor]], dtype: torch.dtype) -> None:
    """The engine's weights (``/get_weights_by_name``, float32 values of its parameters, a Llama-family model)
    equal, bit for bit, the trainer's cast to the engine's dtype."""
    from miles_async.inference.auth import auth_headers

    for name, t in named:
        body = {"name": name, "truncate_size": t.shape[0]}
        r = requests.post(f"{url}/get_weights_by_name", json=body, headers=auth_headers(key), timeout=60)
        assert r.status_code == 200, f"{name}: /get_weights_by_name answered {r.status_code}: {r.text[:300]}"
        got = torch.tensor(r.json(), dtype=torch.float32)
        want = t.detach().to(dtype).float().cpu()
        assert got.shape == want.shape, f"{name}: engine {tuple(got.shape)}, trainer {tuple(want.shape)}"
        assert torch.equal(got, want), f"{name}: engine differs from trainer (max |diff| {(got - want).abs().max()})"
    print(f"engine weights == trainer weights ({dtype}) for all {len(named)} tensors")

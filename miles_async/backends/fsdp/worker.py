"""What the policy and the value model of the torch backend share.

One Ray actor per training worker: device and seeding, the optimizer (AdamW or SGD) with the LR schedule,
data parallelism over torch.distributed (DDP: gloo on the CPU, NCCL on GPUs), the
split of a rollout into optimizer steps and token-budgeted micro-batches, the
optimizer step itself, and checkpoints (weights, optimizer, RNG) in a sub-folder
named after the worker's role.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from miles_async.backends.packing import MicroBatch, collate, pack_micro_batches
from miles_async.backends.policy import reduce_metrics  # noqa: F401 - re-exported for the critic
from miles_async.config import OptimizerConfig, TrainConfig
from miles_async.utils.checkpoint import iteration_dir

# loss_fn(micro_batch, sample_indices) -> (loss of those samples under the step's aggregation, metrics)
LossFn = Callable[[MicroBatch, list[int]], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def lr_lambda(cfg: OptimizerConfig, total_steps: int) -> Callable[[int], float]:
    def f(step: int) -> float:
        if cfg.lr_warmup_iters and step < cfg.lr_warmup_iters:
            return (step + 1) / cfg.lr_warmup_iters
        if cfg.lr_decay_style == "constant" or total_steps <= cfg.lr_warmup_iters:
            return 1.0
        frac = min(1.0, (step - cfg.lr_warmup_iters) / max(1, total_steps - cfg.lr_warmup_iters))
        floor = cfg.min_lr / cfg.lr
        if cfg.lr_decay_style == "linear":
            return floor + (1 - floor) * (1 - frac)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac))

    return f


def make_optimizer(params, opt: OptimizerConfig) -> torch.optim.Optimizer:
    """--optimizer adam: AdamW (decoupled weight decay, as Megatron's adam); sgd: SGD with --sgd-momentum and
    weight decay added to the gradient (as Megatron's sgd)."""
    if opt.optimizer == "sgd":
        return torch.optim.SGD(params, lr=opt.lr, momentum=opt.sgd_momentum, weight_decay=opt.weight_decay)
    return torch.optim.AdamW(
        params, lr=opt.lr, betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps, weight_decay=opt.weight_decay
    )


def save_rng_state(folder: Path, rank: int) -> None:
    """Python, numpy and torch RNG states of one worker, so a resumed run samples as the original."""
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    torch.save(rng, folder / f"rng_rank{rank}.pt")


def load_rng_state(folder: Path, rank: int) -> None:
    path = folder / f"rng_rank{rank}.pt"
    if path.exists():
        rng = torch.load(path, weights_only=False)
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])


class TrainWorker:
    """Base of the policy and critic workers; subclasses build the module and the loss."""

    def __init__(self, cfg: TrainConfig, rank: int, world_size: int, total_optimizer_steps: int):
        torch.set_num_threads(cfg.num_threads)
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        )
        self._seed_everything(cfg.seed + rank)
        # Parameters and optimizer state stay fp32; --bf16 runs the matmuls under autocast.
        self.module = self._build_module().to(self.device)
        if cfg.gradient_checkpointing:
            self.module.gradient_checkpointing_enable()
        self.module.config.use_cache = False
        opt = cfg.optimizer
        self.optimizer = make_optimizer(self.module.parameters(), opt)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(opt, total_optimizer_steps))
        self.pad_id = self.module.config.pad_token_id or 0
        self.model = self.module
        self.optimizer_steps = 0

    def _build_module(self) -> torch.nn.Module:
        raise NotImplementedError

    # -- distributed set-up -------------------------------------------------------------
    def address(self) -> tuple[str, int]:
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def init_process_group(self, master_addr: str, master_port: int) -> None:
        if self.world_size == 1:
            return
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend, init_method=f"tcp://{master_addr}:{master_port}", rank=self.rank, world_size=self.world_size
        )
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.model = DDP(self.module, device_ids=[self.device.index] if self.device.type == "cuda" else None)

    def pid(self) -> int:
        return os.getpid()

    def _all_reduce_sum(self, value: float) -> float:
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return float(t.item())

    def _all_gather_dict(self, part: dict) -> dict:
        """Merge every worker's ``{sample index: value}`` so each holds the whole batch's."""
        if self.world_size == 1:
            return part
        parts: list[dict] = [{} for _ in range(self.world_size)]
        dist.all_gather_object(parts, part)
        return {k: v for p in parts for k, v in p.items()}

    # -- one rollout's optimisation --------------------------------------------------------
    def _shard(self, n: int) -> tuple[list[list[int]], list[int]]:
        """This worker's samples of each optimizer step: every world_size-th of the step's slice."""
        gbs = self.cfg.global_batch_size
        steps = [list(range(s, min(s + gbs, n)))[self.rank :: self.world_size] for s in range(0, n, gbs)]
        return steps, [i for step in steps for i in step]

    def _collate(self, batch: dict, idx: list[int]) -> MicroBatch:
        prompts = [batch["tokens"][i][: batch["prompt_lengths"][i]] for i in idx]
        responses = [batch["tokens"][i][batch["prompt_lengths"][i] :] for i in idx]
        return collate(prompts, responses, [batch["loss_masks"][i] for i in idx], self.pad_id)

    def _micro_batches(self, batch: dict, idx: list[int]) -> list[list[int]]:
        lengths = [len(batch["tokens"][i]) for i in idx]
        return [[idx[j] for j in mb] for mb in pack_micro_batches(lengths, self.cfg.max_tokens_per_gpu)]

    @torch.no_grad()
    def _per_sample(
        self, fn: Callable[[MicroBatch], torch.Tensor], batch: dict, idx: list[int]
    ) -> dict[int, list[float]]:
        """``fn``'s ``[B, R]`` output for each sample, cut to its response length."""
        out: dict[int, list[float]] = {}
        for rows in self._micro_batches(batch, idx):
            values = fn(self._collate(batch, rows))
            for r, i in enumerate(rows):
                out[i] = values[r, : batch["response_lengths"][i]].float().cpu().tolist()
        return out

    def _optimizer_step(self, batch: dict, idx: list[int], loss_fn: LossFn, metrics_acc: dict) -> None:
        """One optimizer step over this worker's samples ``idx`` of the step."""
        agg = self.cfg.algorithm.loss_agg_mode
        self.optimizer.zero_grad(set_to_none=True)
        micro = self._micro_batches(batch, idx)
        # Each micro-batch's loss is scaled by its share of the step's tokens (or sequences),
        # so the sum over micro-batches and workers is the loss over the whole step.
        total_tokens = sum(sum(batch["loss_masks"][i]) for i in idx)
        total = self._all_reduce_sum(float(total_tokens if agg == "token_mean" else len(idx)))
        is_ddp = isinstance(self.model, torch.nn.parallel.DistributedDataParallel)
        for k, rows in enumerate(micro):
            mb = self._collate(batch, rows)
            sync = k == len(micro) - 1 or not is_ddp
            with torch.enable_grad() if sync else self.model.no_sync():
                loss, m = loss_fn(mb, rows)
                share = (mb.response_mask.sum().item() if agg == "token_mean" else len(rows)) / max(total, 1.0)
                # DDP averages gradients over workers; multiply back so the step's loss is a global sum.
                (loss * share * self.world_size).backward()
            m["loss"] = loss.detach()
            for key, value in m.items():
                metrics_acc.setdefault(key, []).append(float(value))
        if self.cfg.optimizer.clip_grad > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.cfg.optimizer.clip_grad)
        else:
            grad_norm = torch.sqrt(
                sum((p.grad.float() ** 2).sum() for p in self.module.parameters() if p.grad is not None)
            )
        metrics_acc.setdefault("grad_norm", []).append(float(grad_norm))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer_steps += 1

    # -- checkpoints -------------------------------------------------------------------
    def _seed_everything(self, seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)

    def save(self, save_dir: str, rollout_id: int, save_optimizer: bool = True) -> None:
        from safetensors.torch import save_file

        out = iteration_dir(save_dir, rollout_id) / self.cfg.role
        out.mkdir(parents=True, exist_ok=True)
        save_rng_state(out, self.rank)
        if self.rank != 0:
            return
        state = {k: v.detach().contiguous() for k, v in self.module.state_dict().items()}
        # Tied weights share storage; safetensors refuses aliases, so keep one name.
        if getattr(self.module.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file(state, str(out / "model.safetensors"))
        if save_optimizer:
            torch.save(
                {
                    "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(),
                    "optimizer_steps": self.optimizer_steps,
                },
                out / "optimizer.pt",
            )

    def _load(self, load_dir: str, rollout_id: int) -> None:
        from safetensors.torch import load_file

        src = iteration_dir(load_dir, rollout_id) / self.cfg.role
        if not (src / "model.safetensors").exists():
            hint = (
                " (written by a run without a critic, i.e. not --advantage-estimator ppo)"
                if self.cfg.role == "critic"
                else ""
            )
            raise RuntimeError(f"--load: {src} holds no {self.cfg.role} weights{hint}")
        missing, unexpected = self.module.load_state_dict(load_file(str(src / "model.safetensors")), strict=False)
        missing = [k for k in missing if k != "lm_head.weight"]
        if missing or unexpected:
            raise RuntimeError(
                f"--load: {src} does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        if getattr(self.module.config, "tie_word_embeddings", False):
            self.module.tie_weights()
        if (src / "optimizer.pt").exists():
            opt = torch.load(src / "optimizer.pt", weights_only=False)
            self.optimizer.load_state_dict(opt["optimizer"])
            self.scheduler.load_state_dict(opt["scheduler"])
            self.optimizer_steps = opt["optimizer_steps"]
        load_rng_state(src, self.rank)

    def state_checksum(self) -> float:
        return float(sum(p.detach().double().sum() for p in self.module.parameters()))

"""The torch backend on HF models: one Ray actor per training worker.

One worker trains the plain module; several workers synchronise gradients over
torch.distributed (gloo on the CPU, DDP; on GPUs the same wrapper over NCCL).
Loss math comes from ``miles_async.algorithms``; nothing here re-derives it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from miles_async.algorithms.advantages import grpo_advantages
from miles_async.algorithms.losses import (
    aggregate_loss,
    compute_approx_kl,
    entropy_from_logits,
    logprobs_from_logits,
    policy_loss,
)
from miles_async.backends.packing import MicroBatch, collate, pack_micro_batches, pad_rows
from miles_async.backends.weight_export import iter_buckets, push_buckets
from miles_async.config import TrainConfig
from miles_async.utils.checkpoint import iteration_dir

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _lr_lambda(cfg, total_steps: int):
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


class FSDPTrainActor:
    def __init__(self, cfg: TrainConfig, rank: int, world_size: int, total_optimizer_steps: int,
                 load_dir: str | None = None, load_rollout_id: int | None = None):
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(cfg.num_threads)
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
            torch.device("cpu")
        self._seed_everything(cfg.seed + rank)
        # Parameters and optimizer state stay fp32; --bf16 runs the matmuls under autocast.
        dtype = torch.float32
        self.module = AutoModelForCausalLM.from_pretrained(cfg.model_path, dtype=dtype).to(self.device)
        if cfg.gradient_checkpointing:
            self.module.gradient_checkpointing_enable()
        self.module.config.use_cache = False
        self.ref_model = None
        if cfg.algorithm.use_kl_loss and cfg.ref_model_path is not None:
            self.ref_model = AutoModelForCausalLM.from_pretrained(cfg.ref_model_path, dtype=dtype).to(self.device)
            self.ref_model.eval().requires_grad_(False)
        opt = cfg.optimizer
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=opt.lr, betas=(opt.adam_beta1, opt.adam_beta2),
                                           eps=opt.adam_eps, weight_decay=opt.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lr_lambda(opt, total_optimizer_steps))
        self.pad_id = self.module.config.pad_token_id or 0
        self.model = self.module
        self.optimizer_steps = 0
        if load_dir is not None and load_rollout_id is not None:
            self._load(load_dir, load_rollout_id)

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
        dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=self.rank,
                                world_size=self.world_size)
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.model = DDP(self.module, device_ids=[self.device.index] if self.device.type == "cuda" else None)

    def pid(self) -> int:
        return os.getpid()

    # -- training ----------------------------------------------------------------------
    def _forward(self, model, mb: MicroBatch, temperature: float = 1.0, with_entropy: bool = False):
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.dtype == "bfloat16"):
            out = model(input_ids=mb.input_ids.to(self.device), attention_mask=mb.attention_mask.to(self.device),
                        position_ids=mb.position_ids.to(self.device), logits_to_keep=mb.max_response_len + 1,
                        use_cache=False)
        logits = out.logits[:, :-1, :].float()  # position t predicts response token t
        if temperature != 1.0:
            logits = logits / temperature
        logprobs = logprobs_from_logits(logits, mb.response_ids.to(self.device))
        entropy = entropy_from_logits(logits) if with_entropy else None
        return logprobs, entropy

    @torch.no_grad()
    def _logprobs_of(self, model, batch: dict, indices: list[int]) -> list[list[float]]:
        out: list[list[float]] = [[] for _ in indices]
        lengths = [len(batch["tokens"][i]) for i in indices]
        for mb_idx in pack_micro_batches(lengths, self.cfg.max_tokens_per_gpu):
            mb = self._collate(batch, [indices[j] for j in mb_idx])
            lp, _ = self._forward(model, mb)
            for row, j in enumerate(mb_idx):
                n = batch["response_lengths"][indices[j]]
                out[j] = lp[row, :n].cpu().tolist()
        return out

    def _collate(self, batch: dict, idx: list[int]) -> MicroBatch:
        prompts = [batch["tokens"][i][:batch["prompt_lengths"][i]] for i in idx]
        responses = [batch["tokens"][i][batch["prompt_lengths"][i]:] for i in idx]
        return collate(prompts, responses, [batch["loss_masks"][i] for i in idx], self.pad_id)

    def train(self, rollout_id: int, batch: dict, temperature: float = 1.0) -> dict:
        t0 = time.time()
        alg = self.cfg.algorithm
        n = len(batch["rewards"])
        advantages = grpo_advantages(torch.tensor(batch["rewards"], dtype=torch.float32),
                                     torch.tensor(batch["group_index"]), normalize_std=alg.normalize_std).tolist()
        # Each worker takes every world_size-th sample of each optimizer step's slice.
        gbs = self.cfg.global_batch_size
        steps = [list(range(s, min(s + gbs, n)))[self.rank::self.world_size] for s in range(0, n, gbs)]
        mine = [i for step in steps for i in step]
        self.model.eval()
        if alg.use_rollout_logprobs:
            old = {i: batch["rollout_logprobs"][i] for i in mine}
        elif len(steps) == 1:
            # One optimizer step per rollout: the policy before the step *is* the one being
            # trained, so its log-probs come from the training forward pass itself (detached)
            # instead of a second full forward pass.
            old = None
        else:
            old = dict(zip(mine, self._logprobs_of(self.module, batch, mine)))
        ref = dict(zip(mine, self._logprobs_of(self.ref_model, batch, mine))) if self.ref_model is not None else None
        self.model.train()
        metrics_acc: dict[str, list[float]] = {}
        for step_idx in steps:
            self._train_step(batch, step_idx, advantages, old, ref, temperature, metrics_acc)
        metrics = {f"train/{k}": float(np.mean(v)) for k, v in metrics_acc.items()}
        metrics["train/lr"] = self.scheduler.get_last_lr()[0]
        metrics["train/seconds"] = time.time() - t0
        metrics["train/started_at"] = t0
        metrics["train/finished_at"] = time.time()
        metrics["train/optimizer_steps"] = self.optimizer_steps
        return metrics

    def _train_step(self, batch, idx, advantages, old, ref, temperature, metrics_acc) -> None:
        alg = self.cfg.algorithm
        self.optimizer.zero_grad(set_to_none=True)
        lengths = [len(batch["tokens"][i]) for i in idx]
        micro = pack_micro_batches(lengths, self.cfg.max_tokens_per_gpu)
        # Aggregation weights: each micro-batch's loss is scaled by its share of the step's
        # tokens (or sequences), so the sum equals the loss over the whole step.
        total_tokens = sum(sum(batch["loss_masks"][i]) for i in idx)
        total = self._all_reduce_sum(float(total_tokens if alg.loss_agg_mode == "token_mean" else len(idx)))
        for k, mb_local in enumerate(micro):
            rows = [idx[j] for j in mb_local]
            mb = self._collate(batch, rows)
            width = mb.max_response_len
            mask = mb.response_mask.to(self.device)
            adv = torch.tensor([advantages[i] for i in rows], dtype=torch.float32, device=self.device)
            rollout_lp = pad_rows([batch["rollout_logprobs"][i] for i in rows], width).to(self.device)
            has_rollout_lp = all(len(batch["rollout_logprobs"][i]) == batch["response_lengths"][i] for i in rows)
            sync = k == len(micro) - 1 or not isinstance(self.model, torch.nn.parallel.DistributedDataParallel)
            ctx = torch.enable_grad() if sync else self.model.no_sync()
            with ctx:
                logprobs, entropy = self._forward(self.model, mb, temperature, with_entropy=True)
                old_lp = logprobs.detach() if old is None else pad_rows([old[i] for i in rows], width).to(self.device)
                loss, m = policy_loss(
                    logprobs, old_lp, adv, mask, eps_clip=alg.eps_clip, eps_clip_high=alg.eps_clip_high,
                    eps_clip_c=alg.eps_clip_c, rollout_logprobs=rollout_lp if has_rollout_lp else None,
                    use_tis=alg.use_tis and has_rollout_lp, tis_clip=alg.tis_clip, tis_clip_low=alg.tis_clip_low,
                    agg_mode=alg.loss_agg_mode, loss_type=alg.loss_type)
                ent = aggregate_loss(entropy, mask, alg.loss_agg_mode)
                loss = loss - alg.entropy_coef * ent
                if ref is not None:
                    ref_lp = pad_rows([ref[i] for i in rows], width).to(self.device)
                    kl = aggregate_loss(compute_approx_kl(logprobs, ref_lp, alg.kl_loss_type), mask,
                                        alg.loss_agg_mode)
                    loss = loss + alg.kl_loss_coef * kl
                    m["kl_loss"] = kl.detach()
                share = (mask.sum().item() if alg.loss_agg_mode == "token_mean" else len(rows)) / max(total, 1.0)
                # DDP averages gradients over workers; multiply back so the step's loss is a global sum.
                (loss * share * self.world_size).backward()
            m["entropy"] = ent.detach()
            m["loss"] = loss.detach()
            for key, value in m.items():
                metrics_acc.setdefault(key, []).append(float(value))
        if self.cfg.optimizer.clip_grad > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.cfg.optimizer.clip_grad)
        else:
            grad_norm = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in self.module.parameters()
                                       if p.grad is not None))
        metrics_acc.setdefault("grad_norm", []).append(float(grad_norm))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer_steps += 1

    def _all_reduce_sum(self, value: float) -> float:
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return float(t.item())

    # -- weights -----------------------------------------------------------------------
    def push_weights(self, urls: list[str], weight_version: int, engine_dtype: str, timeout: float) -> dict:
        """Stream the policy to every engine in buckets; only rank 0 sends (DDP replicas agree)."""
        if self.rank != 0:
            return {}
        t0 = time.time()
        buckets = iter_buckets(self.module.named_parameters(), DTYPES[engine_dtype],
                               self.cfg.update_weight_buffer_size)
        nbytes = asyncio.run(push_buckets(buckets, urls, weight_version, timeout))
        return {"weights/push_seconds": time.time() - t0, "weights/bytes": nbytes}

    # -- checkpoints -------------------------------------------------------------------
    def _seed_everything(self, seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)

    def save(self, save_dir: str, rollout_id: int, save_optimizer: bool = True) -> None:
        from safetensors.torch import save_file

        out = iteration_dir(save_dir, rollout_id) / "actor"
        out.mkdir(parents=True, exist_ok=True)
        rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
        torch.save(rng, out / f"rng_rank{self.rank}.pt")
        if self.rank != 0:
            return
        state = {k: v.detach().contiguous() for k, v in self.module.state_dict().items()}
        # Tied weights share storage; safetensors refuses aliases, so keep one name.
        if getattr(self.module.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file(state, str(out / "model.safetensors"))
        if save_optimizer:
            torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                        "optimizer_steps": self.optimizer_steps}, out / "optimizer.pt")

    def _load(self, load_dir: str, rollout_id: int) -> None:
        from safetensors.torch import load_file

        src = iteration_dir(load_dir, rollout_id) / "actor"
        missing, unexpected = self.module.load_state_dict(load_file(str(src / "model.safetensors")), strict=False)
        missing = [k for k in missing if k != "lm_head.weight"]
        if missing or unexpected:
            raise RuntimeError(f"--load: {src} does not match the model: missing {missing[:5]}, "
                               f"unexpected {unexpected[:5]}")
        if getattr(self.module.config, "tie_word_embeddings", False):
            self.module.tie_weights()
        if (src / "optimizer.pt").exists():
            opt = torch.load(src / "optimizer.pt", weights_only=False)
            self.optimizer.load_state_dict(opt["optimizer"])
            self.scheduler.load_state_dict(opt["scheduler"])
            self.optimizer_steps = opt["optimizer_steps"]
        rng_path = src / f"rng_rank{self.rank}.pt"
        if rng_path.exists():
            rng = torch.load(rng_path, weights_only=False)
            random.setstate(rng["python"])
            np.random.set_state(rng["numpy"])
            torch.set_rng_state(rng["torch"])

    def save_hf(self, path: str) -> None:
        if self.rank != 0:
            return
        from transformers import AutoTokenizer

        tmp = Path(str(path) + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        self.module.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(self.cfg.model_path).save_pretrained(tmp)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)

    def state_checksum(self) -> float:
        return float(sum(p.detach().double().sum() for p in self.module.parameters()))

"""What the policy and the value model of the torch backend share.

On top of ``BaseWorker``: the HF module, the optimizer (AdamW or SGD) under a torch LR
scheduler, data parallelism by DDP over torch.distributed's world group (gloo on the CPU,
NCCL on GPUs), the optimizer step itself, and checkpoints (weights, optimizer, RNG) in a
sub-folder named after the worker's role, written at once or copied to the CPU at the step
boundary and written in the background (--async-save).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from miles_async.backends.packing import MicroBatch
from miles_async.backends.worker import (
    BaseWorker,
    load_rng_state,
    lr_lambda,
    rng_state,
    save_rng_state,
    save_tensors,
)
from miles_async.config import OptimizerConfig, TrainConfig
from miles_async.utils.checkpoint import fsync_path, iteration_dir, load_tensors

if TYPE_CHECKING:
    from miles_async.rollout.batch import RolloutBatch

# loss_fn(micro_batch, sample_indices) -> (loss of those samples under the step's aggregation, metrics)
LossFn = Callable[[MicroBatch, list[int]], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def make_optimizer(params, opt: OptimizerConfig) -> torch.optim.Optimizer:
    """--optimizer adam: AdamW (decoupled weight decay, as Megatron's adam); sgd: SGD with --sgd-momentum and
    weight decay added to the gradient (as Megatron's sgd)."""
    if opt.optimizer == "sgd":
        return torch.optim.SGD(params, lr=opt.lr, momentum=opt.sgd_momentum, weight_decay=opt.weight_decay)
    return torch.optim.AdamW(
        params, lr=opt.lr, betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps, weight_decay=opt.weight_decay
    )


def _cpu_copy(obj: Any) -> Any:
    """``obj`` with every tensor copied to the CPU: the optimizer's state dict holds the live tensors that the
    next step updates in place."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu_copy(v) for v in obj)
    return obj


class TrainWorker(BaseWorker):
    """Base of the torch backend's policy and critic workers; subclasses build the module and the loss."""

    def __init__(self, cfg: TrainConfig, rank: int, world_size: int, total_optimizer_steps: int):
        super().__init__(cfg, rank, world_size)
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

    def _build_module(self) -> torch.nn.Module:
        raise NotImplementedError

    def init_process_group(self, master_addr: str, master_port: int) -> None:
        if self.world_size == 1:
            return
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend, init_method=f"tcp://{master_addr}:{master_port}", rank=self.rank, world_size=self.world_size
        )
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.model = DDP(self.module, device_ids=[self.device.index] if self.device.type == "cuda" else None)

    # -- one rollout's optimisation --------------------------------------------------------
    def _optimizer_step(self, batch: RolloutBatch, idx: list[int], loss_fn: LossFn, metrics_acc: dict) -> None:
        """One optimizer step over this worker's samples ``idx`` of the step."""
        self.optimizer.zero_grad(set_to_none=True)
        micro = self._micro_batches(batch, idx)
        step_size = self._step_size(batch, idx)
        is_ddp = isinstance(self.model, torch.nn.parallel.DistributedDataParallel)
        for k, rows in enumerate(micro):
            mb = self._collate(batch, rows)
            sync = k == len(micro) - 1 or not is_ddp
            with torch.enable_grad() if sync else self.model.no_sync():
                loss, m = loss_fn(mb, rows)
                (loss * self._share(mb, rows, step_size)).backward()
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
    def save(self, save_dir: str, rollout_id: int, save_optimizer: bool = True, background: bool = False) -> None:
        """This worker's part of checkpoint ``rollout_id``: written now, or with ``background`` copied to the CPU
        now (the step boundary) and written by ``write_checkpoint`` while training goes on."""
        out = iteration_dir(save_dir, rollout_id) / self.cfg.role
        rng = rng_state()
        if self.rank != 0:
            model = optimizer = None
        elif background:
            model = {k: v.detach().to("cpu", copy=True) for k, v in self._model_state().items()}
            optimizer = _cpu_copy(self._optimizer_state()) if save_optimizer else None
        else:
            model, optimizer = self._model_state(), self._optimizer_state() if save_optimizer else None
        self._unwritten = lambda: self._write(out, rng, model, optimizer)
        if not background:
            self.write_checkpoint()

    def _model_state(self) -> dict[str, torch.Tensor]:
        state = {k: v.detach().contiguous() for k, v in self.module.state_dict().items()}
        # Tied weights share storage; safetensors refuses aliases, so keep one name.
        if getattr(self.module.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        return state

    def _optimizer_state(self) -> dict:
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "optimizer_steps": self.optimizer_steps,
        }

    def _write(self, out: Path, rng: dict, model: dict | None, optimizer: dict | None) -> None:
        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        save_rng_state(out, self.rank, rng)
        if model is not None:
            save_file(model, str(out / "model.safetensors"))
            fsync_path(out / "model.safetensors")
        if optimizer is not None:
            save_tensors(optimizer, out / "optimizer.pt")
        fsync_path(out)

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
            opt = load_tensors(src / "optimizer.pt")
            self.optimizer.load_state_dict(opt["optimizer"])
            self.scheduler.load_state_dict(opt["scheduler"])
            self.optimizer_steps = opt["optimizer_steps"]
        load_rng_state(src, self.rank)

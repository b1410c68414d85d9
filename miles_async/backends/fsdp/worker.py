"""What the policy and the value model of the torch backend share.

On top of ``BaseWorker``: the HF module, sharded by FSDP2 over the workers when there are two or more
(``sharding.py``: gloo on the CPU, NCCL on GPUs), the optimizer (AdamW or SGD) on this rank's shards under a
torch LR scheduler, the optimizer step itself, and sharded checkpoints (``checkpoint.py``) in a sub-folder
named after the worker's role, written at once or copied at the step boundary and written in the background
(--async-save).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from miles_async.backends.data_parallel import all_reduce_max
from miles_async.backends.fsdp import checkpoint
from miles_async.backends.fsdp.sharding import full_tensor, shard_model, total_norm
from miles_async.backends.packing import MicroBatch, even_out
from miles_async.backends.worker import (
    BaseWorker,
    join_process_group,
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

TRAIN_STATE = "train_state.pt"

# loss_fn(micro_batch, sample_indices) -> (loss of those samples under the step's aggregation, metrics)
LossFn = Callable[[MicroBatch, list[int]], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def make_optimizer(params, opt: OptimizerConfig) -> torch.optim.Optimizer:
    """--optimizer adam: AdamW (decoupled weight decay, as Megatron's adam), torch's fused kernel (on the CPU torch
    would otherwise loop over the tensors: 5x slower on SmolLM2-135M, issue 34); sgd: SGD with --sgd-momentum and
    weight decay added to the gradient (as Megatron's sgd)."""
    if opt.optimizer == "sgd":
        return torch.optim.SGD(params, lr=opt.lr, momentum=opt.sgd_momentum, weight_decay=opt.weight_decay)
    return torch.optim.AdamW(
        params,
        lr=opt.lr,
        betas=(opt.adam_beta1, opt.adam_beta2),
        eps=opt.adam_eps,
        weight_decay=opt.weight_decay,
        fused=True,
    )


class TrainWorker(BaseWorker):
    """Base of the torch backend's policy and critic workers; subclasses build the module and the loss."""

    def __init__(
        self,
        cfg: TrainConfig,
        rank: int,
        world_size: int,
        total_optimizer_steps: int,
        load_dir: str | None = None,
        load_rollout_id: int | None = None,
    ):
        super().__init__(cfg, rank, world_size)
        # Master weights and optimizer state stay fp32; --bf16 computes in bf16 (autocast, and FSDP2's
        # parameter cast when sharded).
        with torch.random.fork_rng(devices=[]):
            # Every rank builds the same module (a critic's head, LoRA's A matrices start random): FSDP2 keeps each
            # rank's own shard of what it built, unlike DDP's broadcast from rank 0.
            torch.manual_seed(cfg.seed)
            self.module = self._build_module().to(self.device)
        if cfg.gradient_checkpointing:
            self.module.gradient_checkpointing_enable()
            if not all(p.requires_grad for p in self.module.parameters()):
                # Frozen embeddings (LoRA) would leave the checkpointed blocks' inputs without a gradient to carry.
                self.module.enable_input_require_grads()
        self.module.config.use_cache = False
        self.pad_id = self.module.config.pad_token_id or 0
        self.model = self.module
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self._total_optimizer_steps = total_optimizer_steps
        self._load_from = (load_dir, load_rollout_id)
        self._checkpoint_group: dist.ProcessGroup | None = None
        self._pending_save: Future | None = None
        if world_size == 1:  # nothing to shard: ready now, without a process group
            self._setup()

    def _build_module(self) -> torch.nn.Module:
        raise NotImplementedError

    def _modules_to_shard(self) -> list[torch.nn.Module]:
        """Every model this worker runs as a collective once sharded (the policy adds its reference model)."""
        return [self.module]

    def init_process_group(self, master_addr: str, master_port: int) -> None:
        if self.world_size == 1:
            return
        # CPU tensors (offloaded shards, checkpoint planning) need gloo beside NCCL on GPUs.
        backend = "cpu:gloo,cuda:nccl" if self.device.type == "cuda" else "gloo"
        if not dist.is_initialized():  # a process running two workers (a test) joins one group once
            join_process_group(backend, self.rank, self.world_size, master_addr, master_port, self.rendezvous)
        self._checkpoint_group = dist.new_group(backend="gloo")
        self._setup()

    def _setup(self) -> None:
        """Shards the models over the workers (2 or more), then builds the optimizer on what this rank holds and
        loads --load's checkpoint into it."""
        if self.world_size > 1:
            for module in self._modules_to_shard():
                shard_model(module, self.world_size, self.device, self.cfg.dtype == "bfloat16", self.cfg.cpu_offload)
        opt = self.cfg.optimizer
        self.optimizer = make_optimizer([p for p in self.module.parameters() if p.requires_grad], opt)
        self._lr_at = lr_lambda(opt, self._total_optimizer_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_at)
        load_dir, load_rollout_id = self._load_from
        if load_dir is not None and load_rollout_id is not None:
            self._load(load_dir, load_rollout_id)

    @property
    def _trains_subset(self) -> bool:
        """Whether some weights are frozen (LoRA): checkpoints then hold only the trained ones."""
        return any(not p.requires_grad for p in self.module.parameters())

    @property
    def _sharded(self) -> bool:
        return self.world_size > 1

    def _micro_batches(self, batch: RolloutBatch, idx: list[int]) -> list[list[int]]:
        packed = super()._micro_batches(batch, idx)
        return even_out(packed, all_reduce_max(len(packed), self.dp, self.device)) if self._sharded else packed

    def _per_sample(self, fn, batch: RolloutBatch, idx: list[int]) -> dict[int, list[float]]:
        out = super()._per_sample(fn, batch, idx)
        if self._sharded:
            # FSDP2 leaves the root's parameters (embeddings, head) gathered after a forward, expecting the
            # backward; a pass without one would keep them whole until the next training step.
            for module in self._modules_to_shard():
                module.reshard()
        return out

    # -- one rollout's optimisation --------------------------------------------------------
    def _optimizer_step(self, batch: RolloutBatch, idx: list[int], loss_fn: LossFn, metrics_acc: dict) -> None:
        """One optimizer step over this worker's samples ``idx`` of the step. Sharded, every micro-batch's
        backward reduce-scatters its gradients, so no rank ever holds a full gradient."""
        self.optimizer.zero_grad(set_to_none=True)
        step_size = self._step_size(batch, idx)
        for rows in self._micro_batches(batch, idx):
            if not rows:  # even_out's throw-away pass: keeps this rank in step with the others' collectives
                loss, _ = loss_fn(self._collate(batch, [0]), [0])
                (loss * 0.0).backward()
                continue
            mb = self._collate(batch, rows)
            loss, m = loss_fn(mb, rows)
            (loss * self._share(mb, rows, step_size)).backward()
            m["loss"] = loss.detach()
            for key, value in m.items():
                metrics_acc.setdefault(key, []).append(float(value))
        trained = [p for p in self.module.parameters() if p.requires_grad]
        if self.cfg.optimizer.clip_grad > 0:
            grad_norm = float(full_tensor(torch.nn.utils.clip_grad_norm_(trained, self.cfg.optimizer.clip_grad)))
        else:
            grad_norm = total_norm([p.grad for p in trained if p.grad is not None])
        metrics_acc.setdefault("grad_norm", []).append(grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer_steps += 1

    def state_checksum(self) -> float:
        return float(sum(full_tensor(p.detach()).double().sum() for p in self.module.parameters()))

    # -- checkpoints -------------------------------------------------------------------
    def save(self, save_dir: str, rollout_id: int, save_optimizer: bool = True, background: bool = False) -> None:
        """This worker's shards of checkpoint ``rollout_id``: written now, or with ``background`` copied to host
        memory now (the step boundary) and written while training goes on (``write_checkpoint`` waits for it)."""
        out = iteration_dir(save_dir, rollout_id) / self.cfg.role
        out.mkdir(parents=True, exist_ok=True)
        rng = rng_state()
        train_state = {"scheduler": self.scheduler.state_dict(), "optimizer_steps": self.optimizer_steps}
        state = checkpoint.state_of(self.module, self.optimizer if save_optimizer else None, self._trains_subset)
        pending = checkpoint.save(state, out, self._checkpoint_group, background)
        self._unwritten = lambda: self._write(out, rng, train_state, pending)
        if not background:
            self.write_checkpoint()

    def _write(self, out: Path, rng: dict, train_state: dict, pending: Future | None) -> None:
        if pending is not None:
            pending.result()
        save_rng_state(out, self.rank, rng)
        if self.rank == 0:
            save_tensors(train_state, out / TRAIN_STATE)
        fsync_path(out)

    def _load(self, load_dir: str, rollout_id: int) -> None:
        src = iteration_dir(load_dir, rollout_id) / self.cfg.role
        why = checkpoint.missing_weights(src, self.cfg.role)
        if why is not None:
            hint = (
                " (written by a run without a critic, i.e. not --advantage-estimator ppo)"
                if self.cfg.role == "critic" and not src.exists()
                else ""
            )
            raise RuntimeError(f"--load: {why}{hint}")
        with_optimizer = checkpoint.has_optimizer(src)
        checkpoint.load(
            self.module, self.optimizer if with_optimizer else None, src, self._checkpoint_group, self._trains_subset
        )
        if with_optimizer and (src / TRAIN_STATE).exists():
            state = load_tensors(src / TRAIN_STATE)
            self.scheduler.load_state_dict(state["scheduler"])
            self.optimizer_steps = state["optimizer_steps"]
        load_rng_state(src, self.rank)

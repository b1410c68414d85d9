"""What every training worker shares, whatever its backend.

One Ray actor per worker: threads, device and seeding, its place among the data-parallel
replicas, the LR schedule's shape, the split of this worker's samples into token-budgeted
micro-batches and the loss share of each, and the RNG states a checkpoint keeps. A backend's
worker builds on ``BaseWorker`` with its own model, optimizer, step and checkpoint format.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from miles_async.backends.data_parallel import DataParallel, all_reduce_sum
from miles_async.backends.packing import MicroBatch, collate, pack_micro_batches
from miles_async.config import OptimizerConfig, TrainConfig

if TYPE_CHECKING:
    from miles_async.rollout.batch import RolloutBatch


def lr_lambda(cfg: OptimizerConfig, total_steps: int) -> Callable[[int], float]:
    """The LR of step ``step`` as a fraction of ``--lr``: warm-up, then the decay style down to ``--min-lr``."""

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


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


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


class BaseWorker:
    """The backend-independent half of a training worker; a backend sets ``module``, ``model`` and ``pad_id``."""

    module: torch.nn.Module | None  # the model itself: weights, checkpoints
    model: torch.nn.Module | None  # what training runs: ``module`` under the backend's data-parallel wrapper
    pad_id: int

    def __init__(self, cfg: TrainConfig, rank: int, world_size: int):
        torch.set_num_threads(cfg.num_threads)
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        # Every worker a replica of its own until the backend knows its data-parallel group.
        self.dp = DataParallel(rank, world_size)
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        )
        seed_everything(cfg.seed + rank)
        self.optimizer_steps = 0

    # -- Ray-facing ------------------------------------------------------------------------
    def address(self) -> tuple[str, int]:
        """This node's address and a free port, for rank 0 to host the process group's rendezvous."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def pid(self) -> int:
        return os.getpid()

    def state_checksum(self) -> float:
        return float(sum(p.detach().double().sum() for p in self.module.parameters()))

    # -- this worker's samples -----------------------------------------------------------------
    def _collate(self, batch: RolloutBatch, idx: list[int]) -> MicroBatch:
        prompts = [batch.tokens[i][: batch.prompt_lengths[i]] for i in idx]
        responses = [batch.tokens[i][batch.prompt_lengths[i] :] for i in idx]
        return collate(prompts, responses, [batch.loss_masks[i] for i in idx], self.pad_id)

    def _micro_batches(self, batch: RolloutBatch, idx: list[int]) -> list[list[int]]:
        lengths = [len(batch.tokens[i]) for i in idx]
        return [[idx[j] for j in mb] for mb in pack_micro_batches(lengths, self.cfg.max_tokens_per_gpu)]

    @torch.no_grad()
    def _per_sample(
        self, fn: Callable[[MicroBatch], torch.Tensor], batch: RolloutBatch, idx: list[int]
    ) -> dict[int, list[float]]:
        """``fn``'s ``[B, R]`` output for each sample, cut to its response length."""
        out: dict[int, list[float]] = {}
        for rows in self._micro_batches(batch, idx):
            values = fn(self._collate(batch, rows))
            for r, i in enumerate(rows):
                out[i] = values[r, : batch.response_lengths[i]].float().cpu().tolist()
        return out

    # -- the loss of one optimizer step --------------------------------------------------------
    def _step_size(self, batch: RolloutBatch, idx: list[int]) -> float:
        """What --loss-agg-mode averages the step's loss over, summed over the replicas: its trained tokens
        (token_mean) or its samples; ``idx`` is this replica's samples of the step."""
        own = sum(sum(batch.loss_masks[i]) for i in idx) if self._token_mean else len(idx)
        return all_reduce_sum(float(own), self.dp, self.device)

    def _share(self, mb: MicroBatch, rows: list[int], step_size: float) -> float:
        """The weight of micro-batch ``mb``'s loss, so that the sum over micro-batches and replicas is the loss
        of the whole step; the backends' gradient averaging over replicas is multiplied back here."""
        own = mb.response_mask.sum().item() if self._token_mean else len(rows)
        return own / max(step_size, 1.0) * self.dp.size

    @property
    def _token_mean(self) -> bool:
        return self.cfg.algorithm.loss_agg_mode == "token_mean"

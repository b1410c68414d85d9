"""What every training worker shares, whatever its backend.

One Ray actor per worker: threads, device and seeding, its place among the data-parallel
replicas, the LR schedule's shape, the split of this worker's samples into token-budgeted
micro-batches and the loss share of each, the RNG states a checkpoint keeps, and the write of a
checkpoint copied at a step boundary. A backend's worker builds on ``BaseWorker`` with its own
model, optimizer, step and checkpoint format.
"""

from __future__ import annotations

import math
import os
import random
import stat
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from miles_async.backends.data_parallel import DataParallel, all_reduce_sum
from miles_async.backends.packing import MicroBatch, collate, pack_micro_batches
from miles_async.backends.routing_replay import records_for
from miles_async.backends.shared_prefix import pack_shared, prompt_keys
from miles_async.config import OptimizerConfig, TrainConfig
from miles_async.utils.checkpoint import CheckpointError, load_tensors
from miles_async.utils.ports import hosted_store

if TYPE_CHECKING:
    from torch.distributed import TCPStore

    from miles_async.rollout.batch import RolloutBatch

# How long the ranks of a group wait for each other to join it: torch's own default, as its tcp:// rendezvous had.
JOIN_TIMEOUT = 1800.0


def lr_lambda(cfg: OptimizerConfig, total_steps: int) -> Callable[[int], float]:
    """The LR of step ``step`` as a fraction of ``--lr``: warm-up, then the decay style down to ``--min-lr`` over
    ``--lr-decay-iters`` steps (default ``total_steps``, the run's)."""
    if cfg.lr_decay_iters is not None:
        total_steps = cfg.lr_decay_iters

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


def join_process_group(
    backend: str, rank: int, world_size: int, master_addr: str, master_port: int, hosted: TCPStore | None = None
) -> None:
    """Join torch.distributed's default group through the rendezvous store at ``master_addr:master_port``: through
    ``hosted`` when this process serves it (rank 0 of a train group, ``BaseWorker.address``), else as its client.
    No rank binds that port itself: its host bound it before any rank was told the number."""
    import torch.distributed as dist

    store = hosted
    if store is None:
        store = dist.TCPStore(
            master_addr, master_port, world_size, is_master=False, timeout=timedelta(seconds=JOIN_TIMEOUT)
        )
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, torch.Tensor | int | float]:
    """Python, numpy and torch RNG states of this process, as tensors and numbers only (``torch.load`` with
    ``weights_only=True`` reads them back), so a resumed run samples as the original."""
    version, words, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    assert version == 3 and kind == "MT19937", (version, kind)  # the only generators either has shipped
    return {
        "python": torch.tensor(words, dtype=torch.int64),
        "python_gauss": float("nan") if gauss is None else gauss,
        "numpy": torch.from_numpy(keys.astype(np.int64)),
        "numpy_pos": int(pos),
        "numpy_has_gauss": int(has_gauss),
        "numpy_gauss": float(cached),
        "torch": torch.get_rng_state(),
    }


def set_rng_state(rng: dict) -> None:
    gauss = rng["python_gauss"]
    random.setstate((3, tuple(rng["python"].tolist()), None if math.isnan(gauss) else gauss))
    keys = rng["numpy"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, rng["numpy_pos"], rng["numpy_has_gauss"], rng["numpy_gauss"]))
    torch.set_rng_state(rng["torch"])


def save_tensors(obj: object, path: Path) -> None:
    """``torch.save`` through a Python file: its blocking I/O lets go of the GIL, so a slow disk stalls a background
    checkpoint's thread and not the training beside it (``torch.save`` to a path holds the GIL in its writer).
    Synced to disk before it returns, as every part of a checkpoint is before the pointer names it."""
    with open(path, "wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        if stat.S_ISREG(os.fstat(fh.fileno()).st_mode):  # a pipe or device has nothing to sync (EINVAL)
            os.fsync(fh.fileno())


def save_rng_state(folder: Path, rank: int, rng: dict | None = None) -> None:
    """``rng`` (this process's RNG now when None) as ``rng_rank<rank>.pt``."""
    save_tensors(rng_state() if rng is None else rng, folder / f"rng_rank{rank}.pt")


def load_rng_state(folder: Path, rank: int) -> None:
    path = folder / f"rng_rank{rank}.pt"
    if path.exists():
        rng = load_tensors(path)
        try:
            set_rng_state(rng)
        except (KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"--load: {path} is not an RNG state of this miles-async: {e!r}") from e


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
        # A checkpoint copied at a step boundary by save(..., background=True), not yet written.
        self._unwritten: Callable[[], None] | None = None
        # The process group's rendezvous, once this worker (rank 0) serves it (``address``).
        self.rendezvous: TCPStore | None = None

    # -- Ray-facing ------------------------------------------------------------------------
    def address(self) -> tuple[str, int]:
        """This node's address and the port of the process group's rendezvous, which this worker (rank 0) serves
        from now on: bound before any rank is told the number, so no other process can take it in between."""
        import ray

        host = ray.util.get_node_ip_address()
        self.rendezvous = hosted_store(host, JOIN_TIMEOUT, self.world_size)
        return host, self.rendezvous.port

    def pid(self) -> int:
        return os.getpid()

    def write_checkpoint(self) -> None:
        """Writes the checkpoint the last ``save(..., background=True)`` copied. The train group calls it in
        the workers' checkpoint concurrency group: in a thread of its own while the next step trains."""
        write, self._unwritten = self._unwritten, None
        if write is not None:
            write()

    def state_checksum(self) -> float:
        return float(sum(p.detach().double().sum() for p in self.module.parameters()))

    # -- this worker's samples -----------------------------------------------------------------
    def _collate(self, batch: RolloutBatch, idx: list[int]) -> MicroBatch:
        prompts = [batch.tokens[i][: batch.prompt_lengths[i]] for i in idx]
        responses = [batch.tokens[i][batch.prompt_lengths[i] :] for i in idx]
        keys = self._prompt_keys(batch, idx) if self._shares_prefix else None
        mb = collate(prompts, responses, [batch.loss_masks[i] for i in idx], self.pad_id, self._shares_prefix, keys)
        if self.cfg.routing_replay:
            mb.routing = records_for(batch, idx)
        return mb

    def _micro_batches(self, batch: RolloutBatch, idx: list[int]) -> list[list[int]]:
        if self._shares_prefix:
            prompts = [batch.tokens[i][: batch.prompt_lengths[i]] for i in idx]
            lengths = [batch.response_lengths[i] for i in idx]
            packed = pack_shared(prompts, lengths, self.cfg.max_tokens_per_gpu, self._prompt_keys(batch, idx))
        else:
            packed = pack_micro_batches([len(batch.tokens[i]) for i in idx], self.cfg.max_tokens_per_gpu)
        return [[idx[j] for j in mb] for mb in packed]

    @staticmethod
    def _prompt_keys(batch: RolloutBatch, idx: list[int]) -> list:
        prompts = [batch.tokens[i][: batch.prompt_lengths[i]] for i in idx]
        return prompt_keys(prompts, [batch.images[i] for i in idx] if batch.images is not None else None)

    @property
    def _shares_prefix(self) -> bool:
        """Whether this worker's forward passes take the shared-prefix layout (a backend that can says so)."""
        return False

    @torch.no_grad()
    def _per_sample(
        self, fn: Callable[[MicroBatch], torch.Tensor], batch: RolloutBatch, idx: list[int]
    ) -> dict[int, list[float]]:
        """``fn``'s ``[B, R]`` output for each sample, cut to its response length."""
        out: dict[int, list[float]] = {}
        for rows in self._micro_batches(batch, idx):
            values = fn(self._collate(batch, rows or [0]))  # no rows: a sharded worker's throw-away pass
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

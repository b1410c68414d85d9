"""The policy side of RL training, shared by every training backend.

A rollout is trained in two phases. ``prepare`` computes what the loss needs before
any weight moves (and, with --use-tis or --use-rollout-logprobs, fails the step on a sample
whose trained tokens lack the engine's log-probs): PPO's old log-probs (see ``validate_async_off_policy_correction``
for which policy that is), the reference model's log-probs, and the advantages of
the whole batch (plus value targets for the critic). ``train`` then takes the
optimizer steps. With a critic the loop calls them separately, so the critic can
train on the returns while the actor trains; otherwise ``train`` runs both.

``PolicyMixin`` holds all of that orchestration and the per-micro-batch loss assembly
(policy loss + entropy bonus + KL loss, from ``miles_async.algorithms``); a backend's worker
supplies only what ``PolicyBackend`` declares (checked when the worker is built): its
log-prob pass, one optimizer step, its data-parallel place, and its weights; with
--keep-old-actor also ``KeepsOldWeights``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from miles_async.algorithms.advantages import compute_advantages
from miles_async.algorithms.losses import (
    aggregate_loss,
    compute_approx_kl,
    masked_mean,
    policy_loss,
)
from miles_async.backends.data_parallel import DataParallel, all_gather_dict, all_gather_keys, shard
from miles_async.backends.packing import MicroBatch, pad_rows
from miles_async.backends.routing_replay import Replayer, ReplayStats
from miles_async.utils.weight_checksum import tensor_checksums
from miles_async.weights.disk import write_engine_folder
from miles_async.weights.sender import WeightSender
from miles_async.weights.source import WeightSource, iter_buckets
from miles_async.weights.update import WeightUpdate, torch_dtype

if TYPE_CHECKING:
    from miles_async.config import TrainConfig
    from miles_async.rollout.batch import RolloutBatch

# loss_of(micro_batch, sample_indices, logprobs [B, R], entropy [B, R]) -> (loss, metrics)
LossOfOutputs = Callable[
    [MicroBatch, list[int], torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]
]


@dataclass
class Prepared:
    rollout_id: int
    steps: list[list[int]]
    advantages: torch.Tensor  # [n, T] over the whole batch
    mask: torch.Tensor  # [n, T] loss mask
    old: dict[int, list[float]] | None  # None: the training pass's own detached log-probs
    ref: dict[int, list[float]] | None


def _padded(rows: list[list[float]] | list[list[int]], width: int) -> torch.Tensor:
    return pad_rows([[float(x) for x in r] for r in rows], width)


def _rollout_logprob_gap(logprobs: list[float], loss_mask: list[int], response_length: int) -> str | None:
    """Why a sample's rollout log-probs cannot serve its trained tokens, or None when they can.

    They must line up with the response (one per token) wherever a token is trained; a sample
    that trains no token needs none (a custom generate function may leave them out there)."""
    trained = [t for t, m in enumerate(loss_mask) if m]
    if not trained:
        return None
    if len(logprobs) != response_length:
        return f"{len(logprobs)} rollout log-probs for {response_length} response tokens"
    bad = next((t for t in trained if logprobs[t] is None or not math.isfinite(logprobs[t])), None)
    return None if bad is None else f"rollout log-prob {logprobs[bad]} at trained response token {bad}"


def require_rollout_logprobs(batch: RolloutBatch, rows: list[int], flag: str) -> None:
    """Fail the step on the first sample whose trained tokens lack the engine's log-probs: ``--use-tis``
    would otherwise weigh them against nothing, and ``--use-rollout-logprobs`` would read log-prob 0."""
    for i in rows:
        gap = _rollout_logprob_gap(batch.rollout_logprobs[i], batch.loss_masks[i], batch.response_lengths[i])
        if gap is not None:
            raise ValueError(
                f"{flag}: sample uid={batch.uids[i]} (index {i} of the rollout) has {gap}; "
                f"{flag} needs the engine's log-prob of every trained response token (a custom "
                f"generate function must fill Sample.rollout_logprobs, one per response token)"
            )


def reduce_metrics(acc: dict[str, list[float]], prefix: str) -> dict[str, float]:
    """Means over micro-batches and steps, except maxima, which stay maxima."""
    import numpy as np

    return {f"{prefix}/{k}": float(np.max(v) if k.endswith("_max") else np.mean(v)) for k, v in acc.items()}


class PolicyBackend(Protocol):
    """What ``PolicyMixin`` needs of the worker class it is mixed into."""

    cfg: TrainConfig
    dp: DataParallel  # the replicas that split each step's samples (miles_async.backends.data_parallel)
    module: torch.nn.Module | None  # the policy's weights
    model: torch.nn.Module | None  # what training runs (``module`` under the data-parallel wrapper)
    ref_model: torch.nn.Module | None  # the reference policy (--ref-load), or None
    optimizer_steps: int

    def _logprobs_of(
        self, model: torch.nn.Module, batch: RolloutBatch, idx: list[int], temperature: float
    ) -> dict[int, list[float]]:
        """Each of the samples ``idx``'s per-token log-probs of its response under ``model`` (old and ref log-probs;
        every rank of the worker group returns them)."""

    def _train_step(
        self, batch: RolloutBatch, idx: list[int], temperature: float, loss_of: LossOfOutputs, metrics_acc: dict
    ) -> None:
        """One optimizer step over this worker's samples ``idx``, calling ``loss_of(mb, rows, logprobs, entropy)``
        on each micro-batch's forward outputs."""

    def _current_lr(self) -> float:
        """The LR of the optimizer step just taken."""

    def _weight_source(self) -> WeightSource:
        """The policy's HF-named tensors and which rank sends them (``miles_async.weights``)."""


class KeepsOldWeights(Protocol):
    """What ``PolicyMixin`` also needs of a backend that supports --keep-old-actor."""

    def _snapshot_weights(self) -> dict[str, torch.Tensor]:
        """A copy of the policy's weights, away from the device."""

    def _model_with_weights(self, state: dict[str, torch.Tensor]) -> torch.nn.Module:
        """A model that evaluates with the weights of a snapshot."""


def _protocol_members(protocol: type) -> list[str]:
    return sorted(
        {*protocol.__annotations__, *(k for k, v in vars(protocol).items() if callable(v) and not k.startswith("__"))}
    )


class PolicyMixin:
    """The RL side of a policy worker, mixed into a backend's worker class (a ``PolicyBackend``, and with
    --keep-old-actor a ``KeepsOldWeights``)."""

    _prepared: Prepared | None = None

    def _init_policy_state(self) -> None:
        self._require(PolicyBackend)
        if self.cfg.algorithm.keep_old_actor:
            self._require(KeepsOldWeights)
        # --keep-old-actor: CPU copies of the weights of every version still in flight.
        self._kept_weights: dict[int, dict[str, torch.Tensor]] = {}
        self._prepared = None
        self._weight_sender = WeightSender()
        # --use-rollout-routing-replay: the backend installs it on its policy models and sets each pass's target.
        self._replayer = Replayer() if self.cfg.routing_replay else None
        self._routing_stats = ReplayStats()

    def _require(self, protocol: type) -> None:
        missing = [name for name in _protocol_members(protocol) if not hasattr(self, name)]
        if missing:
            raise TypeError(
                f"{type(self).__qualname__} mixes in PolicyMixin but lacks {missing} "
                f"(see miles_async.backends.policy.{protocol.__qualname__})"
            )

    # -- log-probs ------------------------------------------------------------------------
    def _logprobs_under_generating_weights(
        self, batch: RolloutBatch, idx: list[int], temperature: float
    ) -> dict[int, list[float]]:
        by_version: dict[int, list[int]] = {}
        for i in idx:
            versions, mask = batch.weight_versions[i], batch.loss_masks[i]
            # A partial rollout's prefix from older weights is masked out of the loss
            # (--mask-offpolicy-in-partial-rollout), so only the newest version matters.
            newest = max(versions, default=-1)
            if any(v != newest and m for v, m in zip(versions, mask)):
                raise RuntimeError(
                    f"--keep-old-actor: sample {batch.uids[i]} trains tokens of several weight "
                    f"versions {sorted(set(versions))}"
                )
            by_version.setdefault(newest, []).append(i)
        out: dict[int, list[float]] = {i: [] for i in by_version.pop(-1, [])}
        # Every replica goes through every version any of them holds: a sharded model's passes are collectives.
        for version in all_gather_keys(by_version, self.dp):
            by_version.setdefault(version, [])
        for version, rows in sorted(by_version.items()):
            if version not in self._kept_weights:
                sample = f" (sample {batch.uids[rows[0]]})" if rows else " (another replica's sample)"
                raise RuntimeError(
                    f"--keep-old-actor: weight version {version}{sample} is "
                    f"no longer kept; kept versions: {sorted(self._kept_weights)}"
                )
            out.update(
                self._logprobs_of(self._model_with_weights(self._kept_weights[version]), batch, rows, temperature)
            )
        return out

    # -- weights -------------------------------------------------------------------------
    def push_weights(self, update: WeightUpdate) -> dict:
        """Every rank calls it (a backend's source may gather); rank 0 sends the buckets by the update's route."""
        self._keep_weights(update.version)
        return self._weight_source().read(
            lambda named: self._weight_sender.push(
                iter_buckets(named, update.torch_dtype, update.bucket_bytes), update
            ),
            {},
        )

    def save_weights_for_engines(self, update: WeightUpdate) -> dict:
        """The disk route: rank 0 writes the policy's weights, in the engines' dtype, to ``update.folder``."""
        self._keep_weights(update.version)
        t0 = time.time()
        nbytes = self._weight_source().read(lambda named: write_engine_folder(named, self.cfg.model_path, update), 0)
        return {"weights/save_seconds": time.time() - t0, "weights/bytes": nbytes}

    def weights_checksum(self, engine_dtype: str) -> dict:
        """Per-tensor checksums of what ``push_weights`` sends (``--check-weight-update-equal``); rank 0's."""
        return self._weight_source().read(lambda named: tensor_checksums(named, torch_dtype(engine_dtype)), {})

    def _keep_weights(self, weight_version: int) -> None:
        if self.cfg.algorithm.keep_old_actor:
            self._kept_weights[weight_version] = self._snapshot_weights()
            for old in sorted(self._kept_weights)[: -self.cfg.max_kept_weight_versions]:
                del self._kept_weights[old]

    # -- one rollout -----------------------------------------------------------------------
    @torch.no_grad()
    def prepare(
        self, rollout_id: int, batch: RolloutBatch, temperature: float = 1.0, values: list[list[float]] | None = None
    ) -> list[list[float]] | None:
        """Old/ref log-probs and the whole batch's advantages; returns the critic's targets (ppo)."""
        alg = self.cfg.algorithm
        n = len(batch)
        steps, mine = shard(n, self.cfg.global_batch_size, self.dp)
        self._routing_stats = ReplayStats()
        if alg.use_tis or alg.use_rollout_logprobs:
            require_rollout_logprobs(batch, mine, "--use-tis" if alg.use_tis else "--use-rollout-logprobs")
        self.model.eval()
        if alg.use_rollout_logprobs:
            old = {i: batch.rollout_logprobs[i] for i in mine}
        elif alg.keep_old_actor:
            old = self._logprobs_under_generating_weights(batch, mine, temperature)
        elif len(steps) == 1 and alg.kl_coef == 0:
            # One optimizer step per rollout: the policy before the step *is* the one being
            # trained, so its log-probs come from the training pass itself (detached) instead
            # of a second full forward pass.
            old = None
        else:
            old = self._logprobs_of(self.module, batch, mine, temperature)
        ref = self._logprobs_of(self.ref_model, batch, mine, temperature) if self.ref_model is not None else None

        width = max(1, max(batch.response_lengths))
        mask = _padded(batch.loss_masks, width)
        kl = None
        if alg.kl_coef > 0:
            # Per-token reward penalty over the whole batch: every worker needs every sample's KL.
            old_all, ref_all = all_gather_dict(old, self.dp), all_gather_dict(ref, self.dp)
            kl = compute_approx_kl(
                _padded([old_all[i] for i in range(n)], width), _padded([ref_all[i] for i in range(n)], width), "k1"
            )
        advantages, returns = compute_advantages(
            alg.advantage_estimator,
            torch.tensor(batch.rewards, dtype=torch.float32),
            torch.tensor(batch.group_index),
            mask,
            normalize_std=alg.normalize_std,
            values=_padded(values, width) if values is not None else None,
            kl=kl,
            kl_coef=alg.kl_coef,
            gamma=alg.gamma,
            lambd=alg.lambd,
            normalize_advantages=alg.normalize_advantages,
        )
        self._prepared = Prepared(rollout_id, steps, advantages, mask, old, ref)
        if returns is None:
            return None
        return [returns[i, : batch.response_lengths[i]].tolist() for i in range(n)]

    def train(
        self, rollout_id: int, batch: RolloutBatch, temperature: float = 1.0, values: list[list[float]] | None = None
    ) -> dict:
        t0 = time.time()
        if self._prepared is None or self._prepared.rollout_id != rollout_id:
            self.prepare(rollout_id, batch, temperature, values)
        prep, self._prepared = self._prepared, None
        self.model.train()
        metrics_acc: dict[str, list[float]] = {}
        metrics_acc["advantage_abs_mean"] = [float(masked_mean(prep.advantages.abs(), prep.mask))]

        def loss_of(mb: MicroBatch, rows: list[int], logprobs: torch.Tensor, entropy: torch.Tensor):
            return self._policy_loss(batch, prep, mb, rows, logprobs, entropy)

        for step_idx in prep.steps:
            self._train_step(batch, step_idx, temperature, loss_of, metrics_acc)
        if self._replayer is not None:
            self._replayer.clear()
        metrics = reduce_metrics(metrics_acc, "train")
        metrics.update({f"train/{k}": v for k, v in self._routing_stats.metrics().items()})
        metrics.update(
            {
                "train/lr": self._current_lr(),
                "train/seconds": time.time() - t0,
                "train/started_at": t0,
                "train/finished_at": time.time(),
                "train/optimizer_steps": self.optimizer_steps,
            }
        )
        return metrics

    def _policy_loss(
        self,
        batch: RolloutBatch,
        prep: Prepared,
        mb: MicroBatch,
        rows: list[int],
        logprobs: torch.Tensor,
        entropy: torch.Tensor,
    ):
        """One micro-batch's loss from its per-token log-probs and entropy (``[B, R]``, on any device)."""
        alg = self.cfg.algorithm
        device = logprobs.device
        width = mb.max_response_len
        mask = mb.response_mask.to(device)
        adv = prep.advantages[rows, :width]
        if adv.shape[1] < width:
            adv = torch.nn.functional.pad(adv, (0, width - adv.shape[1]))
        adv = adv.to(device)
        # With --use-tis, prepare() checked every trained token's log-prob; otherwise they only feed metrics.
        has_rollout_lp = alg.use_tis or all(len(batch.rollout_logprobs[i]) == batch.response_lengths[i] for i in rows)
        rollout_lp = pad_rows([batch.rollout_logprobs[i] for i in rows], width).to(device)
        old_lp = logprobs.detach() if prep.old is None else pad_rows([prep.old[i] for i in rows], width).to(device)
        loss, m = policy_loss(
            logprobs,
            old_lp,
            adv,
            mask,
            eps_clip=alg.eps_clip,
            eps_clip_high=alg.eps_clip_high,
            eps_clip_c=alg.eps_clip_c,
            rollout_logprobs=rollout_lp if has_rollout_lp else None,
            use_tis=alg.use_tis,
            tis_clip=alg.tis_clip,
            tis_clip_low=alg.tis_clip_low,
            tis_level=alg.tis_level,
            tis_mode=alg.tis_mode,
            agg_mode=alg.loss_agg_mode,
            loss_type=alg.loss_type,
        )
        ent = aggregate_loss(entropy, mask, alg.loss_agg_mode)
        m["entropy"] = ent.detach()
        loss = loss - alg.entropy_coef * ent
        if prep.ref is not None and alg.use_kl_loss:
            ref_lp = pad_rows([prep.ref[i] for i in rows], width).to(device)
            kl = aggregate_loss(compute_approx_kl(logprobs, ref_lp, alg.kl_loss_type), mask, alg.loss_agg_mode)
            loss = loss + alg.kl_loss_coef * kl
            m["kl_loss"] = kl.detach()
        return loss, m

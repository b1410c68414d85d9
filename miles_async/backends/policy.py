"""The policy side of RL training, shared by every training backend.

A rollout is trained in two phases. ``prepare`` computes what the loss needs before
any weight moves (and, with --use-tis or --use-rollout-logprobs, fails the step on a sample
whose trained tokens lack the engine's log-probs): PPO's old log-probs (see ``validate_async_off_policy_correction``
for which policy that is), the reference model's log-probs, and the advantages of
the whole batch (plus value targets for the critic). ``train`` then takes the
optimizer steps. With a critic the loop calls them separately, so the critic can
train on the returns while the actor trains; otherwise ``train`` runs both.

``PolicyMixin`` holds all of that orchestration and the per-micro-batch loss assembly
(policy loss + entropy bonus + KL loss, from ``miles_async.algorithms``); a backend
supplies only:

* ``_forward(model, mb, temperature, with_entropy) -> (logprobs [B, R], entropy | None)``,
* ``_train_step(batch, idx, temperature, loss_of, metrics_acc)``: one optimizer step over
  this worker's samples ``idx``, calling ``loss_of(mb, rows, logprobs, entropy)`` on each
  micro-batch's forward outputs,
* ``_shard``, ``_per_sample``, ``_all_gather_dict`` (over the data-parallel group),
  ``_current_lr()``, ``optimizer_steps``, ``module``/``model``/``ref_model``/``device``,
* for ``--keep-old-actor``: ``_snapshot_weights()`` and ``_model_with_weights(state)``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from miles_async.algorithms.advantages import compute_advantages
from miles_async.algorithms.losses import aggregate_loss, compute_approx_kl, masked_mean, policy_loss
from miles_async.backends.packing import MicroBatch, pad_rows

# loss_of(micro_batch, sample_indices, logprobs [B, R], entropy [B, R]) -> (loss, metrics)
LossOfOutputs = Callable[[MicroBatch, list[int], torch.Tensor, torch.Tensor],
                         tuple[torch.Tensor, dict[str, torch.Tensor]]]


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


def require_rollout_logprobs(batch: dict, rows: list[int], flag: str) -> None:
    """Fail the step on the first sample whose trained tokens lack the engine's log-probs: ``--use-tis``
    would otherwise weigh them against nothing, and ``--use-rollout-logprobs`` would read log-prob 0."""
    for i in rows:
        gap = _rollout_logprob_gap(batch["rollout_logprobs"][i], batch["loss_masks"][i], batch["response_lengths"][i])
        if gap is not None:
            raise ValueError(f"{flag}: sample uid={batch['uids'][i]} (index {i} of the rollout) has {gap}; "
                             f"{flag} needs the engine's log-prob of every trained response token (a custom "
                             f"generate function must fill Sample.rollout_logprobs, one per response token)")


def reduce_metrics(acc: dict[str, list[float]], prefix: str) -> dict[str, float]:
    """Means over micro-batches and steps, except maxima, which stay maxima."""
    import numpy as np

    return {f"{prefix}/{k}": float(np.max(v) if k.endswith("_max") else np.mean(v)) for k, v in acc.items()}


class PolicyMixin:
    _prepared: Prepared | None = None

    def _init_policy_state(self) -> None:
        # --keep-old-actor: CPU copies of the weights of every version still in flight.
        self._kept_weights: dict[int, dict[str, torch.Tensor]] = {}
        self._prepared = None

    # -- log-probs ------------------------------------------------------------------------
    def _logprobs_of(self, model, batch: dict, idx: list[int], temperature: float) -> dict[int, list[float]]:
        return self._per_sample(lambda mb: self._forward(model, mb, temperature)[0], batch, idx)

    def _logprobs_under_generating_weights(self, batch: dict, idx: list[int],
                                           temperature: float) -> dict[int, list[float]]:
        by_version: dict[int, list[int]] = {}
        for i in idx:
            versions, mask = batch["weight_versions"][i], batch["loss_masks"][i]
            # A partial rollout's prefix from older weights is masked out of the loss
            # (--mask-offpolicy-in-partial-rollout), so only the newest version matters.
            newest = max(versions, default=-1)
            if any(v != newest and m for v, m in zip(versions, mask)):
                raise RuntimeError(f"--keep-old-actor: sample {batch['uids'][i]} trains tokens of several weight "
                                   f"versions {sorted(set(versions))}")
            by_version.setdefault(newest, []).append(i)
        out: dict[int, list[float]] = {i: [] for i in by_version.pop(-1, [])}
        for version, rows in sorted(by_version.items()):
            if version not in self._kept_weights:
                raise RuntimeError(f"--keep-old-actor: weight version {version} (sample {batch['uids'][rows[0]]}) is "
                                   f"no longer kept; kept versions: {sorted(self._kept_weights)}")
            out.update(self._logprobs_of(self._model_with_weights(self._kept_weights[version]), batch, rows,
                                         temperature))
        return out

    def _send_buckets(self, buckets, urls: list[str], weight_version: int, timeout: float, method: str,
                      ranks_per_engine: int, backend: str = "embedded") -> dict:
        """Rank 0's half of a weight push: ``tensor`` posts each bucket over HTTP (the embedded engine: the bytes;
        SGLang on this node: shared-memory handles); ``distributed`` broadcasts it in the process group shared
        with the engines (joined at the first push, kept for the run)."""
        import asyncio

        from miles_async.backends.weight_export import push_buckets

        t0 = time.time()
        if method == "distributed":
            nbytes = self._engine_weight_group(urls, ranks_per_engine, timeout).push(buckets, weight_version)
        elif method == "tensor":
            nbytes = asyncio.run(push_buckets(buckets, urls, weight_version, timeout, backend))
        else:
            raise ValueError(f"weight update method {method!r} does not push buckets")
        return {"weights/push_seconds": time.time() - t0, "weights/bytes": nbytes}

    def _engine_weight_group(self, urls: list[str], ranks_per_engine: int, timeout: float):
        from urllib.parse import urlparse

        from miles_async.backends.distributed_weights import EngineWeightGroup

        group = getattr(self, "_weight_group", None)
        if group is not None and group.urls == list(urls):
            return group
        if group is not None:
            group.close()
        hosts = {urlparse(u).hostname for u in urls}
        if hosts <= {"127.0.0.1", "localhost"}:
            address = "127.0.0.1"
        else:  # engines on other nodes reach the trainer by its node address
            import ray

            address = ray.util.get_node_ip_address()
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        self._weight_group = EngineWeightGroup(urls, ranks_per_engine, backend, address, timeout)
        return self._weight_group

    def save_weights_for_engines(self, path: str, weight_version: int, engine_dtype: str = "float32") -> dict:
        """The disk route of a weight update (``--weight-update-method disk``): write the policy's weights, in
        the engines' dtype, with the model's config.json (what an engine reloading weights reads; no tokenizer),
        for the engines to load from ``path``. Every rank calls it (Megatron's TP gathers); the backend's
        ``_save_engine_folder`` decides who writes."""
        from miles_async.backends.weight_export import DTYPES

        self._keep_weights(weight_version)
        t0 = time.time()
        nbytes = self._save_engine_folder(path, DTYPES[engine_dtype])
        return {"weights/save_seconds": time.time() - t0, "weights/bytes": nbytes}

    def _keep_weights(self, weight_version: int) -> None:
        if self.cfg.algorithm.keep_old_actor:
            self._kept_weights[weight_version] = self._snapshot_weights()
            for old in sorted(self._kept_weights)[:-self.cfg.max_kept_weight_versions]:
                del self._kept_weights[old]

    # -- one rollout -----------------------------------------------------------------------
    @torch.no_grad()
    def prepare(self, rollout_id: int, batch: dict, temperature: float = 1.0,
                values: list[list[float]] | None = None) -> list[list[float]] | None:
        """Old/ref log-probs and the whole batch's advantages; returns the critic's targets (ppo)."""
        alg = self.cfg.algorithm
        n = len(batch["rewards"])
        steps, mine = self._shard(n)
        if alg.use_tis or alg.use_rollout_logprobs:
            require_rollout_logprobs(batch, mine, "--use-tis" if alg.use_tis else "--use-rollout-logprobs")
        self.model.eval()
        if alg.use_rollout_logprobs:
            old = {i: batch["rollout_logprobs"][i] for i in mine}
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

        width = max(1, max(batch["response_lengths"]))
        mask = _padded(batch["loss_masks"], width)
        kl = None
        if alg.kl_coef > 0:
            # Per-token reward penalty over the whole batch: every worker needs every sample's KL.
            old_all, ref_all = self._all_gather_dict(old), self._all_gather_dict(ref)
            kl = compute_approx_kl(_padded([old_all[i] for i in range(n)], width),
                                   _padded([ref_all[i] for i in range(n)], width), "k1")
        advantages, returns = compute_advantages(
            alg.advantage_estimator, torch.tensor(batch["rewards"], dtype=torch.float32),
            torch.tensor(batch["group_index"]), mask, normalize_std=alg.normalize_std,
            values=_padded(values, width) if values is not None else None, kl=kl, kl_coef=alg.kl_coef,
            gamma=alg.gamma, lambd=alg.lambd, normalize_advantages=alg.normalize_advantages)
        self._prepared = Prepared(rollout_id, steps, advantages, mask, old, ref)
        if returns is None:
            return None
        return [returns[i, :batch["response_lengths"][i]].tolist() for i in range(n)]

    def train(self, rollout_id: int, batch: dict, temperature: float = 1.0,
              values: list[list[float]] | None = None) -> dict:
        t0 = time.time()
        if self.cfg.debug_train_seconds is not None:  # benchmarks: a set training cost, weights untouched
            time.sleep(self.cfg.debug_train_seconds)
            return {"train/seconds": time.time() - t0, "train/started_at": t0, "train/finished_at": time.time()}
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
        metrics = reduce_metrics(metrics_acc, "train")
        metrics.update({"train/lr": self._current_lr(), "train/seconds": time.time() - t0,
                        "train/started_at": t0, "train/finished_at": time.time(),
                        "train/optimizer_steps": self.optimizer_steps})
        return metrics

    def _policy_loss(self, batch: dict, prep: Prepared, mb: MicroBatch, rows: list[int], logprobs: torch.Tensor,
                     entropy: torch.Tensor):
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
        has_rollout_lp = alg.use_tis or all(len(batch["rollout_logprobs"][i]) == batch["response_lengths"][i]
                                            for i in rows)
        rollout_lp = pad_rows([batch["rollout_logprobs"][i] for i in rows], width).to(device)
        old_lp = logprobs.detach() if prep.old is None else pad_rows([prep.old[i] for i in rows], width).to(device)
        loss, m = policy_loss(
            logprobs, old_lp, adv, mask, eps_clip=alg.eps_clip, eps_clip_high=alg.eps_clip_high,
            eps_clip_c=alg.eps_clip_c, rollout_logprobs=rollout_lp if has_rollout_lp else None,
            use_tis=alg.use_tis, tis_clip=alg.tis_clip, tis_clip_low=alg.tis_clip_low,
            tis_level=alg.tis_level, tis_mode=alg.tis_mode, agg_mode=alg.loss_agg_mode, loss_type=alg.loss_type)
        ent = aggregate_loss(entropy, mask, alg.loss_agg_mode)
        m["entropy"] = ent.detach()
        loss = loss - alg.entropy_coef * ent
        if prep.ref is not None and alg.use_kl_loss:
            ref_lp = pad_rows([prep.ref[i] for i in rows], width).to(device)
            kl = aggregate_loss(compute_approx_kl(logprobs, ref_lp, alg.kl_loss_type), mask, alg.loss_agg_mode)
            loss = loss + alg.kl_loss_coef * kl
            m["kl_loss"] = kl.detach()
        return loss, m

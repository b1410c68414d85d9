"""The value model of the torch backend: the policy's transformer with a scalar head.

Built with transformers' token-classification head (one label) on the critic's
starting checkpoint (``--critic-load``, default the policy's), so any architecture
transformers knows gets a critic without code here; the head starts random. The
value of response token t is read where the policy's logits for token t are: at the
position just before it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from miles_async.algorithms.losses import value_loss
from miles_async.backends.data_parallel import all_gather_dict, shard
from miles_async.backends.fsdp.worker import TrainWorker
from miles_async.backends.packing import MicroBatch, pad_rows
from miles_async.backends.policy import reduce_metrics

if TYPE_CHECKING:
    from miles_async.rollout.batch import RolloutBatch


class FSDPCritic(TrainWorker):
    def _build_module(self) -> torch.nn.Module:
        from transformers import AutoConfig, AutoModelForTokenClassification

        # Dropout in the head would make the value targets noisy for nothing.
        config = AutoConfig.from_pretrained(self.cfg.model_path, num_labels=1, classifier_dropout=0.0)
        return AutoModelForTokenClassification.from_pretrained(self.cfg.model_path, config=config, dtype=torch.float32)

    def _values(self, model, mb: MicroBatch) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.dtype == "bfloat16"):
            out = model(
                input_ids=mb.input_ids.to(self.device),
                attention_mask=mb.attention_mask.to(self.device),
                position_ids=mb.position_ids.to(self.device),
                use_cache=False,
            )
        r = mb.max_response_len
        return out.logits[:, -(r + 1) : -1, 0].float()

    def compute_values(self, rollout_id: int, batch: RolloutBatch) -> list[list[float]]:
        """Every sample's per-token values under the critic before this rollout's update."""
        _, mine = shard(len(batch), self.cfg.global_batch_size, self.dp)
        self.model.eval()
        values = all_gather_dict(self._per_sample(lambda mb: self._values(self.module, mb), batch, mine), self.dp)
        return [values[i] for i in range(len(batch))]

    def train(
        self, rollout_id: int, batch: RolloutBatch, values: list[list[float]], returns: list[list[float]]
    ) -> dict:
        t0 = time.time()
        steps, _ = shard(len(batch), self.cfg.global_batch_size, self.dp)
        self.model.train()
        metrics_acc: dict[str, list[float]] = {}
        for idx in steps:
            self._optimizer_step(batch, idx, lambda mb, rows: self._value_loss(values, returns, mb, rows), metrics_acc)
        metrics = reduce_metrics(metrics_acc, "critic")
        metrics.update({"critic/lr": self.scheduler.get_last_lr()[0], "critic/seconds": time.time() - t0})
        return metrics

    def _value_loss(self, values, returns, mb: MicroBatch, rows: list[int]):
        width = mb.max_response_len
        alg = self.cfg.algorithm
        new = self._values(self.model, mb)
        old = pad_rows([values[i] for i in rows], width).to(self.device)
        target = pad_rows([returns[i] for i in rows], width).to(self.device)
        return value_loss(
            new, old, target, mb.response_mask.to(self.device), value_clip=alg.value_clip, agg_mode=alg.loss_agg_mode
        )

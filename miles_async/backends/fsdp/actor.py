"""The policy worker of the torch backend (HF causal LMs).

The RL orchestration (old/ref log-probs, advantages, the per-micro-batch loss) is
``miles_async.backends.policy.PolicyMixin``, shared with the Megatron backend; this
class only builds the HF model, runs its forward pass to per-token log-probs and
entropy, and takes the optimizer step through ``TrainWorker``.
"""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from miles_async.algorithms.losses import entropy_from_logits, logprobs_from_logits
from miles_async.backends.fsdp.worker import TrainWorker
from miles_async.backends.packing import MicroBatch
from miles_async.backends.policy import LossOfOutputs, PolicyMixin, Prepared  # noqa: F401 - Prepared re-exported
from miles_async.backends.shared_prefix import row_logits
from miles_async.config import TrainConfig
from miles_async.weights.source import WeightSource

if TYPE_CHECKING:
    from miles_async.rollout.batch import RolloutBatch


SHARED_PREFIX_ATTENTION = ("sdpa", "eager")


def response_logits(
    model: torch.nn.Module, mb: MicroBatch, device: torch.device, attn_implementation: str = "sdpa"
) -> torch.Tensor:
    """``[B, R, V]`` float logits predicting each response token of ``mb``, from its shared-prefix layout when it
    has one, else from one padded row per sample. ``model`` may be wrapped (DDP): the caller names its attention."""
    layout = mb.shared
    if layout is None:
        out = model(
            input_ids=mb.input_ids.to(device),
            attention_mask=mb.attention_mask.to(device),
            position_ids=mb.position_ids.to(device),
            logits_to_keep=mb.max_response_len + 1,
            use_cache=False,
        )
        return out.logits[:, :-1, :].float()  # position t predicts response token t
    mask = layout.attention_mask.to(device)
    if attn_implementation == "eager":  # eager adds the mask to the scores
        mask = torch.zeros(mask.shape, device=device).masked_fill(~mask, torch.finfo(torch.float32).min)
    out = model(
        input_ids=layout.input_ids.to(device),
        attention_mask=mask,
        position_ids=layout.position_ids.to(device),
        logits_to_keep=layout.logits_to_keep,
        use_cache=False,
    )
    return row_logits(out.logits, layout).float()


class FSDPTrainActor(PolicyMixin, TrainWorker):
    def __init__(
        self,
        cfg: TrainConfig,
        rank: int,
        world_size: int,
        total_optimizer_steps: int,
        load_dir: str | None = None,
        load_rollout_id: int | None = None,
    ):
        super().__init__(cfg, rank, world_size, total_optimizer_steps)
        self.ref_model = None
        if cfg.algorithm.needs_ref_model and cfg.ref_model_path is not None:
            self.ref_model = self._causal_lm(cfg.ref_model_path).to(self.device).eval().requires_grad_(False)
        self._init_policy_state()
        # --keep-old-actor: a scratch module to evaluate the kept weights in.
        self._old_module: torch.nn.Module | None = None
        if load_dir is not None and load_rollout_id is not None:
            self._load(load_dir, load_rollout_id)

    @staticmethod
    def _causal_lm(path: str, **config: float) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **config)

    def _build_module(self) -> torch.nn.Module:
        # --attention-dropout: HF attention applies it in training passes only (log-probs run in eval mode).
        return self._causal_lm(self.cfg.model_path, attention_dropout=self.cfg.attention_dropout)

    # -- forward passes --------------------------------------------------------------------
    def _forward(self, model, mb: MicroBatch, temperature: float = 1.0, with_entropy: bool = False):
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.dtype == "bfloat16"):
            logits = response_logits(model, mb, self.device, self.module.config._attn_implementation)
        if temperature != 1.0:
            logits = logits / temperature
        logprobs = logprobs_from_logits(logits, mb.response_ids.to(self.device))
        entropy = entropy_from_logits(logits) if with_entropy else None
        return logprobs, entropy

    @property
    def _shares_prefix(self) -> bool:
        # A 4D block mask is honoured by HF's sdpa and eager attention; flash-attention takes 2D masks only.
        return self.cfg.shared_prefix and self.module.config._attn_implementation in SHARED_PREFIX_ATTENTION

    # -- backend hooks of PolicyMixin ---------------------------------------------------------
    def _train_step(
        self, batch: RolloutBatch, idx: list[int], temperature: float, loss_of: LossOfOutputs, metrics_acc: dict
    ) -> None:
        self._optimizer_step(
            batch,
            idx,
            lambda mb, rows: loss_of(mb, rows, *self._forward(self.model, mb, temperature, with_entropy=True)),
            metrics_acc,
        )

    def _current_lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def _snapshot_weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu", copy=True) for k, v in self.module.state_dict().items()}

    def _model_with_weights(self, state: dict[str, torch.Tensor]) -> torch.nn.Module:
        if self._old_module is None:
            self._old_module = copy.deepcopy(self.module).eval().requires_grad_(False)
        self._old_module.load_state_dict(state, strict=False)
        return self._old_module

    # -- weights -----------------------------------------------------------------------
    def _weight_source(self) -> WeightSource:
        # DDP replicas agree: rank 0's copy goes out, alone.
        return WeightSource(self.module.named_parameters, sends=self.rank == 0)

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

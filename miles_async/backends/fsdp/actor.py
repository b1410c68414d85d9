"""The policy worker of the torch backend (HF causal LMs).

The RL orchestration (old/ref log-probs, advantages, the per-micro-batch loss) is
``miles_async.backends.policy.PolicyMixin``, shared with the Megatron backend; this
class only builds the HF model, runs its forward pass to per-token log-probs and
entropy, and takes the optimizer step through ``TrainWorker``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.utils.checkpoint import checkpoint

from miles_async.algorithms.losses import entropy_from_logits, logprobs_from_logits
from miles_async.backends.fsdp.lora import adapter_tensors, add_adapters, merged_parameters, write_adapter
from miles_async.backends.fsdp.prefix_attention import SHARED_PREFIX_SDPA, use_prefix_attention, worth_splitting
from miles_async.backends.fsdp.sharding import full_parameters, local_tensor, shard_model
from miles_async.backends.fsdp.vision import VisionInputs, forward_kwargs, freeze_vision_tower
from miles_async.backends.fsdp.worker import TrainWorker
from miles_async.backends.packing import MicroBatch
from miles_async.backends.policy import LossOfOutputs, PolicyMixin, Prepared  # noqa: F401 - Prepared re-exported
from miles_async.backends.routing_replay import targets
from miles_async.backends.shared_prefix import row_logits
from miles_async.backends.trainable import select_trainable
from miles_async.config import TrainConfig
from miles_async.utils.hf_names import checkpoint_named
from miles_async.vision.hf import is_vision_model, model_class
from miles_async.weights.disk import write_hf_checkpoint
from miles_async.weights.source import WeightSource

if TYPE_CHECKING:
    from miles_async.rollout.batch import RolloutBatch


SHARED_PREFIX_ATTENTION = ("sdpa", "eager", SHARED_PREFIX_SDPA)
# Tokens whose logits a pass holds at once: ~50 MB of float32 logits at a 49k vocabulary, where a micro-batch's
# whole [tokens x vocab] logits (and, training, their log-softmax and entropy terms and the gradients of each) ran to
# gigabytes with long answers; the projection's matmul runs as fast at this height as over a whole micro-batch
# (issue 34, lever 1).
LOGPROB_CHUNK_TOKENS = 256
# The training pass recomputes its chunks' logits in the backward only where keeping them would take more than this
# (float32 logits of the micro-batch's real answer tokens): the recomputation is one more output-projection matmul a
# chunk, 10% of SmolLM2's training pass at 8x8x40 (benchmarks/levers.py), where keeping them is 100 MB; at 128x8x40
# they would be 1.4 GB a copy, and recomputing ran both faster and in 2.6x less memory.
RECOMPUTE_ABOVE_BYTES = 512 * 2**20


def response_hidden(
    model: torch.nn.Module, mb: MicroBatch, device: torch.device, attn_implementation: str = "sdpa"
) -> tuple[torch.Tensor, torch.nn.Module]:
    """``[B, R, H]``: the last hidden state that predicts each response token of ``mb``, from its shared-prefix layout
    when it has one, else from one padded row per sample, and the output projection that makes it logits. The model
    runs whole (its hooks, a sharded root's gathers included) with that projection swapped out for the pass."""
    head = model.get_output_embeddings()
    model.set_output_embeddings(torch.nn.Identity())
    try:
        return _response_outputs(model, mb, device, attn_implementation), head
    finally:
        model.set_output_embeddings(head)


def _response_outputs(model: torch.nn.Module, mb: MicroBatch, device: torch.device, attn_implementation: str):
    layout = mb.shared
    if layout is None:
        width = mb.input_ids.shape[1]
        out = model(
            input_ids=mb.input_ids.to(device),
            attention_mask=mb.attention_mask.to(device),
            position_ids=mb.position_ids.to(device),
            # position t of these predicts response token t
            logits_to_keep=kept_positions(width - mb.max_response_len - 1, width - 1, device),
            use_cache=False,
            **forward_kwargs(mb.pixels, device),
        )
        return out.logits
    mask = layout.attention_mask.to(device)
    width = layout.input_ids.shape[1]
    if attn_implementation == "eager":  # eager adds the mask to the scores
        mask = torch.zeros(mask.shape, device=device).masked_fill(~mask, torch.finfo(torch.float32).min)
    # Our sdpa computes only the blocks the layout's mask opens (prefix_attention.py), given the blocks' sizes, where
    # that skips enough of the scores to pay; otherwise it is HF's sdpa on the whole mask.
    split = attn_implementation == SHARED_PREFIX_SDPA and worth_splitting(*layout.blocks)
    blocks = {"shared_prefix": layout.slot_map} if split else {}
    out = model(
        input_ids=layout.input_ids.to(device),
        attention_mask=mask,
        position_ids=layout.position_ids.to(device),
        logits_to_keep=kept_positions(width - layout.logits_to_keep, width, device),
        use_cache=False,
        **forward_kwargs(layout.pixels, device),
        **blocks,
    )
    return row_logits(out.logits, layout)


def kept_positions(start: int, end: int, device: torch.device) -> torch.Tensor:
    """The columns ``[start, end)`` whose outputs a forward keeps, as positions rather than a count: HF then gathers
    them into a contiguous tensor, where a count slices a view that is not contiguous across sequences. (When the
    projection ran inside the forward, torch's matmul with a frozen weight did not fold such a view into one matrix
    product: it ran a batched product against the [vocab x hidden] weight expanded per sequence, a reference forward
    about 3x as slow as the policy's on SmolLM2-135M.)"""
    return torch.arange(start, end, device=device)


class FSDPTrainActor(PolicyMixin, TrainWorker):
    _vision: VisionInputs | None = None  # set once the module is built, for a vision-language policy

    def __init__(
        self,
        cfg: TrainConfig,
        rank: int,
        world_size: int,
        total_optimizer_steps: int,
        load_dir: str | None = None,
        load_rollout_id: int | None = None,
    ):
        # Built before the base class sets up: sharded with the policy when there are several workers.
        self.ref_model = None
        if cfg.algorithm.needs_ref_model and cfg.ref_model_path is not None:
            ref = use_prefix_attention(self._causal_lm(cfg.ref_model_path), cfg.shared_prefix)
            self.ref_model = ref.eval().requires_grad_(False)
        super().__init__(cfg, rank, world_size, total_optimizer_steps, load_dir, load_rollout_id)
        if self.ref_model is not None:
            self.ref_model.to(self.device)
        # A vision-language policy: its micro-batches carry their images' pixels and 3-D positions.
        self._vision = VisionInputs(cfg.model_path, self.module) if is_vision_model(cfg.model_path) else None
        self._init_policy_state()
        if self._replayer is not None:
            self._replayer.install_hf(self.module)
        # --keep-old-actor: a scratch module to evaluate the kept weights in.
        self._old_module: torch.nn.Module | None = None

    def _modules_to_shard(self) -> list[torch.nn.Module]:
        return [self.module] + ([self.ref_model] if self.ref_model is not None else [])

    @staticmethod
    def _causal_lm(path: str, **config: float) -> torch.nn.Module:
        if not config or not is_vision_model(path):
            return model_class(path).from_pretrained(path, dtype=torch.float32, **config)
        # A VLM's config nests its language model's: the settings are that one's.
        from transformers import AutoConfig

        composite = AutoConfig.from_pretrained(path)
        for key, value in config.items():
            setattr(composite.get_text_config(), key, value)
        return model_class(path).from_pretrained(path, config=composite, dtype=torch.float32)

    def _build_module(self) -> torch.nn.Module:
        # --attention-dropout: HF attention applies it in training passes only (log-probs run in eval mode).
        # A fresh run under an empty --load starts from --ref-load's HF weights (config/checkpoint.py start_from).
        model = self._causal_lm(
            self.cfg.init_weights or self.cfg.model_path, attention_dropout=self.cfg.attention_dropout
        )
        if self.cfg.freeze_vision_tower:
            freeze_vision_tower(model)
        select_trainable(model, self.cfg.only_train_params, self.cfg.freeze_params)
        model = use_prefix_attention(model, self.cfg.shared_prefix)
        return add_adapters(model, self.cfg.lora) if self.cfg.lora is not None else model

    def _collate(self, batch: RolloutBatch, idx: list[int]) -> MicroBatch:
        mb = super()._collate(batch, idx)
        if self._vision is not None:
            images = [batch.images[i] if batch.images is not None else [] for i in idx]
            self._vision.attach(mb, images, [batch.uids[i] for i in idx])
        return mb

    # -- forward passes --------------------------------------------------------------------
    def _route(self, mb: MicroBatch) -> None:
        """--use-rollout-routing-replay: the policy's routers take ``mb``'s records in its layout's token order."""
        if self._replayer is None:
            return
        layout = mb.shared
        rows, pos = mb.padded_source() if layout is None else (layout.source_row, layout.source_pos)
        self._replayer.set(targets(mb.routing, rows, pos).flatten(0, 1), self._routing_stats)

    def _forward(self, model, mb: MicroBatch, temperature: float = 1.0, with_entropy: bool = False):
        """``[B, R]`` log-probs (and entropies) of ``mb``'s real response tokens, 0 at padding: the last hidden
        states projected and reduced ``LOGPROB_CHUNK_TOKENS`` tokens at a time, so the micro-batch's
        ``[tokens x vocab]`` logits never exist at once. With a gradient, where keeping every chunk's logits for the
        backward would take more than ``RECOMPUTE_ABOVE_BYTES``, each chunk is checkpointed: its backward projects
        the chunk again instead of keeping its logits, one more matmul of the output projection for memory that no
        longer grows with the micro-batch."""
        self._route(mb)
        with self._autocast():
            hidden, head = response_hidden(model, mb, self.device, self.module.config._attn_implementation)
        real = mb.attention_mask[:, -mb.max_response_len :].bool().to(self.device)
        hidden, labels = hidden[real], mb.response_ids.to(self.device)[real]

        def chunk(h: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
            with self._autocast():
                logits = head(h).float()
            logits = self._sampled_logits(logits, temperature)
            lp = logprobs_from_logits(logits, y)
            return (lp, entropy_from_logits(logits)) if with_entropy else (lp,)

        vocab = self.module.config.get_text_config().vocab_size
        recompute = torch.is_grad_enabled() and len(labels) * vocab * 4 > RECOMPUTE_ABOVE_BYTES
        outs = []
        for start in range(0, len(labels), LOGPROB_CHUNK_TOKENS):
            h, y = hidden[start : start + LOGPROB_CHUNK_TOKENS], labels[start : start + LOGPROB_CHUNK_TOKENS]
            outs.append(checkpoint(chunk, h, y, use_reentrant=False) if recompute else chunk(h, y))
        zeros = hidden.new_zeros(real.shape, dtype=torch.float32)
        if not outs:
            # No real token: the zeros still hang off the model's graph, as under FSDP every rank's backward must run
            # through the same modules.
            zeros = zeros + hidden.sum() * 0
            return zeros, zeros if with_entropy else None
        per_token = [zeros.index_put((real,), torch.cat(parts)) for parts in zip(*outs)]
        return per_token[0], per_token[1] if with_entropy else None

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.dtype == "bfloat16")

    def _sampled_logits(self, logits: torch.Tensor, temperature: float) -> torch.Tensor:
        """The logits of the distribution the engine samples from."""
        if self._vision is not None:  # the tokens the engine never samples (vision.hf.unsampled_token_ids)
            # The lowest finite logit, not -inf: its probability is 0 all the same, and the entropy's p * log p
            # stays 0 instead of 0 * -inf.
            logits[..., self._vision.unsampled_ids] = torch.finfo(logits.dtype).min
        return logits / temperature if temperature != 1.0 else logits

    @torch.no_grad()
    def _chunked_logprobs(self, model, mb: MicroBatch, temperature: float) -> torch.Tensor:
        """``[B, R]``: each real response token's log-prob (0 at padding) without a gradient (old and reference
        log-probs)."""
        return self._forward(model, mb, temperature)[0]

    def _logprobs_of(self, model, batch: RolloutBatch, idx: list[int], temperature: float) -> dict[int, list[float]]:
        return self._per_sample(lambda mb: self._chunked_logprobs(model, mb, temperature), batch, idx)

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
        # The scheduler has stepped past the step just taken (get_last_lr() is the next step's): its schedule there.
        return self.cfg.optimizer.lr * self._lr_at(self.optimizer_steps - 1)

    def _snapshot_weights(self) -> dict[str, torch.Tensor]:
        # This rank's shards: the scratch module is sharded the same way.
        return {k: local_tensor(v.detach()).to("cpu", copy=True) for k, v in self.module.state_dict().items()}

    def _model_with_weights(self, state: dict[str, torch.Tensor]) -> torch.nn.Module:
        if self._old_module is None:
            self._old_module = self._build_module().to(self.device).eval().requires_grad_(False)
            if self._replayer is not None:
                self._replayer.install_hf(self._old_module)
            self._old_module.config.use_cache = False
            if self._sharded:
                shard_model(self._old_module, self.world_size, self.device, self.cfg.dtype == "bfloat16", False)
        with torch.no_grad():
            for k, v in self._old_module.state_dict().items():
                local_tensor(v).copy_(state[k])
        return self._old_module

    # -- weights -----------------------------------------------------------------------
    def _weight_source(self) -> WeightSource:
        # Sharded: every rank takes part in each parameter's gather, rank 0 sends. One worker: its own tensors.
        # With LoRA the engines get each adapted layer merged, under the model's HF names.
        # Each goes out under its checkpoint's name (hf_names), as SGLang, vLLM and an HF folder take it.
        if self.cfg.lora is not None:
            tensors, sends, gathers = merged_parameters, self.rank == 0, self._sharded
        elif not self._sharded:
            tensors, sends, gathers = torch.nn.Module.named_parameters, True, False
        else:
            tensors, sends, gathers = full_parameters, self.rank == 0, True
        return WeightSource(lambda: checkpoint_named(self.module, tensors(self.module)), sends=sends, gathers=gathers)

    def save_hf(self, path: str) -> None:
        """--save-hf: rank 0 writes the policy (merged with its adapters) from tensors gathered one at a time;
        with --save-lora-adapter the adapter alone goes into ``path``/adapter as well."""
        self._weight_source().read(lambda named: write_hf_checkpoint(named, self.cfg.model_path, path), None)
        lora = self.cfg.lora
        if lora is not None and lora.save_adapter:
            adapters = WeightSource(lambda: adapter_tensors(self.module), sends=self.rank == 0, gathers=self._sharded)
            adapters.read(lambda named: write_adapter(named, lora, self.cfg.model_path, f"{path}/adapter"), None)

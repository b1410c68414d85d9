"""The policy worker of the Megatron-core backend.

Everything RL-specific (old/ref log-probs, advantages, the per-micro-batch loss) is
``PolicyMixin``, shared with the torch backend. This class builds a Megatron
``GPTModel`` from the HF checkpoint (``model.py``, ``convert.py``), wraps it in
Megatron's DDP and optimizer, runs each optimizer step and each log-prob pass through
Megatron's schedule over token-budgeted micro-batches (``packing.py``; with pipeline
stages, 1F1B: ``pipeline.py`` brings the last stage's results to the others), streams
the weights back to HF names in buckets for the engines and ``--save-hf`` (every stage's,
from the first), and saves resumable checkpoints with Megatron's distributed checkpointing.

The model is built in ``init_process_group`` (Megatron's tensor parallelism needs the
process group first); ``TrainGroup.init`` always calls it, also with one worker.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist

from miles_async.algorithms.losses import entropy_from_logits, logprobs_from_logits
from miles_async.backends.data_parallel import DataParallel, all_reduce_max
from miles_async.backends.megatron.context_parallel import gather as cp_gather
from miles_async.backends.megatron.context_parallel import next_token_labels
from miles_async.backends.megatron.context_parallel import split as cp_split
from miles_async.backends.megatron.convert import ExpertLayout, HFReader, export_hf, load_hf
from miles_async.backends.megatron.model import (
    ArchSpec,
    ParallelSizes,
    build_gpt_model,
    have_transformer_engine,
    init_parallel,
    optimizer_memory,
    training_knobs,
)
from miles_async.backends.megatron.pipeline import Stages
from miles_async.backends.megatron.torch_dist import load_weights
from miles_async.backends.packing import MicroBatch, even_out
from miles_async.backends.policy import LossOfOutputs, PolicyMixin
from miles_async.backends.routing_replay import targets as replay_targets
from miles_async.backends.worker import BaseWorker, load_rng_state, lr_lambda, save_rng_state, seed_everything
from miles_async.config import TrainConfig
from miles_async.utils.checkpoint import iteration_dir
from miles_async.utils.megatron_layout import looks_like_megatron
from miles_async.weights.disk import write_hf_checkpoint
from miles_async.weights.source import WeightSource

if TYPE_CHECKING:
    from miles_async.rollout.batch import RolloutBatch


def megatron_layout(mb: MicroBatch, pad_id: int, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``mb``'s rows right-aligned from position 0 (no attention mask needed beyond causal).

    Returns input ids ``[B, S]``, position ids ``[B, S]`` and, for each response token, the
    position whose logits predict it (``[B, R]``). ``S`` is rounded up to ``multiple``
    (the TP size under sequence parallelism).
    """
    b, total = mb.input_ids.shape
    r = mb.max_response_len
    p = total - r
    prompt_lens = mb.attention_mask[:, :p].sum(dim=1)
    lens = mb.attention_mask.sum(dim=1)
    s = int(lens.max())
    s = -(-s // multiple) * multiple
    ids = torch.full((b, s), pad_id, dtype=torch.long)
    for i in range(b):
        start = p - int(prompt_lens[i])
        ids[i, : int(lens[i])] = mb.input_ids[i, start : start + int(lens[i])]
    pos = torch.arange(s).expand(b, s).contiguous()
    targets = (prompt_lens[:, None] - 1 + torch.arange(r)[None, :]).clamp(0, s - 1)
    return ids, pos, targets


class _Layout(NamedTuple):
    """A micro-batch as the model takes it (``megatron_layout``), cut to this CP rank's positions under context
    parallelism, where ``labels`` (``[B, S / CP]``, the token each of those positions predicts) is set."""

    ids: torch.Tensor
    pos: torch.Tensor
    targets: torch.Tensor  # [B, R]: the whole sequence's position predicting each response token
    labels: torch.Tensor | None = None
    routing: torch.Tensor | None = None  # --use-rollout-routing-replay: [tokens, layers, topk] in the router's order


_LAYOUT_FLAGS = {
    "tp": "--tensor-model-parallel-size",
    "pp": "--pipeline-model-parallel-size",
    "ep": "--expert-model-parallel-size",
}


def check_optimizer_layout(meta: dict, layout: dict[str, int], distributed_optimizer: bool, src: Path) -> None:
    """A checkpoint's optimizer state (``meta``: its megatron_meta.json) loads into this run's ``layout``. The model
    and the plain optimizer's state reshard to any layout; the distributed optimizer's (dp_reshardable: each
    rank's shard of its flat gradient buffer, whose order follows the rank's parameters) only to another data
    parallelism, and not into the other optimizer."""
    if not meta["has_optimizer"] or "distributed_optimizer" not in meta:
        return  # weights only, or written before the layout was recorded
    if meta["distributed_optimizer"] != distributed_optimizer:
        saved = "with" if meta["distributed_optimizer"] else "without"
        raise RuntimeError(
            f"--load {src}: its optimizer state was saved {saved} --use-distributed-optimizer, whose state has "
            f"another form: resume {saved} it"
        )
    changed = {k: v for k, v in layout.items() if distributed_optimizer and meta.get(k, 1) != v}
    if changed:
        flags = ", ".join(f"{_LAYOUT_FLAGS[k]} {meta.get(k, 1)} (this run: {v})" for k, v in changed.items())
        raise RuntimeError(
            f"--load {src}: its distributed optimizer state is each rank's shard of a layout's gradient buffers, "
            f"which loads only into the same layout (data parallelism may change): resume with {flags}"
        )


class MegatronTrainActor(PolicyMixin, BaseWorker):
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
        self.total_optimizer_steps = total_optimizer_steps
        self._load_from = (load_dir, load_rollout_id)
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(cfg.model_path)
        self.arch = ArchSpec.from_hf(hf_config)
        self.pad_id = hf_config.pad_token_id or 0
        m = cfg.megatron
        self.par = ParallelSizes(
            m.tensor_model_parallel_size,
            m.pipeline_model_parallel_size,
            m.context_parallel_size,
            m.sequence_parallel,
            m.use_distributed_optimizer,
            m.expert_model_parallel_size,
            m.expert_tensor_parallel_size,
            m.decoder_first_pipeline_num_layers,
            m.decoder_last_pipeline_num_layers,
        )
        self.bf16 = cfg.dtype == "bfloat16"
        # Built in init_process_group, once Megatron's parallel groups exist.
        self.module = self.model = self.ref_model = None
        self._init_policy_state()

    # -- set-up -------------------------------------------------------------------------
    def init_process_group(self, master_addr: str, master_port: int) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        init_parallel(self.rank, self.world_size, self.par, master_addr, master_port, self.cfg.seed, self.rendezvous)
        self.tp = ps.get_tensor_model_parallel_world_size()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.cp_rank = ps.get_context_parallel_rank()
        self.cp_group = ps.get_context_parallel_group()
        self.experts = ExpertLayout.current()
        self.stages = Stages.current()
        self.dp = DataParallel(
            ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), ps.get_data_parallel_group()
        )
        seed_everything(self.cfg.seed + self.dp.rank)  # TP ranks of a replica share their RNG
        module = self._build_gpt(self.cfg.init_weights or self.cfg.model_path).to(self.device)
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=self.par.distributed_optimizer,
        )
        trained = module
        if self.bf16:
            from megatron.core.transformer.module import Float16Module

            trained = Float16Module(module.config, module)  # fp32 logits out of the bf16 model
        self.model = DistributedDataParallel(module.config, ddp_cfg, trained)
        self.module = module
        if self._replayer is not None:
            self._replayer.install_megatron(module)
        cfg = module.config
        cfg.no_sync_func = self.model.no_sync
        cfg.finalize_model_grads_func = finalize_model_grads
        opt = self.cfg.optimizer
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer=opt.optimizer,
                lr=opt.lr,
                min_lr=opt.min_lr,
                weight_decay=opt.weight_decay,
                adam_beta1=opt.adam_beta1,
                adam_beta2=opt.adam_beta2,
                adam_eps=opt.adam_eps,
                clip_grad=opt.clip_grad,
                sgd_momentum=opt.sgd_momentum,
                bf16=self.bf16,
                fp16=False,
                params_dtype=torch.bfloat16 if self.bf16 else torch.float32,
                use_distributed_optimizer=self.par.distributed_optimizer,
                **optimizer_memory(self.cfg.megatron, torch.cuda.is_available(), have_transformer_engine()),
            ),
            [self.model],
        )
        self._lr_at = lr_lambda(opt, self.total_optimizer_steps)
        self._set_lr()
        if self.cfg.algorithm.needs_ref_model and self.cfg.ref_model_path is not None:
            self.ref_model = self._build_gpt(self.cfg.ref_model_path).to(self.device).eval().requires_grad_(False)
        load_dir, load_rollout_id = self._load_from
        if load_dir is not None and load_rollout_id is not None:
            self._load(load_dir, load_rollout_id)

    def _build_gpt(self, path: str):
        """The model of --hf-checkpoint's config with the weights of ``path``: an HF folder, or a Megatron-LM
        torch_dist checkpoint read straight into this run's parallel layout."""
        model = build_gpt_model(self.arch, self.par, bf16=self.bf16, knobs=training_knobs(self.cfg))
        if looks_like_megatron(Path(path)):
            load_weights(model, path)
        else:
            load_hf(model, HFReader(path), self.arch, self.tp, self.tp_rank, self.experts)
        return model

    def _set_lr(self) -> None:
        lr = self.cfg.optimizer.lr * self._lr_at(self.optimizer_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _current_lr(self) -> float:
        # The LR of the step just taken (_set_lr gave it before the count moved on), as the torch backend reports it.
        return self.cfg.optimizer.lr * self._lr_at(self.optimizer_steps - 1)

    # -- forward ----------------------------------------------------------------------------
    def _logits(self, model, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return model(ids.to(self.device), pos.to(self.device), None)  # [B, S, V_padded]

    def _outputs(
        self, logits: torch.Tensor, mb: MicroBatch, layout: _Layout, temperature: float, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[B, R]`` log-probs (and entropies) of ``mb``'s response tokens from the model's ``logits``."""
        rows = torch.arange(logits.shape[0], device=logits.device)[:, None]
        targets = layout.targets.to(logits.device)
        if layout.labels is not None:  # context parallel: this rank's tokens, then every rank's (context_parallel)
            local = logits[..., : self.arch.vocab_size].float()
            if temperature != 1.0:
                local = local / temperature
            logprobs = logprobs_from_logits(local, layout.labels.to(local.device))
            entropy = entropy_from_logits(local) if with_entropy else None
            whole = [cp_gather(t, self.par.cp, self.cp_group)[rows, targets] if t is not None else None
                     for t in (logprobs, entropy)]  # fmt: skip
            return whole[0], whole[1]
        logits = logits[rows, targets, : self.arch.vocab_size].float()  # [B, R, V]
        if temperature != 1.0:
            logits = logits / temperature
        logprobs = logprobs_from_logits(logits, mb.response_ids.to(logits.device))
        return logprobs, entropy_from_logits(logits) if with_entropy else None

    def _layout(self, mb: MicroBatch) -> _Layout:
        """The model's input for ``mb``: under context parallelism, this CP rank's part of each sequence."""
        multiple = self.tp if self.par.sequence_parallel else 1
        cp = self.par.cp
        if cp == 1:
            ids, pos, targets = megatron_layout(mb, self.pad_id, multiple)
            return _Layout(ids, pos, targets, None, self._routing(mb, ids) if self._replayer is not None else None)
        # Every sequence cuts into 2 x CP chunks (each a multiple of TP under sequence parallelism).
        ids, pos, targets = megatron_layout(mb, self.pad_id, 2 * cp * multiple)
        labels = next_token_labels(ids, self.pad_id)
        return _Layout(
            *(cp_split(t, cp, self.cp_rank) for t in (ids, pos)),
            targets,
            cp_split(labels, cp, self.cp_rank),
            self._routing(mb, ids) if self._replayer is not None else None,
        )

    def _routing(self, mb: MicroBatch, ids: torch.Tensor) -> torch.Tensor | None:
        """``mb``'s routing records (--use-rollout-routing-replay) in the order this rank's routers see the tokens of
        ``ids`` (``megatron_layout``'s rows, each sample's tokens from column 0): this CP rank's chunks, under
        sequence parallelism this TP rank's share of them, sequence major (``[S, B]`` flattened)."""
        lens = mb.attention_mask.sum(dim=1)
        cols = torch.arange(ids.shape[1]).expand(ids.shape)
        rows = torch.arange(ids.shape[0])[:, None].expand(ids.shape)
        routed = replay_targets(mb.routing, rows, torch.where(cols < lens[:, None], cols, -1))  # [B, S, L, k]
        if self.par.cp > 1:
            routed = cp_split(routed, self.par.cp, self.cp_rank)
        if self.par.sequence_parallel and self.tp > 1:
            routed = routed.chunk(self.tp, dim=1)[self.tp_rank]
        return routed.transpose(0, 1).flatten(0, 1)

    def _micro_batches(self, batch: RolloutBatch, idx: list[int]) -> list[list[int]]:
        # Under expert parallelism every MoE layer's forward exchanges tokens with the other replicas' ranks: all
        # run as many passes, some of them throw-away ones (no rows).
        packed = super()._micro_batches(batch, idx)
        return even_out(packed, all_reduce_max(len(packed), self.dp, self.device)) if self.experts.ep > 1 else packed

    def _schedule(self, model, batch: RolloutBatch, micro: list[list[int]], on_output, forward_only: bool) -> None:
        """The micro-batches ``micro`` (rows of ``batch``) through Megatron's schedule: with pipeline stages,
        activations flow between them; ``on_output(mb, rows, logits, layout)`` runs on the last stage and
        returns the micro-batch's loss."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, model):
            rows = next(data_iterator)
            mb = self._collate(batch, rows or [0])  # no rows: even_out's throw-away pass
            layout = self._layout(mb)
            if self._replayer is not None:
                # Left set until the next micro-batch's: a backward that recomputes this forward routes it alike.
                self._replayer.set(layout.routing, self._routing_stats)
            return self._logits(model, layout.ids, layout.pos), lambda output: (on_output(mb, rows, output, layout), {})

        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro),
            model=[model],
            num_microbatches=len(micro),
            # Each micro-batch's shape differs: the stages exchange it first (variable_seq_lengths).
            seq_length=max(len(batch.tokens[i]) for rows in micro for i in rows or [0]),
            micro_batch_size=1,
            forward_only=forward_only,
        )

    def _logprobs_of(self, model, batch: RolloutBatch, idx: list[int], temperature: float) -> dict[int, list[float]]:
        out: dict[int, list[float]] = {}

        def on_output(mb: MicroBatch, rows: list[int], logits: torch.Tensor, layout: _Layout):
            logprobs, _ = self._outputs(logits, mb, layout, temperature, with_entropy=False)
            for r, i in enumerate(rows):
                out[i] = logprobs[r, : batch.response_lengths[i]].float().cpu().tolist()
            return logprobs.new_zeros(())

        self._schedule(model, batch, self._micro_batches(batch, idx), on_output, forward_only=True)
        return self.stages.from_last(out)

    # -- one optimizer step through Megatron's schedule ------------------------------------------
    def _train_step(
        self, batch: RolloutBatch, idx: list[int], temperature: float, loss_of: LossOfOutputs, metrics_acc: dict
    ) -> None:
        micro = self._micro_batches(batch, idx)
        step_size = self._step_size(batch, idx)
        n_micro = len(micro)
        step_metrics: dict[str, list[float]] = {}

        def on_output(mb: MicroBatch, rows: list[int], logits: torch.Tensor, layout: _Layout):
            logprobs, entropy = self._outputs(logits, mb, layout, temperature, with_entropy=True)
            if not rows:
                return (logprobs * 0.0).sum()
            loss, m = loss_of(mb, rows, logprobs, entropy)
            m["loss"] = loss.detach()
            for key, value in m.items():
                step_metrics.setdefault(key, []).append(float(value))
            # The schedule divides by the number of micro-batches; undo it (the share undoes DDP's mean).
            return loss * self._share(mb, rows, step_size) * n_micro

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._schedule(self.model, batch, micro, on_output, forward_only=False)
        for key, values in self.stages.from_last(step_metrics).items():  # the loss is the last stage's
            metrics_acc.setdefault(key, []).extend(values)
        self._set_lr()
        _, grad_norm, _ = self.optimizer.step()
        metrics_acc.setdefault("grad_norm", []).append(float(grad_norm) if grad_norm is not None else 0.0)
        self.optimizer_steps += 1

    # -- weights ------------------------------------------------------------------------------
    def _export(self, tensor_of: Callable[[torch.nn.Parameter], torch.Tensor] | None = None):
        """(HF name, full tensor) of the policy (``tensor_of``: what of each parameter, its weights and expert biases
        by default), on
        the first pipeline stage; every TP rank of DP replica 0 on every stage must consume it, and under expert
        parallelism every rank (the EP groups span the DP replicas)."""
        return self.stages.to_first(
            lambda: export_hf(self.module, self.arch, self.tp, self.tp_group, tensor_of, experts=self.experts),
            self.device,
        )

    def _weight_source(self) -> WeightSource:
        # Global rank 0 (a first stage) sends; the other TP ranks of its replica take part in each parameter's TP
        # gather and the later stages send theirs to the first, and with EP > 1 all ranks take part in the
        # experts' gathers (each replica's TP gathers and stages' sends then run in their own groups).
        gathers = self.dp.rank == 0 or self.experts.ep > 1
        return WeightSource(self._export, sends=self.rank == 0, gathers=gathers)

    def save_hf(self, path: str) -> None:
        self._weight_source().read(lambda named: write_hf_checkpoint(named, self.cfg.model_path, path), None)

    # -- checkpoints: Megatron distributed checkpointing -----------------------------------------
    def _sharded_state(self, with_optimizer: bool, is_loading: bool = False) -> dict:
        state = {"model": self.module.sharded_state_dict()}
        if with_optimizer:
            # is_loading: a fresh optimizer has no Adam state yet; Megatron creates it as the load target.
            # Not so the distributed optimizer over torch's Adam (no Apex/TE, as on the CPU): it reads the step
            # count from that state first. Megatron's own zero-gradient dummy step creates it; the load then
            # overwrites the main parameters and Adam state it touched (the step: _restore_adam_steps).
            if is_loading and self.par.distributed_optimizer:
                for opt in self._inner_optimizers():
                    opt._init_optimizer_states_with_dummy_values()
            # The distributed optimizer's default layout (fully_sharded_model_space) builds flattened-range
            # tensors that megatron-core >= 0.16 refuses to save; dp_reshardable, the layout Megatron's own
            # trainer uses, writes each rank's buffer shard as is (DP may change on --load, TP may not).
            # Other optimizers ignore this key.
            state["optimizer"] = self.optimizer.sharded_state_dict(
                state["model"], is_loading=is_loading, metadata={"distrib_optim_sharding_type": "dp_reshardable"}
            )
        return state

    def _inner_optimizers(self) -> list:
        return getattr(self.optimizer, "chained_optimizers", [self.optimizer])

    def _restore_adam_steps(self) -> None:
        """After the distributed optimizer's load, torch Adam's per-parameter steps are wrong twice over: all
        parameters share one step tensor (each optimizer step would add one per parameter), and dp_reshardable
        copied the load target's (the dummy state's) count into it. The checkpoint's count is on each param
        group. (Apex/TE Adam keep the step on the group only: nothing to do.)"""
        for opt in self._inner_optimizers():
            for group in opt.optimizer.param_groups:
                for p in group["params"]:
                    state = opt.optimizer.state.get(p, {})
                    if "step" in state and "step" in group:
                        state["step"] = torch.full_like(state["step"], group["step"])

    def save(self, save_dir: str, rollout_id: int, save_optimizer: bool = True, background: bool = False) -> None:
        """Always written at once: --async-save falls back to synchronous saves on this backend (the FALLBACKS
        row in config/capabilities.py), so the run never asks for ``background``."""
        from megatron.core import dist_checkpointing

        out = iteration_dir(save_dir, rollout_id) / self.cfg.role
        dist_dir = out / "megatron"
        if self.rank == 0:
            shutil.rmtree(dist_dir, ignore_errors=True)
            dist_dir.mkdir(parents=True, exist_ok=True)
        if self.world_size > 1:
            dist.barrier()
        dist_checkpointing.save(self._sharded_state(save_optimizer), str(dist_dir))
        save_rng_state(out, self.rank)
        if self.rank == 0:
            (out / "megatron_meta.json").write_text(
                json.dumps(
                    {
                        "optimizer_steps": self.optimizer_steps,
                        "has_optimizer": save_optimizer,
                        "tp": self.tp,
                        "pp": self.stages.size,
                        "ep": self.experts.ep,
                        "dp": self.dp.size,
                        "distributed_optimizer": self.par.distributed_optimizer,
                        "format": "megatron.core.dist_checkpointing (torch_dist)",
                    }
                )
            )

    def _load(self, load_dir: str, rollout_id: int) -> None:
        from megatron.core import dist_checkpointing

        src = iteration_dir(load_dir, rollout_id) / self.cfg.role
        if not (src / "megatron").is_dir():
            raise RuntimeError(
                f"--load: {src} holds no Megatron checkpoint (folder 'megatron'); a checkpoint of "
                f"--train-backend fsdp cannot be resumed with --train-backend megatron"
            )
        meta = json.loads((src / "megatron_meta.json").read_text())
        layout = {"tp": self.tp, "pp": self.stages.size, "ep": self.experts.ep}
        check_optimizer_layout(meta, layout, self.par.distributed_optimizer, src)
        state = dist_checkpointing.load(
            self._sharded_state(meta["has_optimizer"], is_loading=True), str(src / "megatron")
        )
        self.module.load_state_dict(state["model"])
        if meta["has_optimizer"]:
            # In fp32 the distributed optimizer's main parameters are views of the (grad-requiring) model
            # parameters, which Megatron's dp_reshardable load copies into without turning autograd off.
            with torch.no_grad():
                self.optimizer.load_state_dict(state["optimizer"])
            if self.par.distributed_optimizer:
                self._restore_adam_steps()
        self.optimizer_steps = meta["optimizer_steps"]
        self._set_lr()
        load_rng_state(src, self.rank)

    def hf_state(self) -> dict[str, torch.Tensor]:
        """The whole policy under HF names on the first pipeline stage (tests and tools; every TP rank of every
        stage must call it, with EP every rank)."""
        return {k: v.clone() for k, v in self._export()}

"""The rollout executor: a Ray actor owning the data source, generation, rewards and eval."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import ray

from miles_async.config import EngineConfig, EvalConfig, RolloutConfig, ToolsConfig
from miles_async.inference.router import make_router
from miles_async.rollout.batch import rollout_metrics, to_train_batch
from miles_async.rollout.data_source import DataSource, PromptItem, load_prompts
from miles_async.rollout.dynamic_sampling import DynamicSampler
from miles_async.rollout.eval import evaluate
from miles_async.rollout.filters import BatchAssembler, filter_args, load_group_filter
from miles_async.rollout.fully_async import FullyAsyncProducer
from miles_async.rollout.gc_policy import tune_gc_for_rollouts
from miles_async.rollout.generate import GenerateContext, encode_item, generate_sample
from miles_async.rollout.multi_turn import Toolbox, generate_multi_turn
from miles_async.rollout.rewards import RewardModel
from miles_async.rollout.rollout import RolloutContext, generate_rollout
from miles_async.rollout.routing import RoutingShape
from miles_async.rollout.staleness import StalenessManager
from miles_async.utils.checkpoint import atomic_write_json, iteration_dir
from miles_async.utils.plugins import load_function
from miles_async.utils.tokenizer import load_tokenizer
from miles_async.vision.hf import is_vision_model, load_processor

logger = logging.getLogger(__name__)

STATE_FILE = "rollout_state.json"


def _filter_long_prompts(items: list[PromptItem], tokenizer, processor, cfg: RolloutConfig) -> list[PromptItem]:
    limit = cfg.data.max_prompt_len
    if limit is None:
        return items
    template, kwargs = cfg.data.apply_chat_template, cfg.data.chat_template_kwargs
    kept = [it for it in items if len(encode_item(tokenizer, processor, it, template, kwargs)) <= limit]
    if len(kept) < len(items):
        logger.warning(
            "dropped %d of %d prompts longer than --rollout-max-prompt-len %d",
            len(items) - len(kept),
            len(items),
            limit,
        )
    return kept


class RolloutExecutor:
    def __init__(
        self,
        cfg: RolloutConfig,
        eval_cfg: EvalConfig,
        engine: EngineConfig,
        engine_urls: list[str],
        load_dir: str | None = None,
        load_rollout_id: int | None = None,
        output_dir: str | None = None,
        tools: ToolsConfig | None = None,
    ):
        self.cfg = cfg
        self.eval_cfg = eval_cfg
        # An audit trail of which prompts each rollout trained on (resume and exactly-once checks).
        self.rollout_log = Path(output_dir) / "rollouts.jsonl" if output_dir else None
        self.tokenizer = load_tokenizer(cfg.tokenizer_path)
        # A vision-language model's processor makes image prompts' tokens (the engines and the trainer load it too).
        self.processor = load_processor(cfg.tokenizer_path) if is_vision_model(cfg.tokenizer_path) else None
        ft = engine.fault_tolerance
        # Without fault tolerance the engine set is fixed and nothing is retried, so no cooldown applies.
        retry = {"retry": True, "cooldown": ft.health_check_interval} if ft is not None else {}
        self.router = make_router(
            engine_urls,
            engine.request_timeout,
            kind=engine.router,
            backend=engine.backend,
            api_key=engine.api_key,
            **retry,
        )
        if cfg.data_source_path:
            self.data_source = load_function(cfg.data_source_path, "--data-source-path")(
                cfg.data, cfg.rollout_batch_size
            )
        else:
            d = cfg.data
            items = load_prompts(d.path, d.input_key, d.label_key, d.metadata_key, image_key=d.image_key)
            self.data_source = DataSource(
                d, cfg.rollout_batch_size, _filter_long_prompts(items, self.tokenizer, self.processor, cfg)
            )
        loaded = None
        if load_dir is not None and load_rollout_id is not None:
            loaded = json.loads((iteration_dir(load_dir, load_rollout_id) / STATE_FILE).read_text())
            self.data_source.load_state_dict(loaded["data_source"])
        gen_fn = (
            load_function(cfg.custom_generate_function_path, "--custom-generate-function-path")
            if cfg.custom_generate_function_path
            else generate_multi_turn
            if tools is not None
            else generate_sample
        )
        self.rollout_fn = (
            load_function(cfg.rollout_function_path, "--rollout-function-path")
            if cfg.rollout_function_path
            else generate_rollout
        )
        self.reward = RewardModel(cfg.reward)
        gctx = GenerateContext(
            self.router,
            self.tokenizer,
            Toolbox(tools) if tools is not None else None,
            processor=self.processor,
            template_kwargs=cfg.data.chat_template_kwargs,
            routing=RoutingShape.of_model(cfg.tokenizer_path) if cfg.return_routed_experts else None,
        )
        self.ctx = RolloutContext(
            self.data_source,
            gctx,
            gen_fn,
            self.reward,
            cfg.data.apply_chat_template,
            cfg.n_samples_per_prompt,
            cfg.sampling.to_sglang(),
            asyncio.Semaphore(cfg.max_concurrent_requests),
            partial_rollout=cfg.partial_rollout,
            mask_offpolicy_in_partial_rollout=cfg.mask_offpolicy_in_partial_rollout,
        )
        self.eval_ctx = dataclasses.replace(
            self.ctx, data_source=None, semaphore=asyncio.Semaphore(cfg.max_concurrent_requests)
        )
        # Data-source state just before each rollout drew its prompts: a checkpoint of rollout N
        # is taken while N+1 may already be generating, and must resume by regenerating N+1.
        self._state_before: dict[int, dict] = {}
        # Groups the dynamic-sampling filter kept / dropped over the run, and their values before each rollout.
        self.groups_kept_total = self.groups_dropped_total = 0
        if loaded is not None and "groups_filter_totals" in loaded:
            self.groups_kept_total, self.groups_dropped_total = loaded["groups_filter_totals"]
        self._totals_before: dict[int, list[int]] = {}
        ds = cfg.dynamic_sampling
        group_filter = (
            load_group_filter(ds.filter_path, filter_args(cfg), ds.filter_name)
            if ds is not None and ds.filter_path is not None
            else None
        )
        if ds is not None and cfg.fully_async is None:
            if not (hasattr(self.data_source, "draw") and hasattr(self.data_source, "give_back")):
                raise ValueError(
                    f"{ds.filter_name} needs a data source with draw() and "
                    f"give_back() (the built-in one): --data-source-path {cfg.data_source_path} has none"
                )
            self.ctx.dynamic_sampling = DynamicSampler(
                group_filter, cfg.rollout_batch_size, ds.over_sampling_batch_size
            )
        self.producer = None
        if cfg.fully_async is not None:
            fa = cfg.fully_async
            self.producer = FullyAsyncProducer(
                self.ctx,
                self.data_source,
                StalenessManager(fa.max_concurrent_groups, cfg.rollout_batch_size, fa.max_staleness_steps),
                BatchAssembler(cfg.rollout_batch_size, None, group_filter),
                fa.watchdog_seconds,
                cfg.timeout,
            )
            if loaded is not None:
                if "fully_async" not in loaded:
                    raise ValueError("--load: the checkpoint was not written by a --fully-async run")
                self.producer.load_state_dict(loaded["fully_async"])
        self.eval_datasets = {
            name: load_prompts(
                path,
                eval_cfg.input_key,
                eval_cfg.label_key,
                eval_cfg.metadata_key,
                f"--eval-prompt-data ({name})",
                image_key=eval_cfg.image_key,
            )
            for name, path in eval_cfg.datasets
        }
        # This actor's process holds every sample in flight: keep full collections off the per-sample path.
        tune_gc_for_rollouts()

    async def generate(self, rollout_id: int) -> dict:
        """One-step-off and --synchronous: generate rollout ``rollout_id`` now, with the rollout function.
        The batch stays in the object store, only a ref travels back."""
        if self.producer is not None:
            raise RuntimeError("--fully-async: the producer generates all along; take its batches with drain()")

        async def produce() -> tuple[list, list, dict, tuple]:
            groups = await self.rollout_fn(self.ctx, rollout_id)
            sampler = self.ctx.dynamic_sampling
            if sampler is None:
                return groups, [None] * len(groups), {}, ()
            report = sampler.take_report()
            # A --rollout-function-path may reshape what generate_rollout returned: epochs then are unknown.
            epochs = report.epochs if len(report.epochs) == len(groups) else [None] * len(groups)
            metrics = {"rollout/groups_given_back": report.given_back, "rollout/sampling_rounds": report.rounds}
            return groups, epochs, metrics, tuple(report.dropped)

        return await self._rollout(rollout_id, produce)

    async def drain(self, rollout_id: int) -> dict:
        """--fully-async: the next batch the producer, generating all along, has assembled; as ``generate``."""
        if self.producer is None:
            raise RuntimeError("drain() needs --fully-async (no producer runs); generate() makes each rollout")

        async def produce() -> tuple[list, list, dict, tuple]:
            groups, epochs, metrics = await self.producer.get_batch()
            return groups, epochs, metrics, tuple(self.producer.take_dropped())

        return await self._rollout(rollout_id, produce)

    async def _rollout(self, rollout_id: int, produce: Callable[[], Awaitable[tuple[list, list, dict, tuple]]]) -> dict:
        """Runs ``produce`` (-> groups, each group's epoch, its own metrics, the groups the filter dropped) between
        the bookkeeping both modes share: the data position before the draw (for checkpoints), reward and filter
        counters, the audit log."""
        t0 = time.time()
        errors_before, timeouts_before = self.reward.errors, self.reward.timeouts
        self._state_before[rollout_id] = self.data_source.state_dict()
        self._totals_before[rollout_id] = [self.groups_kept_total, self.groups_dropped_total]
        for old in [k for k in self._state_before if k < rollout_id - 2]:
            del self._state_before[old]
            self._totals_before.pop(old, None)
        groups, epochs, async_metrics, dropped = await produce()
        self.groups_kept_total += len(groups)
        self.groups_dropped_total += len(dropped)
        metrics = {**rollout_metrics(groups), **async_metrics}
        metrics["rollout/reward_errors"] = self.reward.errors - errors_before
        metrics["rollout/reward_timeouts"] = self.reward.timeouts - timeouts_before
        metrics["rollout/generate_seconds"] = time.time() - t0
        metrics["rollout/groups_kept"] = len(groups)
        metrics["rollout/groups_dropped"] = len(dropped)
        metrics["rollout/groups_kept_total"] = self.groups_kept_total
        metrics["rollout/groups_dropped_total"] = self.groups_dropped_total
        if self.rollout_log is not None:
            with self.rollout_log.open("a") as fh:
                fh.write(
                    json.dumps(
                        {
                            "rollout_id": rollout_id,
                            "uids": [g[0].uid for g in groups],
                            "epochs": epochs,
                            "rewards": [[s.reward for s in g] for g in groups],
                            # Consumed for their epoch without being trained: the dynamic-sampling filter dropped them.
                            "dropped_uids": [d.uid for d in dropped],
                            "dropped_epochs": [d.epoch for d in dropped],
                            "dropped_rewards": [d.rewards for d in dropped],
                            "dropped_reasons": [d.reason for d in dropped],
                        }
                    )
                    + "\n"
                )
        return {"data": [ray.put(to_train_batch(groups))], "metrics": metrics}

    async def eval(self, rollout_id: int) -> dict:
        t0 = time.time()
        metrics = await evaluate(self.eval_ctx, self.eval_cfg, self.eval_datasets)
        metrics["eval/seconds"] = time.time() - t0
        metrics["eval/started_at"] = t0
        return metrics

    async def save(self, rollout_id: int, save_dir: str) -> None:
        state = {
            "rollout_id": rollout_id,
            "data_source": self._state_before.get(rollout_id + 1, self.data_source.state_dict()),
            "groups_filter_totals": self._totals_before.get(
                rollout_id + 1, [self.groups_kept_total, self.groups_dropped_total]
            ),
        }
        if self.producer is not None:
            state["fully_async"] = self.producer.state_dict(trained_steps=rollout_id + 1)
        atomic_write_json(iteration_dir(save_dir, rollout_id) / STATE_FILE, state)

    def on_step(self, step: int) -> None:
        """The trainer finished ``step`` steps and the engines serve those weights."""
        if self.producer is not None:
            self.producer.on_step(step)

    async def set_engines(self, urls: list[str], fatal: str | None = None) -> None:
        """The inference controller changed the engines that may take requests (--use-fault-tolerance)."""
        await self.router.set_engines(urls, fatal)

    def router_retries(self) -> int:
        return self.router.retries

    async def dispose(self) -> None:
        if self.producer is not None:
            await self.producer.stop()
        await self.router.close()
        await self.reward.close()
        if self.ctx.generate_ctx.tools is not None:
            self.ctx.generate_ctx.tools.close()  # kills the workers of samples still in flight

    def pid(self) -> int:
        return os.getpid()

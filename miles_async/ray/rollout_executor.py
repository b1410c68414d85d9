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

from miles_async.config import EngineConfig, EvalConfig, RolloutConfig
from miles_async.inference.router import make_router
from miles_async.rollout.batch import rollout_metrics, to_train_batch
from miles_async.rollout.data_source import DataSource, PromptItem, load_prompts
from miles_async.rollout.eval import evaluate
from miles_async.rollout.filters import BatchAssembler
from miles_async.rollout.fully_async import FullyAsyncProducer
from miles_async.rollout.generate import GenerateContext, encode_prompt, generate_sample
from miles_async.rollout.rewards import RewardModel
from miles_async.rollout.rollout import RolloutContext, generate_rollout
from miles_async.rollout.staleness import StalenessManager
from miles_async.utils.checkpoint import atomic_write_json, iteration_dir
from miles_async.utils.plugins import load_function

logger = logging.getLogger(__name__)

STATE_FILE = "rollout_state.json"


def _filter_long_prompts(items: list[PromptItem], tokenizer, cfg: RolloutConfig) -> list[PromptItem]:
    limit = cfg.data.max_prompt_len
    if limit is None:
        return items
    kept = [it for it in items if len(encode_prompt(tokenizer, it.prompt, cfg.data.apply_chat_template)) <= limit]
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
    ):
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.eval_cfg = eval_cfg
        # An audit trail of which prompts each rollout trained on (resume and exactly-once checks).
        self.rollout_log = Path(output_dir) / "rollouts.jsonl" if output_dir else None
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_path)
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
            items = load_prompts(cfg.data.path, cfg.data.input_key, cfg.data.label_key, cfg.data.metadata_key)
            self.data_source = DataSource(
                cfg.data, cfg.rollout_batch_size, _filter_long_prompts(items, self.tokenizer, cfg)
            )
        loaded = None
        if load_dir is not None and load_rollout_id is not None:
            loaded = json.loads((iteration_dir(load_dir, load_rollout_id) / STATE_FILE).read_text())
            self.data_source.load_state_dict(loaded["data_source"])
        gen_fn = (
            load_function(cfg.custom_generate_function_path, "--custom-generate-function-path")
            if cfg.custom_generate_function_path
            else generate_sample
        )
        self.rollout_fn = (
            load_function(cfg.rollout_function_path, "--rollout-function-path")
            if cfg.rollout_function_path
            else generate_rollout
        )
        self.reward = RewardModel(cfg.reward)
        gctx = GenerateContext(self.router, self.tokenizer)
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
        self.producer = None
        if cfg.fully_async is not None:
            fa = cfg.fully_async
            self.producer = FullyAsyncProducer(
                self.ctx,
                self.data_source,
                StalenessManager(fa.max_concurrent_groups, cfg.rollout_batch_size, fa.max_staleness_steps),
                BatchAssembler(cfg.rollout_batch_size, fa.zero_variance_tol if fa.zero_variance_filter else None),
                fa.watchdog_seconds,
                cfg.timeout,
            )
            if loaded is not None:
                if "fully_async" not in loaded:
                    raise ValueError("--load: the checkpoint was not written by a --fully-async run")
                self.producer.load_state_dict(loaded["fully_async"])
        self.eval_datasets = {
            name: load_prompts(path, eval_cfg.input_key, eval_cfg.label_key, flag=f"--eval-prompt-data ({name})")
            for name, path in eval_cfg.datasets
        }

    async def generate(self, rollout_id: int) -> dict:
        """One-step-off and --synchronous: generate rollout ``rollout_id`` now, with the rollout function.
        The batch stays in the object store, only a ref travels back."""
        if self.producer is not None:
            raise RuntimeError("--fully-async: the producer generates all along; take its batches with drain()")

        async def produce() -> tuple[list, list, dict]:
            groups = await self.rollout_fn(self.ctx, rollout_id)
            return groups, [None] * len(groups), {}

        return await self._rollout(rollout_id, produce)

    async def drain(self, rollout_id: int) -> dict:
        """--fully-async: the next batch the producer, generating all along, has assembled; as ``generate``."""
        if self.producer is None:
            raise RuntimeError("drain() needs --fully-async (no producer runs); generate() makes each rollout")
        return await self._rollout(rollout_id, self.producer.get_batch)

    async def _rollout(self, rollout_id: int, produce: Callable[[], Awaitable[tuple[list, list, dict]]]) -> dict:
        """Runs ``produce`` (-> groups, each group's epoch, its own metrics) between the bookkeeping both modes
        share: the data position before the draw (for checkpoints), reward counters, the audit log."""
        t0 = time.time()
        errors_before, timeouts_before = self.reward.errors, self.reward.timeouts
        self._state_before[rollout_id] = self.data_source.state_dict()
        for old in [k for k in self._state_before if k < rollout_id - 2]:
            del self._state_before[old]
        groups, epochs, async_metrics = await produce()
        metrics = {**rollout_metrics(groups), **async_metrics}
        metrics["rollout/reward_errors"] = self.reward.errors - errors_before
        metrics["rollout/reward_timeouts"] = self.reward.timeouts - timeouts_before
        metrics["rollout/generate_seconds"] = time.time() - t0
        if self.rollout_log is not None:
            with self.rollout_log.open("a") as fh:
                fh.write(
                    json.dumps(
                        {
                            "rollout_id": rollout_id,
                            "uids": [g[0].uid for g in groups],
                            "epochs": epochs,
                            "rewards": [[s.reward for s in g] for g in groups],
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

    def pid(self) -> int:
        return os.getpid()

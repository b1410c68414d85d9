"""The rollout executor as a real Ray actor against a real engine, with every plugin point."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import ray

from miles_async.arguments import parse_args
from miles_async.inference.embedded.launcher import EmbeddedEngineProcess
from miles_async.ray.rollout_executor import RolloutExecutor
from miles_async.utils.checkpoint import iteration_dir


def _cfg(tiny_model, tiny_task, tmp_path, *extra):
    train, held_out = tiny_task
    return parse_args(
        [
            "--use-tis",
            "--hf-checkpoint",
            str(tiny_model),
            "--prompt-data",
            str(train),
            "--rollout-batch-size",
            "3",
            "--n-samples-per-prompt",
            "2",
            "--num-rollout",
            "4",
            "--apply-chat-template",
            "--rollout-max-response-len",
            "3",
            "--rollout-dtype",
            "float32",
            "--eval-prompt-data",
            "held",
            str(held_out),
            "--output-dir",
            str(tmp_path),
            *extra,
        ]
    )


@pytest.fixture(scope="module")
def engine(tiny_model, tiny_task, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine")
    with EmbeddedEngineProcess(_cfg(tiny_model, tiny_task, tmp, "--rm-type", "integer").engine, 0, str(tmp)) as proc:
        yield proc


def _executor(cfg, engine):
    """An executor of ``cfg``'s run on ``engine``, whose key it sends."""
    engine_cfg = replace(cfg.engine, request_timeout=60.0, api_key=engine.cfg.api_key)
    return ray.remote(RolloutExecutor).remote(
        cfg.rollout, cfg.eval, engine_cfg, [engine.url], None, None, cfg.tracking.output_dir
    )


def test_default_rollout_returns_a_batch_ref_and_metrics(shared_ray, engine, tiny_model, tiny_task, tmp_path):
    cfg = _cfg(tiny_model, tiny_task, tmp_path, "--rm-type", "first_integer")
    ex = _executor(cfg, engine)
    out = ray.get(ex.generate.remote(0))
    batch = ray.get(out["data"][0])
    assert len(batch.tokens) == 6 and batch.group_index == [0, 0, 1, 1, 2, 2]
    for toks, p, r, lp, wv in zip(
        batch.tokens,
        batch.prompt_lengths,
        batch.response_lengths,
        batch.rollout_logprobs,
        batch.weight_versions,
    ):
        assert len(toks) == p + r and len(lp) == r and wv == [0] * r
    assert out["metrics"]["rollout/num_samples"] == 6
    assert out["metrics"]["rollout/started_at"] <= out["metrics"]["rollout/finished_at"]
    evals = ray.get(ex.eval.remote(0))
    assert evals["eval/held/num_samples"] == 16
    # checkpointed state is the data position *before* the next rollout's draw
    ray.get(ex.generate.remote(1))
    ray.get(ex.save.remote(0, str(tmp_path / "ckpt")))
    state = json.loads((iteration_dir(tmp_path / "ckpt", 0) / "rollout_state.json").read_text())
    assert state["data_source"]["offset"] == 3
    log = [json.loads(x) for x in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert [r["rollout_id"] for r in log] == [0, 1] and len(log[0]["uids"]) == 3


def test_every_plugin_point(shared_ray, engine, tiny_model, tiny_task, tmp_path):
    cfg = _cfg(
        tiny_model,
        tiny_task,
        tmp_path,
        "--custom-rm-path",
        "tests.integration.plugins:label_reward",
        "--custom-generate-function-path",
        "tests.integration.plugins:tagged_generate",
        "--rollout-function-path",
        "tests.integration.plugins:doubling_rollout",
        "--data-source-path",
        "tests.integration.plugins.CountingSource",
    )
    ex = _executor(cfg, engine)
    out = ray.get(ex.generate.remote(0))
    batch = ray.get(out["data"][0])
    assert batch.uids[::2] == ["c0", "c1", "c2", "c3", "c4", "c5"]  # two draws from the custom source
    assert batch.response_lengths == [1] * 12  # the custom generate function ran
    assert batch.rewards == [1.0] * 12  # and so did the custom reward, seeing its trace


def test_reward_error_policy_zero_counts(shared_ray, engine, tiny_model, tiny_task, tmp_path):
    cfg = _cfg(
        tiny_model,
        tiny_task,
        tmp_path,
        "--custom-rm-path",
        "tests.e2e.rewards:always_fails",
        "--reward-on-error",
        "zero",
    )
    out = ray.get(_executor(cfg, engine).generate.remote(0))
    assert out["metrics"]["rollout/reward_errors"] == 6
    assert ray.get(out["data"][0]).rewards == [0.0] * 6


def test_fully_async_batches_are_drained_and_each_mode_refuses_the_other(
    shared_ray, engine, tiny_model, tiny_task, tmp_path
):
    """--fully-async: the producer generates on its own and ``drain`` takes its batches; ``generate`` would
    draw prompts beside it and is refused. Without it no producer runs, so ``drain`` is refused."""
    cfg = _cfg(tiny_model, tiny_task, tmp_path, "--rm-type", "first_integer", "--fully-async")
    ex = _executor(cfg, engine)
    try:
        out = ray.get(ex.drain.remote(0), timeout=120)
        batch = ray.get(out["data"][0])
        assert len(batch.tokens) == 6 and len(set(batch.group_index)) == 3  # one batch: 3 groups of 2
        assert out["metrics"]["async/staleness_max"] == 0  # the producer's own metrics; no update yet
        log = [json.loads(x) for x in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
        assert log[0]["rollout_id"] == 0 and log[0]["epochs"] == [0, 0, 0]
        with pytest.raises(ray.exceptions.RayTaskError, match="take its batches with drain"):
            ray.get(ex.generate.remote(1), timeout=60)
    finally:
        ray.get(ex.dispose.remote(), timeout=60)
    one_step_off = _executor(_cfg(tiny_model, tiny_task, tmp_path, "--rm-type", "first_integer"), engine)
    with pytest.raises(ray.exceptions.RayTaskError, match="drain\\(\\) needs --fully-async"):
        ray.get(one_step_off.drain.remote(0), timeout=60)


def test_a_fully_async_filter_that_keeps_nothing_fails_naming_it(shared_ray, engine, tiny_model, tiny_task, tmp_path):
    """Every reward 0 under --zero-variance-filter: each group is dropped, and after a full pass over the 64 prompts
    the producer stops, naming the filter, long before --rollout-timeout. (The one-step-off loop's refusal, and a
    fully-async producer's error ending the run, are end-to-end tests: tests/e2e/test_dynamic_sampling.py,
    test_fully_async.py::test_producer_failure_surfaces_fast.)"""
    cfg = _cfg(
        tiny_model, tiny_task, tmp_path, "--custom-rm-path", "tests.e2e.rewards:always_zero",
        "--zero-variance-filter", "--fully-async", "--rollout-timeout", "600",
    )  # fmt: skip
    ex = _executor(cfg, engine)
    try:
        with pytest.raises(
            ray.exceptions.RayTaskError,
            match=r"--zero-variance-filter dropped \d+ groups in a row, at least a full pass over the 64 prompts",
        ):
            ray.get(ex.drain.remote(0), timeout=120)
    finally:
        ray.get(ex.dispose.remote(), timeout=60)

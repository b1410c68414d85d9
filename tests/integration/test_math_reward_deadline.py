"""--rm-type math inside the real rollout executor actor: a pathological answer is cut off at the deadline.

math-verify's own timeouts need the main thread, which an async Ray actor's code never runs on; the
answer ``9^{9^{9}}`` (a 370-million-digit power) then used to hold the executor for hours.
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import ray

from miles_async.arguments import parse_args
from miles_async.inference.embedded.launcher import EmbeddedEngineProcess
from miles_async.ray.rollout_executor import RolloutExecutor
from miles_async.rollout.generate import generate_sample
from miles_async.rollout.rewards import MATH_VERIFY_DEADLINE_S

PATHOLOGICAL = "so the answer is $\\boxed{9^{9^{9}}}$"


async def answers(ctx, sample, sampling_params):
    """Generates for real, then answers: the first sample of the first prompt with a tower of powers
    that math-verify cannot settle, every other sample with the right answer."""
    sample = await generate_sample(ctx, sample, sampling_params)
    first = sample.group_index == 0 and sample.index == 0
    sample.response = PATHOLOGICAL if first else f"the answer is $\\boxed{{{sample.label}}}$"
    return sample


def _cfg(tiny_model, tiny_task, tmp_path):
    train, _ = tiny_task
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
            "2",
            "--apply-chat-template",
            "--rollout-max-response-len",
            "2",
            "--rollout-dtype",
            "float32",
            "--rm-type",
            "math",
            "--custom-generate-function-path",
            "tests.integration.test_math_reward_deadline:answers",
            "--output-dir",
            str(tmp_path),
        ]
    )


def _executor(cfg, engine):
    """An executor of ``cfg``'s run on ``engine``, whose key it sends."""
    engine_cfg = replace(cfg.engine, request_timeout=60.0, api_key=engine.cfg.api_key)
    return ray.remote(RolloutExecutor).remote(
        cfg.rollout, cfg.eval, engine_cfg, [engine.url], None, None, cfg.tracking.output_dir
    )


@pytest.fixture(scope="module")
def engine(tiny_model, tiny_task, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine")
    with EmbeddedEngineProcess(_cfg(tiny_model, tiny_task, tmp).engine, 0, str(tmp)) as proc:
        yield proc


def test_pathological_answer_scores_zero_at_the_deadline_and_the_rollout_goes_on(
    shared_ray, engine, tiny_model, tiny_task, tmp_path
):
    ex = _executor(_cfg(tiny_model, tiny_task, tmp_path), engine)
    for rollout_id in range(2):  # the second rollout runs on a worker that replaced the killed one
        t0 = time.monotonic()
        out = ray.get(ex.generate.remote(rollout_id), timeout=MATH_VERIFY_DEADLINE_S + 90)
        assert time.monotonic() - t0 >= MATH_VERIFY_DEADLINE_S  # it was really cut off, not settled
        assert out["metrics"]["rollout/reward_timeouts"] == 1
        assert out["metrics"]["rollout/reward_errors"] == 0
        assert ray.get(out["data"][0]).rewards == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0]

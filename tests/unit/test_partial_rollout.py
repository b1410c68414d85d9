"""Partial rollouts without an engine: resuming aborted samples, budgets, off-policy masking, flags."""

from __future__ import annotations

import asyncio

import pytest

from miles_async.arguments import ConfigError, parse_args
from miles_async.rollout.batch import rollout_metrics, to_train_batch
from miles_async.rollout.generate import (
    GenerateContext,
    apply_engine_output,
    continuation_request,
    generate_sample,
)
from miles_async.rollout.rollout import MAX_ABORT_RETRIES, RolloutContext, generate_one
from miles_async.rollout.sample import Sample, SampleStatus
from tests.flag_helpers import minimal_flags

PROMPT = [1, 2, 3]


def engine_output(tokens: list[int], version: int, finish: str, text: str | None = None) -> dict:
    """An SGLang-shaped /generate response as the embedded server writes it."""
    return {
        "text": text if text is not None else "".join(chr(ord("a") + t % 26) for t in tokens),
        "output_ids": tokens,
        "meta_info": {
            "finish_reason": {"type": finish},
            "weight_version": version,
            "output_token_weight_versions": [version] * len(tokens),
            "output_token_logprobs": [[-0.1 * (t + 1), t, None] for t in tokens],
        },
    }


class ScriptedRouter:
    """Answers /generate calls from a script and records each request."""

    def __init__(self, outputs: list[dict]):
        self.outputs = list(outputs)
        self.calls: list[tuple[list[int], dict]] = []

    async def generate(self, input_ids: list[int], sampling_params: dict, return_logprob: bool = True) -> dict:
        self.calls.append((list(input_ids), dict(sampling_params)))
        return self.outputs.pop(0)


class LetterTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + t % 26) for t in ids)


class ZeroReward:
    async def score(self, sample: Sample) -> float:
        return 0.0


def new_sample() -> Sample:
    return Sample(uid="u", group_index=0, index=0, prompt="p", prompt_tokens=list(PROMPT))


def aborted_sample(tokens: list[int], version: int = 0) -> Sample:
    s = new_sample()
    apply_engine_output(s, engine_output(tokens, version, "abort"))
    return s


def rollout_ctx(router: ScriptedRouter, partial: bool, mask: bool = False) -> RolloutContext:
    return RolloutContext(
        data_source=None,
        generate_ctx=GenerateContext(router, LetterTokenizer()),
        generate_fn=generate_sample,
        reward=ZeroReward(),
        apply_chat_template=False,
        n_samples_per_prompt=1,
        sampling_params={},
        semaphore=asyncio.Semaphore(4),
        partial_rollout=partial,
        mask_offpolicy_in_partial_rollout=mask,
    )


# -- appending outputs ------------------------------------------------------------------


def test_apply_engine_output_replaces_by_default():
    s = aborted_sample([10, 11])
    apply_engine_output(s, engine_output([20], 1, "stop"))
    assert s.response_tokens == [20] and s.weight_versions == [1] and len(s.rollout_logprobs) == 1
    assert s.status == SampleStatus.COMPLETED


def test_apply_engine_output_appends_a_continuation():
    s = aborted_sample([10, 11, 12])
    apply_engine_output(s, engine_output([13, 14], 1, "length"), append=True)
    assert s.response_tokens == [10, 11, 12, 13, 14]
    assert s.weight_versions == [0, 0, 0, 1, 1]
    assert s.rollout_logprobs == pytest.approx([-0.1 * (t + 1) for t in [10, 11, 12, 13, 14]])
    assert s.tokens == PROMPT + [10, 11, 12, 13, 14]
    assert s.status == SampleStatus.TRUNCATED


def test_append_keeps_an_explicit_loss_mask_aligned():
    s = aborted_sample([10, 11])
    s.loss_mask = [0, 1]
    s.append_output([12, 13], [-1.0, -1.0], [1, 1])
    assert s.loss_mask == [0, 1, 1, 1]


def test_append_refuses_misaligned_columns():
    with pytest.raises(ValueError, match="2 tokens came with 1 log-probs"):
        new_sample().append_output([1, 2], [-1.0], [0, 0])


# -- remaining budget -------------------------------------------------------------------


def test_continuation_request_sends_the_tokens_so_far_and_the_remaining_budget():
    s = aborted_sample([10, 11, 12])
    params = {"temperature": 1.0, "max_new_tokens": 10, "min_new_tokens": 5}
    input_ids, resumed = continuation_request(s, params)
    assert input_ids == PROMPT + [10, 11, 12]
    assert resumed == {"temperature": 1.0, "max_new_tokens": 7, "min_new_tokens": 2}
    assert params["max_new_tokens"] == 10  # the caller's params are shared by every sample


def test_min_new_tokens_never_goes_negative():
    _, resumed = continuation_request(aborted_sample([10, 11, 12]), {"max_new_tokens": 10, "min_new_tokens": 2})
    assert resumed["min_new_tokens"] == 0


def test_spent_budget_has_no_request():
    assert continuation_request(aborted_sample([10, 11]), {"max_new_tokens": 2}) is None
    assert aborted_sample([10, 11]).remaining_budget(1) == 0


def test_continuation_needs_an_explicit_budget():
    with pytest.raises(ValueError, match="max_new_tokens"):
        continuation_request(aborted_sample([10]), {"temperature": 1.0})


def test_generate_sample_resumes_an_aborted_sample():
    router = ScriptedRouter([engine_output([13, 14], 1, "length", text="IGNORED")])
    s = aborted_sample([10, 11, 12])
    s.started_at = 5.0
    asyncio.run(generate_sample(GenerateContext(router, LetterTokenizer()), s, {"max_new_tokens": 5}))
    assert router.calls == [(PROMPT + [10, 11, 12], {"max_new_tokens": 2})]
    assert s.response_tokens == [10, 11, 12, 13, 14] and s.status == SampleStatus.TRUNCATED
    assert s.started_at == 5.0  # a resumed sample keeps its first start time
    assert s.response == LetterTokenizer().decode([10, 11, 12, 13, 14])  # decoded whole, not glued


def test_generate_sample_finishes_a_spent_sample_without_a_request():
    router = ScriptedRouter([])
    s = aborted_sample([10, 11, 12])
    asyncio.run(generate_sample(GenerateContext(router, None), s, {"max_new_tokens": 3}))
    assert router.calls == [] and s.status == SampleStatus.TRUNCATED and s.response_length == 3


# -- the rollout driver -----------------------------------------------------------------


def test_partial_rollout_resumes_across_several_aborts():
    router = ScriptedRouter(
        [
            engine_output([10, 11], 0, "abort"),
            engine_output([12], 1, "abort"),
            engine_output([], 2, "abort"),
            engine_output([13, 14, 15], 2, "length"),
        ]
    )
    s = asyncio.run(generate_one(rollout_ctx(router, partial=True), new_sample(), {"max_new_tokens": 6}))
    assert [c[1]["max_new_tokens"] for c in router.calls] == [6, 4, 3, 3]
    assert router.calls[-1][0] == PROMPT + [10, 11, 12]
    assert s.response_tokens == [10, 11, 12, 13, 14, 15] and s.weight_versions == [0, 0, 1, 2, 2, 2]
    assert s.status == SampleStatus.TRUNCATED and s.partial_resumes == 3
    assert s.loss_mask is None and s.reward == 0.0  # no masking asked for


def test_partial_rollout_is_not_bounded_while_it_progresses():
    aborts = [engine_output([10 + i], i, "abort") for i in range(MAX_ABORT_RETRIES + 3)]
    router = ScriptedRouter(aborts + [engine_output([99], 9, "stop")])
    s = asyncio.run(generate_one(rollout_ctx(router, partial=True), new_sample(), {"max_new_tokens": 100}))
    assert s.status == SampleStatus.COMPLETED and s.response_length == MAX_ABORT_RETRIES + 4


def test_partial_rollout_fails_after_aborts_without_progress():
    router = ScriptedRouter([engine_output([10], 0, "abort")] + [engine_output([], 0, "abort")] * 10)
    with pytest.raises(RuntimeError, match=f"aborted {MAX_ABORT_RETRIES + 1} times in a row without"):
        asyncio.run(generate_one(rollout_ctx(router, partial=True), new_sample(), {"max_new_tokens": 100}))


def test_the_drivers_counters_leave_the_datasets_metadata_alone():
    user = {"partial_resumes": "the dataset's", "offpolicy_masked_tokens": ["also", "the dataset's"]}
    s = new_sample()
    s.metadata = dict(user)
    router = ScriptedRouter([engine_output([10, 11], 0, "abort"), engine_output([12, 13], 1, "stop")])
    s = asyncio.run(generate_one(rollout_ctx(router, partial=True, mask=True), s, {"max_new_tokens": 8}))
    assert s.metadata == user
    m = rollout_metrics([[s]])
    assert (m["rollout/partial_resumed_samples"], m["rollout/offpolicy_masked_tokens"]) == (1, 2)


def test_abort_before_any_token_is_a_retry_not_a_resume():
    router = ScriptedRouter([engine_output([], 0, "abort"), engine_output([10], 1, "stop")])
    s = asyncio.run(generate_one(rollout_ctx(router, partial=True), new_sample(), {"max_new_tokens": 4}))
    assert s.response_tokens == [10] and s.partial_resumes == 0


def test_without_partial_rollout_an_aborted_sample_is_regenerated():
    router = ScriptedRouter([engine_output([10, 11], 0, "abort"), engine_output([20, 21, 22], 1, "stop")])
    s = asyncio.run(generate_one(rollout_ctx(router, partial=False), new_sample(), {"max_new_tokens": 8}))
    assert router.calls == [(PROMPT, {"max_new_tokens": 8})] * 2
    assert s.response_tokens == [20, 21, 22] and s.weight_versions == [1, 1, 1]
    assert s.response == "uvw" and s.partial_resumes == 0


def test_without_partial_rollout_retries_are_bounded():
    router = ScriptedRouter([engine_output([10], 0, "abort")] * 10)
    with pytest.raises(RuntimeError, match=f"aborted {MAX_ABORT_RETRIES + 1} times in a row"):
        asyncio.run(generate_one(rollout_ctx(router, partial=False), new_sample(), {"max_new_tokens": 8}))


def test_driver_masks_offpolicy_tokens_when_asked():
    router = ScriptedRouter([engine_output([10, 11], 0, "abort"), engine_output([12, 13], 1, "stop")])
    s = asyncio.run(generate_one(rollout_ctx(router, partial=True, mask=True), new_sample(), {"max_new_tokens": 8}))
    assert s.loss_mask == [0, 0, 1, 1] and s.offpolicy_masked_tokens == 2


# -- masking off-policy tokens ----------------------------------------------------------


def test_mask_zeroes_tokens_older_than_the_newest_version():
    s = new_sample()
    s.response_tokens, s.weight_versions = [1, 2, 3, 4, 5], [3, 3, 4, 5, 5]
    assert s.mask_offpolicy_tokens() == 3
    assert s.loss_mask == [0, 0, 0, 1, 1]


def test_mask_keeps_existing_zeros_and_counts_only_new_ones():
    s = new_sample()
    s.response_tokens, s.weight_versions, s.loss_mask = [1, 2, 3, 4], [0, 0, 1, 1], [0, 1, 0, 1]
    assert s.mask_offpolicy_tokens() == 1
    assert s.loss_mask == [0, 0, 0, 1]


def test_single_version_sample_is_fully_trained():
    s = new_sample()
    s.response_tokens, s.weight_versions = [1, 2], [7, 7]
    assert s.mask_offpolicy_tokens() == 0 and s.loss_mask == [1, 1]


def test_mask_without_versions_is_a_no_op_and_misalignment_is_refused():
    s = new_sample()
    s.response_tokens = [1, 2]
    assert s.mask_offpolicy_tokens() == 0 and s.loss_mask is None
    s.weight_versions = [0]
    with pytest.raises(ValueError, match="1 weight versions for 2 response tokens"):
        s.mask_offpolicy_tokens()


def test_batch_and_metrics_carry_the_mask_and_the_counts():
    resumed = new_sample()
    resumed.response_tokens, resumed.weight_versions = [1, 2, 3], [0, 1, 1]
    resumed.rollout_logprobs, resumed.reward = [-1.0] * 3, 1.0
    resumed.partial_resumes = 2
    resumed.offpolicy_masked_tokens = resumed.mask_offpolicy_tokens()
    fresh = new_sample()
    fresh.response_tokens, fresh.weight_versions, fresh.rollout_logprobs, fresh.reward = [4], [1], [-1.0], 0.0
    groups = [[resumed, fresh]]
    assert to_train_batch(groups).loss_masks == [[0, 1, 1], [1]]
    m = rollout_metrics(groups)
    assert m["rollout/partial_resumed_samples"] == 1
    assert m["rollout/offpolicy_masked_tokens"] == 1


def test_metrics_are_zero_without_partial_rollouts():
    s = new_sample()
    s.response_tokens, s.weight_versions, s.reward = [1], [0], 0.0
    m = rollout_metrics([[s]])
    assert m["rollout/partial_resumed_samples"] == 0 and m["rollout/offpolicy_masked_tokens"] == 0


# -- flags ------------------------------------------------------------------------------


@pytest.fixture
def base_args(tmp_path):
    return [*minimal_flags(tmp_path, n_prompts=8), "--num-rollout", "2"]


def test_flags_default_off(base_args):
    cfg = parse_args(base_args)
    assert not cfg.rollout.partial_rollout and not cfg.rollout.mask_offpolicy_in_partial_rollout


def test_flags_reach_the_rollout_config(base_args):
    cfg = parse_args(
        base_args + ["--partial-rollout", "--mask-offpolicy-in-partial-rollout", "--pause-generation-mode", "abort"]
    )
    assert cfg.rollout.partial_rollout and cfg.rollout.mask_offpolicy_in_partial_rollout
    assert parse_args(base_args + ["--partial-rollout"]).rollout.mask_offpolicy_in_partial_rollout is False


def test_masking_without_partial_rollout_fails_fast(base_args):
    with pytest.raises(ConfigError, match="--mask-offpolicy-in-partial-rollout needs --partial-rollout"):
        parse_args(base_args + ["--mask-offpolicy-in-partial-rollout"])

"""A sample's routing record (rollout/routing.py) across the requests that build it: a fresh generation, a resumed
partial rollout and a multi-turn conversation with tool tokens between turns, each request asking only for the
positions not recorded yet; and the errors that name the sample when an answer does not line the record up."""

from __future__ import annotations

import numpy as np
import pytest

from miles_async.inference.routed_experts import encode
from miles_async.rollout import routing
from miles_async.rollout.routing import RoutingShape
from miles_async.rollout.sample import Sample

SHAPE = RoutingShape(num_layers=3, topk=2)


def _rows(start: int, stop: int) -> np.ndarray:
    """What an engine answers for positions [start, stop): a different, recognisable record at each position."""
    pos = np.arange(start, stop, dtype=np.int32)[:, None, None]
    return pos * 10 + np.arange(SHAPE.num_layers)[None, :, None] + np.zeros((1, 1, SHAPE.topk), dtype=np.int32)


def _answer(sample: Sample, new_tokens: list[int]) -> dict:
    """The engine's answer to ``request_fields`` for a request whose input is the sample's tokens."""
    start = routing.request_fields(sample)["routed_experts_start_len"]
    end = len(sample.tokens) + len(new_tokens) - 1
    return {"output_ids": new_tokens, "meta_info": {"routed_experts": encode(_rows(start, end))}}


def test_the_record_grows_request_by_request_to_every_position_but_the_last():
    sample = Sample(uid="u", group_index=0, index=0, prompt="", prompt_tokens=[1, 2, 3])
    assert routing.request_fields(sample) == {"return_routed_experts": True, "routed_experts_start_len": 0}

    # A first generation aborted after two tokens (a partial rollout), then resumed from its tokens.
    out = _answer(sample, [4, 5])
    sample.response_tokens += out["output_ids"]
    routing.record(sample, out, SHAPE)
    assert sample.routed_experts.shape == (4, 3, 2)
    assert routing.request_fields(sample)["routed_experts_start_len"] == 4
    out = _answer(sample, [6, 7])
    sample.response_tokens += out["output_ids"]
    routing.record(sample, out, SHAPE)

    # A tool's tokens, then the next turn: the request runs them through the model and records them.
    sample.response_tokens += [8, 9, 10]
    out = _answer(sample, [11])
    sample.response_tokens += out["output_ids"]
    routing.record(sample, out, SHAPE)

    assert len(sample.tokens) == 11
    np.testing.assert_array_equal(sample.routed_experts, _rows(0, 10))


def test_an_aborted_request_may_leave_the_record_short_and_its_resume_records_the_rest():
    from miles_async.rollout.sample import SampleStatus

    sample = Sample(uid="u", group_index=0, index=0, prompt="", prompt_tokens=[1, 2, 3])
    # Aborted while waiting for its prefill: no token, no routing.
    sample.status = SampleStatus.ABORTED
    routing.record(sample, {"meta_info": {"routed_experts": encode(_rows(0, 0))}}, SHAPE)
    assert len(sample.routed_experts) == 0 and routing.request_fields(sample)["routed_experts_start_len"] == 0
    sample.status = SampleStatus.COMPLETED
    out = _answer(sample, [4, 5])
    sample.response_tokens += out["output_ids"]
    routing.record(sample, out, SHAPE)
    np.testing.assert_array_equal(sample.routed_experts, _rows(0, 4))


def test_an_answer_that_does_not_line_the_record_up_is_an_error_naming_the_sample():
    sample = Sample(uid="u7", group_index=0, index=0, prompt="", prompt_tokens=[1, 2, 3], response_tokens=[4])
    with pytest.raises(RuntimeError, match="no routed_experts for sample uid=u7.*--enable-return-routed-experts"):
        routing.record(sample, {"meta_info": {}}, SHAPE)
    with pytest.raises(RuntimeError, match="uid=u7 has a routing record of 2 positions .* for 3"):
        routing.record(sample, {"meta_info": {"routed_experts": encode(_rows(0, 2))}}, SHAPE)
    with pytest.raises(ValueError, match="not a whole number of rows"):
        routing.record(sample, {"meta_info": {"routed_experts": encode(_rows(0, 3))}}, RoutingShape(4, 2))


def test_routing_shape_comes_from_the_text_model_config(tmp_path):
    (tmp_path / "config.json").write_text('{"text_config": {"num_hidden_layers": 48, "num_experts_per_tok": 8}}')
    assert RoutingShape.of_model(str(tmp_path)) == RoutingShape(48, 8)

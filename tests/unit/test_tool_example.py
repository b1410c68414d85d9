"""The tool-calculator example's parts: the calculator evaluates + - * on integers and refuses everything else
without running it; the reward scores only the final assistant turn, on responses built the way multi-turn
generation builds them (the model's tokens, the template's tool segment, decoded with special tokens skipped);
the data module splits train and eval on the operand pair."""

from __future__ import annotations

import json

import pytest

from examples.tool_calculator import data, reward, tools
from miles_async.algorithms.reward_types import integer_reward
from miles_async.config import SandboxConfig
from miles_async.rollout.batch import rollout_metrics, tool_call_frac
from miles_async.rollout.multi_turn import tool_messages, tool_segment_text
from miles_async.rollout.sample import Sample
from miles_async.rollout.tools import ToolRunner, load_tools, parse_tool_calls
from tests.multi_turn_helpers import CHATML_TEMPLATE, build_tokenizer


@pytest.mark.parametrize(
    ("expression", "value"),
    [("123 * 45", "5535"), (" 2 + 3*4 ", "14"), ("(2 + 3) * 4", "20"), ("-7 - -3", "-4"), ("10 - 25", "-15")],
)
def test_calculator_evaluates_integer_arithmetic(expression, value):
    assert tools.calculator(expression) == value


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("__import__('os').system('touch /tmp/pwned')", "unsupported syntax"),
        ("open('/etc/passwd').read()", "unsupported syntax"),
        ("x * 2", "unsupported syntax"),
        ("2 ** 10", "unsupported syntax"),
        ("7 / 2", "unsupported syntax"),
        ("1.5 * 2", "unsupported syntax"),
        ("True + 1", "unsupported syntax"),
        ("1 +", "cannot parse"),
        ("9" * 30 + " * " + "9" * 30, "more than 40 digits"),
        ("1+" * 150 + "1", "longer than 200"),
    ],
)
def test_calculator_refuses_anything_but_integer_arithmetic(expression, message):
    with pytest.raises(ValueError, match=message):
        tools.calculator(expression)


def test_the_registry_runs_in_a_real_tool_worker():
    """The path run.sh gives --tools-path loads, and a call the model writes runs in a worker; a refused expression
    comes back as an error message for the model. (Without the sandbox, which test_tool_sandbox.py covers.)"""
    assert list(load_tools("examples.tool_calculator.tools.TOOLS")) == ["calculator"]
    runner = ToolRunner("examples.tool_calculator.tools.TOOLS", 30, 200, 1, SandboxConfig(mode="none"))
    session = runner.session()
    try:
        (call,) = parse_tool_calls(data.CALL % "348 * 27")
        assert session._call_blocking(call.name, call.arguments) == "9396"
        bad = session._call_blocking("calculator", {"expression": "__import__('os')"})
        assert bad.startswith("error: tool 'calculator' raised ValueError: unsupported syntax")
    finally:
        session.close()
        runner.close()


@pytest.fixture(scope="module")
def chatml():
    """A character-level tokenizer with SmolLM2's template shape (ChatML, no tool role)."""
    return build_tokenizer(CHATML_TEMPLATE)


def _response(tokenizer, turns: list[str], results: list[str]) -> str:
    """The decoded response of a conversation whose turns are ``turns`` with ``results`` answering the calls of
    all but the last, assembled as generate_multi_turn does (tool segments from the template) and decoded as it
    does (special tokens skipped)."""
    ids: list[int] = []
    for i, turn in enumerate(turns):
        ids += tokenizer.encode(turn + "<|im_end|>", add_special_tokens=False)
        if i < len(results):
            segment = tool_segment_text(tokenizer, tool_messages([("calculator", results[i])], False), turn)
            ids += tokenizer.encode(segment, add_special_tokens=False)
    return tokenizer.decode(ids, skip_special_tokens=True)


def _score(response: str, label: str = "9396") -> float:
    sample = Sample(prompt="q", uid="u", group_index=0, index=0, label=label, response=response)
    return reward.final_answer_reward(sample)


def test_reward_scores_the_answer_after_the_tool_response(chatml):
    call = data.CALL % "348 * 27"
    assert _score(_response(chatml, [call, "9396"], ["9396"])) == 1.0
    assert _score(_response(chatml, [call, "The answer is 9,396."], ["9396"])) == 1.0
    assert _score(_response(chatml, [call, "9395"], ["9396"])) == 0.0


def test_reward_ignores_the_number_in_the_tool_response(chatml):
    """Calling the tool and then writing no answer (or a wrong one, or another call) earns nothing, although the
    right number is in the response, inside <tool_response>."""
    call = data.CALL % "348 * 27"
    for final in ["", "ok", "I used the calculator.", data.CALL % "9396 * 1"]:
        response = _response(chatml, [call, final], ["9396"])
        sample = Sample(prompt="q", uid="u", group_index=0, index=0, label="9396", response=response)
        if not final.startswith("<tool_call>"):
            assert integer_reward(response, "9396") == 1.0  # the whole response's last integer is the tool's
        assert reward.final_answer_reward(sample) == 0.0, response


def test_reward_of_an_answer_without_a_tool_call():
    assert _score("9396") == 1.0
    assert _score("348 * 27 = 9396") == 1.0
    assert _score("about 9000") == 0.0
    assert _score(data.CALL % "348 * 27") == 0.0  # a call cut off before its response (only the expression's numbers)


def test_data_splits_on_the_operand_pair(tmp_path):
    train_path, eval_path = data.make_dataset(tmp_path, seed=3, n_train=300, n_eval=40)
    train = [json.loads(line) for line in train_path.read_text().splitlines()]
    eval_ = [json.loads(line) for line in eval_path.read_text().splitlines()]
    assert (len(train), len(eval_)) == (300, 40)

    def pair(rec):
        return tuple(int(x) for x in rec["uid"].split("-")[1:3])

    assert not {pair(r) for r in train} & {pair(r) for r in eval_}
    for rec in train + eval_:
        a, b = pair(rec)
        assert 100 <= a <= 999 and 10 <= b <= 99 and rec["label"] == str(a * b)
        assert rec["prompt"][0]["role"] == "system" and rec["prompt"][-1]["role"] == "user"
        assert f"{a}" in rec["prompt"][-1]["content"] and f"{b}" in rec["prompt"][-1]["content"]
        # the worked examples' calls are in the format the rollout parses
        calls = [c for m in rec["prompt"] if m["role"] == "assistant" for c in parse_tool_calls(m["content"])]
        assert [c.arguments for c in calls] == [{"expression": "123 * 45"}, {"expression": "618 * 72"}]


def _sample(turns: int, reward_: float = 0.0) -> Sample:
    s = Sample(prompt="q", uid="u", group_index=0, index=0, label="1", response="1", turns=turns, reward=reward_)
    s.response_tokens, s.weight_versions = [1], [0]
    return s


def test_tool_call_rate_metrics():
    """rollout/tool_call_frac (and eval's) counts samples that went on after a tool's response (turns > 1); a
    single-turn run (turns 0 everywhere) reports no such metric."""
    groups = [[_sample(2), _sample(1), _sample(2), _sample(2)], [_sample(1), _sample(1), _sample(1), _sample(1)]]
    assert rollout_metrics(groups)["rollout/tool_call_frac"] == 3 / 8
    assert tool_call_frac([s for g in groups for s in g]) == 3 / 8
    assert "rollout/tool_call_frac" not in rollout_metrics([[_sample(0), _sample(0)]])

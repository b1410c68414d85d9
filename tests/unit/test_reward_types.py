"""Miles' reward types (``--rm-type`` and a sample's metadata ``rm_type``), each against answers whose score is
known: the scores Miles' reward hub gives them (each checked against it), except the one case marked where
math-verify decides differently, as the docstring of ``reward_types`` says."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from miles_async.algorithms import reward_types
from miles_async.arguments import ConfigError, parse_args
from miles_async.config import RewardConfig
from miles_async.rollout.data_source import DataError, load_prompts
from miles_async.rollout.rewards import RewardError, RewardModel
from miles_async.rollout.sample import Sample
from tests.flag_helpers import minimal_flags

CHOICES = {"choices": ["London", "Berlin", "Rome", "Paris"]}


@pytest.mark.parametrize(
    "rm_type, response, label, metadata, expected",
    [
        # math: the last \boxed{} of the whole response, compared symbolically; nothing boxed scores 0
        ("math", "so the result is $\\boxed{\\frac{1}{2}}$", "0.5", {}, 1.0),
        ("math", "first \\boxed{3}, on reflection \\boxed{4}", "4", {}, 1.0),
        ("math", "first \\boxed{4}, on reflection \\boxed{3}", "4", {}, 0.0),
        ("math", "the answer is 4", "4", {}, 0.0),
        ("math", "\\boxed{x^2+2x+1}", "(x+1)^2", {}, 1.0),
        ("math", "\\boxed{4}", "the answer is $\\boxed{4}$", {}, 1.0),  # a boxed label is unboxed
        ("math", "\\boxed{4}", "", {}, 0.0),
        ("math", "\\boxed{\\text{Monday}}", "Monday", {}, 1.0),
        ("math", "\\boxed{(1,2)}", "(1, 2)", {}, 1.0),
        ("math", "\\boxed{4/2}", "2", {}, 1.0),  # math-verify's call; Miles' checker wants the integer written so
        # deepscaler: only the answer after the thinking counts, and a thought that never ends scores 0
        ("deepscaler", "<think>is it \\boxed{3}?</think> It is \\boxed{4}.", "4", {}, 1.0),
        ("deepscaler", "<think>it is \\boxed{4}</think> I am not sure.", "4", {}, 0.0),
        ("deepscaler", "It is \\boxed{4}.", "4", {}, 0.0),
        ("deepscaler", "###Response It is \\boxed{4}.", "4", {}, 1.0),
        # gemma_math: the answer after Gemma-4's last <channel|>, or anywhere without one (Miles' get_gemma_math_reward)
        ("gemma_math", "thinking: \\boxed{3}?<channel|>It is \\boxed{4}.", "4", {}, 1.0),
        ("gemma_math", "thinking: \\boxed{4}<channel|>It is \\boxed{3}.", "4", {}, 0.0),
        ("gemma_math", "It is \\boxed{4}.", "4", {}, 1.0),
        # dapo: the last "Answer:" line of the last 300 characters; 1 or -1
        ("dapo", "12 + 22 = 34.\nAnswer: 34", "34", {}, 1.0),
        ("dapo", "Answer: $34$", "34", {}, 1.0),
        ("dapo", "answer: 33\nno wait.\nAnswer: 34", "34", {}, 1.0),
        ("dapo", "Answer: 33", "34", {}, -1.0),
        ("dapo", "Answer: x = 34", "34", {}, 1.0),
        ("dapo", "Answer: 34 degrees", "34", {}, 1.0),
        ("dapo", "Answer: 1,000", "1000", {}, 1.0),
        ("dapo", "The answer is 34", "34", {}, -1.0),
        ("dapo", "Answer: 34\n" + "checking. " * 31, "34", {}, -1.0),  # the line lies before the last 300
        # f1: SQuAD's token F1
        ("f1", "The cat sat.", "cat sat on the mat", {}, 2 / 3),
        ("f1", "Yes.", "yes", {}, 1.0),
        ("f1", "yes it is", "yes", {}, 0.0),
        ("f1", "a dog", "the cat", {}, 0.0),
        # gpqa: the letter chosen against the correct one, else the correct choice's text
        ("gpqa", "<think>A or B?</think> The answer is C", "C", {}, 1.0),
        ("gpqa", "<think>C, surely</think> The answer is B", "C", {}, 0.0),
        ("gpqa", "Final answer: (B)", 1, CHOICES, 1.0),  # an index label; the last standalone letter
        ("gpqa", "I pick D", "Paris", CHOICES, 1.0),  # the label names a choice; "I" is no option letter
        ("gpqa", "I pick A", "Paris", CHOICES, 0.0),
        ("gpqa", "It must be Paris.", "Paris", CHOICES, 1.0),  # no letter: the choice's text
        ("gpqa", "It must be Rome.", "Paris", CHOICES, 0.0),
        ("gpqa", "The answer is B", "X", {"correct_letter": "b"}, 1.0),
        # boxed_<type>: the type on the last \boxed{} alone, empty without one
        ("boxed_exact", "so: \\boxed{Paris}", "Paris", {}, 1.0),
        ("boxed_exact", "Paris", "Paris", {}, 0.0),
        ("boxed_f1", "The city is \\boxed{the Paris}", "Paris", {}, 1.0),
        ("boxed_integer", "3 apples, \\boxed{5} pears, 7 plums", "5", {}, 1.0),
    ],
)
def test_each_type_scores_answers_whose_score_is_known(rm_type, response, label, metadata, expected):
    value = reward_types.score(rm_type, response, label, metadata)
    assert (value["score"] if isinstance(value, dict) else value) == pytest.approx(expected)


def test_dapo_reports_accuracy_and_the_answer_it_read():
    assert reward_types.score("dapo", "so\nAnswer: $34$", "34", {}) == {"score": 1.0, "acc": True, "pred": "34"}
    assert reward_types.score("dapo", "no answer line", "34", {}) == {"score": -1.0, "acc": False, "pred": "[INVALID]"}


def test_random_is_a_coin():
    assert {reward_types.score("random", "", None, {}) for _ in range(200)} == {0.0, 1.0}


def test_deterministic_random_is_a_coin_fixed_by_the_answer():
    scores = [reward_types.score("deterministic_random", f"answer {i}", "4", {}) for i in range(64)]
    assert scores == [reward_types.score("deterministic_random", f"answer {i}", "4", {}) for i in range(64)]
    assert 16 < sum(scores) < 48  # both sides, as a fair coin's 64 throws fall there but for 1 in 10^4


def _sample(response: str, label, metadata: dict | None = None) -> Sample:
    return Sample(uid="u7", group_index=0, index=0, prompt="p", label=label, response=response, metadata=metadata or {})


@pytest.fixture(scope="module")
def reward_model():
    """One model for the module: its verifier worker (math-verify's types) starts once."""
    return RewardModel(RewardConfig("exact", None, "raise"))


def test_a_samples_metadata_rm_type_overrides_the_runs(reward_model):
    """The run's type is exact; each sample's metadata picks its own, math-verify's in the verifier worker."""
    samples = [
        (_sample("Paris", "Paris"), 1.0),
        (_sample("\\boxed{0.5}", "\\frac{1}{2}", {"rm_type": "math"}), 1.0),
        (_sample("It is \\boxed{0.5}", "\\frac{1}{2}", {"rm_type": "deepscaler"}), 0.0),
        (_sample("Answer: 34", "34", {"rm_type": "dapo"}), 1.0),
        (_sample("Answer: 35", "34", {"rm_type": "dapo"}), -1.0),
        (_sample("so \\boxed{B}", "B", {"rm_type": "boxed_gpqa"}), 1.0),
    ]
    got = [asyncio.run(reward_model.score(s)) for s, _ in samples]
    assert got == [expected for _, expected in samples]


def test_dapos_reward_key_picks_its_field():
    model = RewardModel(RewardConfig("dapo", None, "raise", reward_key="acc"))
    assert asyncio.run(model.score(_sample("Answer: 35", "34"))) == 0.0
    assert asyncio.run(model.score(_sample("Answer: 34", "34"))) == 1.0


@pytest.mark.parametrize(
    "rm_type, message",
    [
        ("nonsense", "unknown reward type 'nonsense'; choose from math, deepscaler, gemma_math, dapo"),
        ("ifbench", "reward type 'ifbench' is not supported: IFBench's instruction checkers are not installable"),
    ],
)
def test_a_samples_type_that_cannot_score_fails_naming_the_sample(reward_model, rm_type, message):
    with pytest.raises(RewardError, match=f"uid=u7 .*{message}"):
        asyncio.run(reward_model.score(_sample("x", "x", {"rm_type": rm_type})))


@pytest.mark.parametrize(
    "rm_type, message",
    [
        ("boxed_nonsense", "unknown reward type 'boxed_nonsense'"),
        ("ifbench", "reward type 'ifbench' is not supported: .* NLTK's punkt"),
    ],
)
def test_rm_type_that_cannot_score_is_refused_before_the_run(tmp_path, rm_type, message):
    flags = minimal_flags(tmp_path)
    flags[flags.index("--rm-type") + 1] = rm_type
    with pytest.raises(ConfigError, match=f"^--rm-type: {message}"):
        parse_args([*flags, "--num-rollout", "1"])


def test_miles_reward_type_spellings_parse(tmp_path):
    flags = minimal_flags(tmp_path)
    # every name of Miles' reward hub (miles/rollout/rm_hub/__init__.py) but ifbench (refused, above) and remote_rm
    # (--rm-url's, test_remote_reward.py)
    for rm_type in ("deepscaler", "gemma_math", "dapo", "math", "f1", "gpqa", "random", "deterministic_random",
                    "boxed_f1"):  # fmt: skip
        flags[flags.index("--rm-type") + 1] = rm_type
        assert parse_args([*flags, "--num-rollout", "1"]).rollout.reward.rm_type == rm_type


def test_miles_dapo_launcher_lines_take_effect_without_warnings(tmp_path, caplog):
    """Miles' DAPO launchers pass --rm-type dapo --reward-key score: the key reads the score, so no warning."""
    flags = minimal_flags(tmp_path)
    flags[flags.index("--rm-type") + 1] = "dapo"
    with caplog.at_level(logging.WARNING, logger="miles_async"):
        cfg = parse_args([*flags, "--num-rollout", "1", "--reward-key", "score"])
    assert cfg.rollout.reward.reward_key == "score" and caplog.records == []


def test_a_records_metadata_rm_type_reaches_its_reward_through_the_data(tmp_path, reward_model):
    """Miles' data shape: each record's "metadata" object (the default --metadata-key) names its type, and gpqa
    reads its choices there too."""
    data = tmp_path / "mixed.jsonl"
    records = [
        {"prompt": "q", "label": "34", "metadata": {"rm_type": "dapo"}},
        {"prompt": "q", "label": "Paris", "metadata": {"rm_type": "gpqa", **CHOICES}},
        {"prompt": "q", "label": "Paris"},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in records * 2))
    cfg = parse_args([*minimal_flags(tmp_path, data=data), "--num-rollout", "1", "--rollout-batch-size", "2"])
    items = load_prompts(cfg.rollout.data.path, "prompt", "label", cfg.rollout.data.metadata_key)
    answers = ["Answer: 34", "The answer is D", "Paris"]
    got = [asyncio.run(reward_model.score(_sample(a, it.label, it.metadata))) for a, it in zip(answers, items)]
    assert got == [1.0, 1.0, 1.0]


def test_metadata_that_is_not_an_object_is_refused_naming_the_line(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text("".join(json.dumps({"prompt": "q", "label": "1", "metadata": m}) + "\n" for m in ({}, "gpqa")))
    with pytest.raises(DataError, match=f"^--prompt-data: {data}:2: 'metadata' \\(--metadata-key\\) must be an object"):
        parse_args([*minimal_flags(tmp_path, data=data), "--num-rollout", "1", "--rollout-batch-size", "1"])

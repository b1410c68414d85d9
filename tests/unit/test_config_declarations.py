"""The declarations in miles_async/config: the backend x feature table, the checks declared on a flag, and the
warning for a flag given where it has no effect."""

from __future__ import annotations

import argparse
import logging

import pytest

from miles_async.arguments import FEATURES, ConfigError, build_parser, parse_args
from miles_async.config import backend_choice
from miles_async.config.capabilities import CAPABILITIES, Capability, check_capabilities
from miles_async.config.declare import at_least, check_needs, check_values, flag, when_flag, without_effect
from tests.flag_helpers import minimal_flags

# A value for a feature flag whose default (None) gives no numeric one to step from.
EXAMPLE_VALUES = {
    "--multimodal-keys": '{"image": "images"}',
    "--only-train-params-name-list": "layers",
    "--freeze-params-name-list": "embed",
}


def _feature_args(row: Capability) -> list[str]:
    """Command-line words that ask for the row's feature."""
    if row.feature in EXAMPLE_VALUES:
        return [row.feature, EXAMPLE_VALUES[row.feature]]
    if row.value is not None:
        return [row.feature, row.value]
    if row.feature.endswith("-*"):
        return [row.feature[:-1] + "mem-fraction-static", "0.7"]
    feature = FEATURES[row.feature]
    switch = feature.options.get("action") in ("store_true", argparse.BooleanOptionalAction)
    return [row.feature] if switch else [row.feature, str(feature.default + 1)]


def _namespace(words: list[str]) -> argparse.Namespace:
    """What parse_args hands to the checks: the parser's namespace with the engines' passthrough flags split off."""
    from miles_async.arguments import split_engine_flags

    parser = build_parser()
    ns, unknown = parser.parse_known_args(words)
    split_engine_flags(parser, ns, unknown)
    backend_choice.choose(ns, FEATURES)
    return ns


CASES = [(row, backend) for row in CAPABILITIES for backend in FEATURES[row.axis.flag].choices]


@pytest.mark.parametrize(
    "row, backend", CASES, ids=[f"{r.feature}{'=' + r.value if r.value else ''}@{r.axis.flag}={b}" for r, b in CASES]
)
def test_each_capability_row_refuses_its_feature_naming_flag_and_backend(row, backend):
    words = [*_feature_args(row), row.axis.flag, backend]
    if backend in row.supported_by:
        check_capabilities(_namespace(words), FEATURES)  # this row lets it through, and no other row objects
        return
    with pytest.raises(ConfigError) as e:
        check_capabilities(_namespace(words), FEATURES)
    message = str(e.value)
    assert message.startswith(f"{' '.join(_feature_args(row))} is not supported by the {backend} {row.axis.noun}")
    assert f"need {row.axis.flag} {' or '.join(row.supported_by)}" in message
    assert f"(this run uses {row.axis.flag} {backend}" in message


def test_every_backend_lacks_something_the_table_names():
    """The table is not vacuous: each backend value refuses at least one feature."""
    for axis_flag, backends in (
        ("--rollout-backend", {"embedded", "sglang", "vllm"}),
        ("--train-backend", {"fsdp", "megatron"}),
        ("--rollout-router", {"sglang"}),
    ):
        assert backends <= {b for r, b in CASES if r.axis.flag == axis_flag and b not in r.supported_by}


def test_a_choice_refusal_lists_what_the_backend_supports(tmp_path):
    with pytest.raises(ConfigError, match=r"which supports --weight-update-method auto, disk\)$"):
        parse_args(
            [
                *minimal_flags(tmp_path),
                "--num-rollout",
                "1",
                "--rollout-backend",
                "vllm",
                "--weight-update-method",
                "tensor",
            ]
        )


def test_a_check_declared_on_a_flag_runs_and_names_the_flag():
    widgets = flag("--widgets", type=int, default=1, check=at_least(1))
    gadgets = flag("--gadgets", action="store_true", needs=when_flag("--widgets-enabled"))
    ns = argparse.Namespace(widgets=0, gadgets=False, widgets_enabled=False)
    with pytest.raises(ConfigError, match=r"^--widgets must be >= 1$"):
        check_values(ns, [widgets])
    check_values(argparse.Namespace(widgets=None), [widgets])  # not given: nothing to check
    check_needs(ns, [gadgets])
    with pytest.raises(ConfigError, match=r"^--gadgets needs --widgets-enabled$"):
        check_needs(argparse.Namespace(gadgets=True, widgets_enabled=False), [gadgets])


@pytest.mark.parametrize(
    "extra, message",
    [
        # Each was accepted before: a semaphore of 0 never lets a request out; 0 threads fell back to the default;
        # -1 x -1 training workers passed the product check; a dual clip crashed cispo's loss at the first step.
        (["--rollout-max-concurrent-requests", "0"], "--rollout-max-concurrent-requests must be >= 1"),
        (["--train-num-threads", "0"], "--train-num-threads must be >= 1"),
        (["--actor-num-nodes", "-1", "--actor-num-gpus-per-node", "-1"], "--actor-num-nodes must be >= 1"),
        (["--engine-request-timeout", "0"], "--engine-request-timeout must be positive"),
        (
            ["--policy-loss-type", "cispo", "--eps-clip-c", "3"],
            "--eps-clip-c (dual clip) is not defined for --policy-loss-type cispo",
        ),
    ],
)
def test_values_that_failed_later_are_refused_naming_the_flag(tmp_path, extra, message):
    with pytest.raises(ConfigError) as e:
        parse_args([*minimal_flags(tmp_path), "--num-rollout", "1", *extra])
    assert str(e.value).startswith(message)


@pytest.mark.parametrize(
    "given, shown, enabling",
    [
        (["--wandb-project", "p"], "--wandb-project p", ["--use-wandb"]),
        (["--rollout-health-check-interval", "2"], "--rollout-health-check-interval 2.0", ["--use-fault-tolerance"]),
        (  # named with the embedded engine; alone, --sglang-python would choose SGLang (backend_choice)
            ["--sglang-python", "/x/python", "--rollout-backend", "embedded"],
            "--sglang-python /x/python",
            ["--rollout-backend", "sglang"],
        ),
        (["--weight-update-dir", "/tmp/w"], "--weight-update-dir /tmp/w", ["--rollout-backend", "vllm"]),
        (["--update-weight-buffer-size", "1024"], "--update-weight-buffer-size 1024", []),
        (["--max-staleness-steps", "3"], "--max-staleness-steps 3", ["--fully-async"]),
        (["--min-lr", "1e-07"], "--min-lr 1e-07", ["--lr-decay-style", "cosine"]),
        (["--lr-decay-iters", "60"], "--lr-decay-iters 60", ["--lr-decay-style", "cosine"]),
        (["--gamma", "0.9"], "--gamma 0.9", ["--advantage-estimator", "reinforce_plus_plus"]),
        (["--kl-loss-coef", "0.1"], "--kl-loss-coef 0.1", ["--use-kl-loss", "--ref-load", "MODEL"]),
        (
            ["--eval-temperature", "0.5"],
            "--eval-temperature 0.5",
            ["--eval-prompt-data", "DATA", "--eval-interval", "1"],
        ),
        (["--no-save-optim"], "--no-save-optim", ["--save", "SAVE"]),
    ],
)
def test_a_flag_given_without_effect_is_named_once_in_a_warning(tmp_path, caplog, given, shown, enabling):
    args = [*minimal_flags(tmp_path), "--num-rollout", "1", *given]
    subs = {"MODEL": str(tmp_path / "model"), "DATA": str(tmp_path / "train.jsonl"), "SAVE": str(tmp_path / "ckpt")}
    if given[0] == "--update-weight-buffer-size":  # buckets take effect on every route but disk
        args += ["--rollout-backend", "vllm"]
    with caplog.at_level(logging.WARNING, logger="miles_async"):
        parse_args(args)
    named = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"{shown} is ignored")]
    assert len(named) == 1, caplog.text
    assert "it only takes effect with" in named[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="miles_async"):
        parse_args(
            args[:-2] if given[0] == "--update-weight-buffer-size" else args + [subs.get(w, w) for w in enabling]
        )
    assert not [r for r in caplog.records if r.getMessage().startswith(shown.split()[0] + " ")], caplog.text


def test_every_effect_rule_is_quiet_on_defaults():
    """Defaults are never "given": a plain command line warns about nothing."""
    ns = _namespace([])
    from miles_async.arguments import FLAGS

    assert without_effect(ns, FLAGS) == []

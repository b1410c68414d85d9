"""--async-save: on by default, Megatron-LM's spelling parses, and a backend without background saves falls back to
blocking ones with a warning naming the flag (the FALLBACKS row of config/capabilities.py)."""

from __future__ import annotations

import pytest

from miles_async.arguments import FEATURES, build_parser
from miles_async.config import checkpoint
from miles_async.config.capabilities import check_capabilities


def _ns(*words: str):
    ns, _ = build_parser().parse_known_args(list(words))
    return ns


SAVING = ("--save", "/ckpt", "--save-interval", "1")


@pytest.mark.parametrize(
    "words, async_save",
    [
        ((*SAVING,), True),  # the default: interval saves do not stall training for their write
        ((*SAVING, "--async-save"), True),  # as a Megatron-LM / Miles launcher writes it
        ((*SAVING, "--no-async-save"), False),
        ((*SAVING, "--train-backend", "megatron"), False),
    ],
)
def test_which_runs_save_in_the_background(words, async_save):
    assert checkpoint.build(_ns(*words)).async_save is async_save


def test_megatron_warns_that_its_interval_saves_stay_synchronous():
    [message] = check_capabilities(_ns(*SAVING, "--async-save", "--train-backend", "megatron"), FEATURES)
    assert message.startswith("--async-save is not supported by the megatron backend")
    assert "saves stay synchronous" in message


@pytest.mark.parametrize(
    "words",
    [
        (*SAVING, "--train-backend", "fsdp"),
        (*SAVING, "--no-async-save", "--train-backend", "megatron"),
        ("--train-backend", "megatron"),  # no interval saves: nothing to fall back from
    ],
)
def test_no_warning_where_nothing_falls_back(words):
    assert check_capabilities(_ns(*words), FEATURES) == []

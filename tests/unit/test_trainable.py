"""--only-train-params-name-list / --freeze-params-name-list: the selection of the weights that train
(backends/trainable.py, which the torch backend applies to the policy it builds) and the flags' refusals."""

from __future__ import annotations

import pytest

from miles_async.arguments import ConfigError, parse_args
from miles_async.backends.trainable import trainable_names
from tests.flag_helpers import minimal_flags

NAMES = [
    "model.visual.patch_embed.proj.weight",
    "model.visual.blocks.0.attn.qkv.weight",
    "model.visual.merger.mlp.0.weight",
    "model.language_model.embed_tokens.weight",
    "model.language_model.layers.0.self_attn.q_proj.weight",
    "model.language_model.layers.0.mlp.up_proj.weight",
    "model.language_model.norm.weight",
]


def test_only_selects_by_search_and_freeze_removes_from_it():
    assert trainable_names(NAMES) == set(NAMES)
    assert trainable_names(NAMES, only=["visual"]) == set(NAMES[:3])
    assert trainable_names(NAMES, only=["visual", r"layers\.0\.mlp"]) == set(NAMES[:3]) | {NAMES[5]}
    assert trainable_names(NAMES, only=["visual"], freeze=["merger"]) == set(NAMES[:2])
    assert trainable_names(NAMES, freeze=[r"^model\.language_model\."]) == set(NAMES[:3])


@pytest.mark.parametrize(
    "only, freeze, flag",
    [
        (["vision_tower"], [], "--only-train-params-name-list: 'vision_tower' matches none"),
        ([], ["expert"], "--freeze-params-name-list: 'expert' matches none"),
        (["visual"], ["model"], "leave no parameter to train"),
    ],
)
def test_patterns_that_select_nothing_are_refused_naming_the_flag(only, freeze, flag):
    with pytest.raises(ValueError, match=flag):
        trainable_names(NAMES, only, freeze)


def test_flags_reach_the_trainer_and_are_refused_when_wrong(tmp_path):
    base = [*minimal_flags(tmp_path), "--num-rollout", "2"]
    cfg = parse_args([*base, "--only-train-params-name-list", "visual", "merger", "--freeze-params-name-list", "x"])
    assert (cfg.train.only_train_params, cfg.train.freeze_params) == (("visual", "merger"), ("x",))
    with pytest.raises(ConfigError, match=r"--only-train-params-name-list: '\(' is not a valid regular expression"):
        parse_args([*base, "--only-train-params-name-list", "("])
    with pytest.raises(ConfigError, match="with --lora-rank: LoRA already decides"):
        parse_args([*base, "--freeze-params-name-list", "visual", "--lora-rank", "4"])
    with pytest.raises(ConfigError, match="--only-train-params-name-list.*megatron"):
        parse_args([*base, "--only-train-params-name-list", "visual", "--train-backend", "megatron"])

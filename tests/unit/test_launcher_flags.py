"""The rest of what Miles' and slime's launchers pass: refused where asynchronous training cannot honour it
(--colocate, expert parallelism), accepted and named once in a warning where it has no effect, and the checks
that look at this machine, which --check-config turns into warnings."""

from __future__ import annotations

import logging

import pytest

from miles_async.arguments import FLAGS, ConfigError, parse_args
from miles_async.config.declare import module_installed
from tests.flag_helpers import minimal_flags

MEGATRON = ["--train-backend", "megatron"]


def _args(tmp_path, *extra: str, **hf_config) -> list[str]:
    return [*minimal_flags(tmp_path, **hf_config), "--num-rollout", "1", *extra]


def _warnings(caplog, args: list[str]) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="miles_async"):
        parse_args(args)
    return [r.getMessage() for r in caplog.records]


def test_colocate_is_refused_for_asynchronous_training(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"^--colocate is not supported for asynchronous training: the engines "
        r"generate rollout N\+1 while the trainer trains on rollout N",
    ):
        parse_args(_args(tmp_path, "--colocate"))


@pytest.mark.parametrize("name", ["--expert-model-parallel-size", "--expert-tensor-parallel-size"])
def test_expert_parallelism_is_refused_until_moe_is_supported(tmp_path, caplog, name):
    with pytest.raises(
        ConfigError,
        match=rf"^{name} 8: expert parallelism is for MoE layers, which the megatron "
        r"backend does not build yet \(give 1 or leave it out\)",
    ):
        parse_args(_args(tmp_path, *MEGATRON, name, "8"))
    assert _warnings(caplog, _args(tmp_path, *MEGATRON, name, "1")) == []  # slime's launchers pass 1


def test_the_megatron_backend_refuses_an_moe_checkpoint_up_front(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"--train-backend megatron does not build MoE models yet \(.*config.json: "
        r"model_type qwen3_moe, 128 experts\); --train-backend fsdp trains it",
    ):
        parse_args(_args(tmp_path, *MEGATRON, model_type="qwen3_moe", num_experts=128))


def _sample_words(f) -> list[str]:
    if f.options.get("action") == "store_true":
        return [f.name]
    value = {int: "3", float: "0.5"}.get(f.options.get("type"), "x")
    return [f.name, value]


IGNORED = [f for f in FLAGS if f.ignored is not None]


@pytest.mark.parametrize("f", IGNORED, ids=[f.name for f in IGNORED])
def test_each_launcher_flag_without_effect_is_accepted_and_named_once(tmp_path, caplog, f):
    words = _sample_words(f)
    warnings = _warnings(caplog, _args(tmp_path, *words))
    assert warnings == [f"{' '.join(words)} is ignored: {f.ignored}"]


def test_the_ignored_list_covers_slimes_perf_and_moe_knobs():
    names = {f.name for f in IGNORED}
    assert {
        "--balance-data",
        "--micro-batch-size",
        "--optimizer-cpu-offload",
        "--use-precision-aware-optimizer",
        "--moe-grouped-gemm",
        "--moe-token-dispatcher-type",
        "--wandb-key",
        "--train-memory-margin-bytes",
        "--log-probs-chunk-size",
        "--seq-length",
        "--calculate-per-token-loss",
        "--loss-mask-type",
    } <= names


@pytest.mark.parametrize(
    "given, enabling",
    [
        (["--hidden-dropout", "0.1"], MEGATRON),
        (["--attention-backend", "flash"], MEGATRON),
        (["--attention-softmax-in-fp32"], MEGATRON),
        (
            ["--recompute-method", "uniform"],
            [*MEGATRON, "--recompute-granularity", "full", "--recompute-num-layers", "1"],
        ),
        (["--adam-beta2", "0.999"], []),
        (["--sgd-momentum", "0.5"], ["--optimizer", "sgd"]),
    ],
)
def test_training_flags_without_effect_in_this_configuration_are_named(tmp_path, caplog, given, enabling):
    """Given where it has no effect (the torch backend for Megatron's own knobs, the other optimizer's
    hyper-parameters): one warning naming it. Where it takes effect: none."""
    disabling = ["--optimizer", "sgd"] if given[0].startswith("--adam") else []
    named = [
        w
        for w in _warnings(caplog, _args(tmp_path, *given, *disabling))
        if w.startswith(f"{given[0]} ") and " is ignored: it only takes effect with " in w
    ]
    assert len(named) == 1, caplog.text
    assert not [
        w
        for w in _warnings(caplog, _args(tmp_path, *given, *enabling))
        if w.startswith(f"{given[0]} ") and " is ignored" in w
    ]


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["--recompute-granularity", "full"],
            "--recompute-granularity full needs --recompute-method (uniform or block) and --recompute-num-layers",
        ),
        (
            ["--recompute-granularity", "selective", "--recompute-method", "uniform"],
            "--recompute-granularity selective recomputes core attention in every layer: drop --recompute-method",
        ),
        (
            ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "3"],
            "--recompute-num-layers 3 is more than the model's 2 layers",
        ),
    ],
)
def test_megatron_recompute_flags_are_checked_as_megatron_does(tmp_path, extra, message):
    with pytest.raises(ConfigError) as e:
        parse_args(_args(tmp_path, *MEGATRON, *extra, num_hidden_layers=2))
    assert str(e.value).startswith(message)


def test_recompute_and_optimizer_flags_reach_each_backends_config(tmp_path):
    fsdp = parse_args(
        _args(tmp_path, "--recompute-granularity", "selective", "--optimizer", "sgd", "--sgd-momentum", "0.5")
    ).train
    assert fsdp.gradient_checkpointing and (fsdp.optimizer.optimizer, fsdp.optimizer.sgd_momentum) == ("sgd", 0.5)
    meg = parse_args(
        _args(
            tmp_path,
            *MEGATRON,
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "block",
            "--recompute-num-layers",
            "1",
            "--hidden-dropout",
            "0.1",
            "--attention-dropout",
            "0.2",
            "--attention-backend",
            "fused",
        )
    ).train
    m = meg.megatron
    assert (m.recompute_granularity, m.recompute_method, m.recompute_num_layers, m.attention_backend) == (
        "full",
        "block",
        1,
        "fused",
    )
    assert (meg.hidden_dropout, meg.attention_dropout) == (0.1, 0.2)
    # --gradient-checkpointing on Megatron (refused before): full recompute of every layer.
    gc = parse_args(_args(tmp_path, *MEGATRON, "--gradient-checkpointing")).train.megatron
    assert (gc.recompute_granularity, gc.recompute_method, gc.recompute_num_layers) == ("full", "uniform", 1)


@pytest.mark.skipif(module_installed("transformer_engine"), reason="Transformer Engine is installed here")
def test_what_this_machine_lacks_is_an_error_on_a_run_and_a_warning_under_check_config(tmp_path):
    extra = [*MEGATRON, "--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    with pytest.raises(ConfigError, match=r"^--sequence-parallel needs Transformer Engine"):
        parse_args(_args(tmp_path, *extra))
    cfg = parse_args(_args(tmp_path, *extra, "--check-config"))
    assert cfg.check_config and cfg.train.megatron.sequence_parallel
    assert [w for w in cfg.warnings if w.startswith("--sequence-parallel needs Transformer Engine")] == [
        "--sequence-parallel needs Transformer Engine (Megatron's local layer spec uses torch norms, which refuse "
        "sequence parallelism) (missing on this machine; the machine that runs the job needs it)"
    ]


@pytest.mark.skipif(module_installed("sglang_router"), reason="sglang-router is installed here")
def test_a_declared_package_requirement_goes_through_the_same_place(tmp_path):
    """A flag's importable(...) check (here --rollout-router sglang) is this machine's too."""
    with pytest.raises(ConfigError, match=r"^--rollout-router sglang needs the sglang_router package"):
        parse_args(_args(tmp_path, "--rollout-router", "sglang"))
    cfg = parse_args(_args(tmp_path, "--rollout-router", "sglang", "--check-config"))
    assert any(w.startswith("--rollout-router sglang needs the sglang_router package") for w in cfg.warnings)


def test_a_megatron_checkpoint_as_ref_load_is_named_as_such(tmp_path):
    """slime's launchers pass --ref-load <model>_torch_dist; the reference model is read from HF weights here."""
    ref = tmp_path / "Qwen3-4B_torch_dist"
    (ref / "iter_0000000").mkdir(parents=True)
    (ref / "latest_checkpointed_iteration.txt").write_text("release")
    with pytest.raises(
        ConfigError,
        match=rf"^--ref-load: {ref} is a Megatron \(torch_dist\) checkpoint, not an HF "
        r"model folder",
    ):
        parse_args(_args(tmp_path, "--ref-load", str(ref)))

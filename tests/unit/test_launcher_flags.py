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


def test_sequence_parallel_at_tp_1_is_turned_off_with_a_warning_as_megatron_lm_does(tmp_path, caplog):
    """Miles' launchers pass --sequence-parallel at TP 1 (9 of them); it was refused. At TP 2 it stays on."""
    args = _args(tmp_path, *MEGATRON, "--sequence-parallel")
    assert [w for w in _warnings(caplog, args) if "sequence" in w] == [
        "--sequence-parallel is turned off: --tensor-model-parallel-size is 1, and sequence parallelism splits "
        "sequences over the tensor-parallel ranks (Megatron-LM turns it off the same way)"
    ]
    assert parse_args(args).train.megatron.sequence_parallel is False
    tp2 = [*MEGATRON, "--sequence-parallel", "--tensor-model-parallel-size", "2", "--actor-num-gpus-per-node", "2"]
    assert not [w for w in _warnings(caplog, _args(tmp_path, *tp2)) if "sequence" in w]
    assert parse_args(_args(tmp_path, *tp2)).train.megatron.sequence_parallel is True


def _notes(caplog, args: list[str]):
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="miles_async.arguments"):
        cfg = parse_args(args)
    return cfg, [r.getMessage() for r in caplog.records if "none was given" in r.getMessage()]


def test_a_command_naming_no_backend_runs_on_the_one_its_flags_are_for(tmp_path, caplog):
    """Miles has no --rollout-backend or --train-backend: its --sglang-* flags mean SGLang, and Megatron-LM's
    layout flags mean Megatron. Without them the embedded engine and the torch backend stay the defaults."""
    cfg, notes = _notes(caplog, _args(tmp_path))
    assert (cfg.engine.backend, cfg.train.backend, notes) == ("embedded", "fsdp", [])
    sglang = ["--check-config", "--sglang-mem-fraction-static", "0.7", "--sglang-cuda-graph-bs", "1", "2"]
    cfg, notes = _notes(caplog, _args(tmp_path, *sglang))
    assert (cfg.engine.backend, cfg.train.backend) == ("sglang", "fsdp")
    assert cfg.engine.sglang_args[:2] == ("--mem-fraction-static", "0.7")
    assert notes == [
        "--rollout-backend sglang: none was given, and the command passes --sglang-cuda-graph-bs-decode, "
        "--sglang-mem-fraction-static (Miles' engine is SGLang, chosen by its flags)"
    ]
    layout = ["--tensor-model-parallel-size", "2", "--actor-num-gpus-per-node", "2", "--use-distributed-optimizer"]
    cfg, notes = _notes(caplog, _args(tmp_path, *layout))
    assert (cfg.engine.backend, cfg.train.backend, cfg.train.megatron.tensor_model_parallel_size) == (
        "embedded",
        "megatron",
        2,
    )
    assert notes == [
        "--train-backend megatron: none was given, and the command gives Megatron-LM's parallel layout "
        "(--tensor-model-parallel-size 2, --use-distributed-optimizer; Miles' trainer is Megatron)"
    ]
    # A backend named on the command line is kept, and refuses what it cannot run.
    with pytest.raises(ConfigError, match=r"^--tensor-model-parallel-size 2 is not supported by the fsdp backend"):
        parse_args(_args(tmp_path, "--train-backend", "fsdp", *layout))


def test_a_hybrid_models_layers_are_split_over_pipeline_stages_as_its_pattern_counts_them(tmp_path):
    """Nemotron-H's config.json as transformers reads it has no num_hidden_layers; the stages split its pattern."""
    nemotron = dict(model_type="nemotron_h", hybrid_override_pattern="M-M*-E", num_attention_heads=4)
    with pytest.raises(ConfigError, match=r"^--pipeline-model-parallel-size 4 does not split the 6 layers"):
        parse_args(_args(tmp_path, "--pipeline-model-parallel-size", "4", "--actor-num-gpus-per-node", "4",
                         **nemotron))  # fmt: skip


def test_use_dynamic_batch_size_is_named_as_always_on(tmp_path, caplog):
    """The docs list it among the flags warned about; it was accepted silently."""
    assert _warnings(caplog, _args(tmp_path, "--use-dynamic-batch-size")) == [
        "--use-dynamic-batch-size is ignored: micro-batches are always packed to --max-tokens-per-gpu tokens (Miles' "
        "dynamic batch size, counting padded tokens), with or without it"
    ]


# A tiny Qwen3-MoE's config.json, as validation reads it.
QWEN3_MOE = dict(
    model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, num_hidden_layers=2
)
MOE_RUN = [*MEGATRON, "--actor-num-gpus-per-node", "2", "--moe-token-dispatcher-type", "alltoall"]


def test_expert_parallelism_is_for_moe_models(tmp_path, caplog):
    """EP splits experts: refused on a dense checkpoint, and on the torch backend (a Megatron layout); slime's
    launchers pass 1, which says nothing."""
    with pytest.raises(
        ConfigError,
        match=r"^--expert-model-parallel-size 2 splits the experts of MoE layers; .*config.json describes a dense "
        r"model \(model_type llama\)",
    ):
        parse_args(_args(tmp_path, *MEGATRON, "--actor-num-gpus-per-node", "2", "--expert-model-parallel-size", "2"))
    with pytest.raises(ConfigError, match=r"--expert-model-parallel-size .*--train-backend"):
        parse_args(_args(tmp_path, "--train-backend", "fsdp", "--expert-model-parallel-size", "2", **QWEN3_MOE))
    for name in ("--expert-model-parallel-size", "--expert-tensor-parallel-size"):
        assert _warnings(caplog, _args(tmp_path, *MEGATRON, name, "1", **QWEN3_MOE)) == []


def test_an_moe_layout_reaches_the_megatron_config(tmp_path):
    m = parse_args(
        _args(tmp_path, *MOE_RUN, "--expert-model-parallel-size", "2", "--moe-router-dtype", "fp32",
              "--moe-aux-loss-coeff", "0.01", "--moe-expert-capacity-factor", "1.5", "--moe-token-drop-policy",
              "position", **QWEN3_MOE)
    ).train.megatron  # fmt: skip
    assert (m.expert_model_parallel_size, m.expert_tensor_parallel_size) == (2, None)
    assert (m.moe.router_dtype, m.moe.aux_loss_coeff, m.moe.token_dispatcher_type) == ("fp32", 0.01, "alltoall")
    assert (m.moe.expert_capacity_factor, m.moe.token_drop_policy) == (1.5, "position")


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "allgather"],
            "--expert-model-parallel-size 2 needs --moe-token-dispatcher-type alltoall",
        ),
        (["--expert-model-parallel-size", "4"], "--expert-model-parallel-size 4 x expert tensor parallelism 1 must "),
        (["--expert-model-parallel-size", "2", "n3"], "--expert-model-parallel-size 2 must divide the 3 experts"),
        (
            ["--tensor-model-parallel-size", "2"],
            "--tensor-model-parallel-size 2 on an MoE model needs --sequence-parallel",
        ),
        (
            ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "3"],
            "expert tensor parallelism 3 must divide TP 2 x CP 1 x data parallel 1",
        ),
    ],
)
def test_an_expert_layout_that_cannot_split_the_model_is_refused(tmp_path, extra, message):
    config = {**QWEN3_MOE, "num_experts": 3} if "n3" in extra else QWEN3_MOE
    argv = _args(tmp_path, *MOE_RUN, *(x for x in extra if x != "n3"), **config)  # the last dispatcher given wins
    with pytest.raises(ConfigError) as e:
        parse_args(argv)
    assert message in str(e.value)


@pytest.mark.parametrize(
    "model_type, missing",
    [
        ("deepseek_v2", "each expert group ranked by its best expert"),
        ("kimi_k2", "a transformers model for model_type kimi_k2"),
        ("minimax_m2", "MiniMax's sigmoid router"),
    ],
)
def test_an_moe_family_the_megatron_backend_does_not_build_is_refused_naming_what_is_missing(
    tmp_path, model_type, missing
):
    with pytest.raises(ConfigError) as e:
        parse_args(_args(tmp_path, *MEGATRON, model_type=model_type, n_routed_experts=8))
    assert str(e.value).startswith(f"--train-backend megatron does not build model_type '{model_type}'")
    assert missing in str(e.value) and "--train-backend fsdp trains it" in str(e.value)


def test_moe_flags_without_effect_here_are_named_with_the_reason(tmp_path, caplog):
    """Transformer Engine's kernels on a machine without it, a drop policy without a capacity, the MoE flags on a
    dense model: each named once, saying why."""
    if module_installed("transformer_engine"):
        pytest.skip("Transformer Engine is installed here")
    moe = _warnings(
        caplog,
        _args(tmp_path, *MOE_RUN, "--moe-grouped-gemm", "--moe-permute-fusion", "--moe-token-drop-policy",
              "position", **QWEN3_MOE),
    )  # fmt: skip
    assert sorted(w for w in moe if w.startswith("--moe-")) == [
        "--moe-grouped-gemm is Transformer Engine's GPU kernel, absent here: each expert runs its own matmul and "
        "tokens are permuted by torch ops (the same function)",
        "--moe-permute-fusion is Transformer Engine's GPU kernel, absent here: each expert runs its own matmul and "
        "tokens are permuted by torch ops (the same function)",
        "--moe-token-drop-policy position is ignored: it only takes effect with --moe-expert-capacity-factor "
        "(without a capacity no token is dropped)",
    ]
    dense = _warnings(caplog, _args(tmp_path, *MEGATRON, "--moe-aux-loss-coeff", "0.01"))
    assert dense == [
        "--moe-aux-loss-coeff 0.01 is ignored: it only takes effect with --train-backend megatron on an MoE model "
        "(experts in --hf-checkpoint's config.json)"
    ]
    # The expert bias's update rate on a router without one (Qwen3-MoE's); on GLM-4.5's it takes effect.
    qwen = _warnings(caplog, _args(tmp_path, *MOE_RUN, "--moe-router-bias-update-rate", "0", **QWEN3_MOE))
    assert [w for w in qwen if w.startswith("--moe-router-bias")] == [
        "--moe-router-bias-update-rate 0.0 is ignored: it only takes effect with --train-backend megatron on a "
        "model whose router has an expert bias (GLM-4.5, DeepSeek-V3)"
    ]
    glm = {**QWEN3_MOE, "model_type": "glm4_moe", "n_routed_experts": QWEN3_MOE["num_experts"]}
    glm.pop("num_experts")
    glm_warnings = _warnings(caplog, _args(tmp_path, *MOE_RUN, "--moe-router-bias-update-rate", "0", **glm))
    assert not [w for w in glm_warnings if w.startswith("--moe-router-bias")], glm_warnings


def _sample_words(f) -> list[str]:
    if f.options.get("action") == "store_true":
        return [f.name]
    value = f.choices[0] if f.choices else {int: "3", float: "0.5"}.get(f.options.get("type"), "x")
    return [f.name, value]


IGNORED = [f for f in FLAGS if f.ignored is not None]


@pytest.mark.parametrize("f", IGNORED, ids=[f.name for f in IGNORED])
def test_each_launcher_flag_without_effect_is_accepted_and_named_once(tmp_path, caplog, f):
    words = _sample_words(f)
    needed = ["--position-embedding-type", "rope"] if f.needs is not None else []  # --no-position-embedding's
    warnings = _warnings(caplog, _args(tmp_path, *words, *needed))
    assert warnings == [f"{' '.join(words)} is ignored: {f.ignored}"]


def test_the_ignored_list_covers_slimes_perf_and_moe_knobs():
    names = {f.name for f in IGNORED}
    assert {
        "--balance-data",
        "--micro-batch-size",
        "--moe-router-pre-softmax",
        "--moe-enable-deepep",
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


@pytest.mark.skipif(module_installed("deep_ep"), reason="DeepEP is installed here")
def test_what_this_machine_lacks_is_an_error_on_a_run_and_a_warning_under_check_config(tmp_path):
    extra = [*MEGATRON, "--moe-token-dispatcher-type", "flex"]
    with pytest.raises(ConfigError, match=r"^--moe-token-dispatcher-type flex needs DeepEP"):
        parse_args(_args(tmp_path, *extra, **QWEN3_MOE))
    cfg = parse_args(_args(tmp_path, *extra, "--check-config", **QWEN3_MOE))
    assert cfg.check_config and cfg.train.megatron.moe.token_dispatcher_type == "flex"
    assert [w for w in cfg.warnings if w.startswith("--moe-token-dispatcher-type flex needs DeepEP")] == [
        "--moe-token-dispatcher-type flex needs DeepEP (GPUs); alltoall or allgather run anywhere (missing on this "
        "machine; the machine that runs the job needs it)"
    ]


@pytest.mark.skipif(module_installed("sglang_router"), reason="sglang-router is installed here")
def test_a_declared_package_requirement_goes_through_the_same_place(tmp_path):
    """A flag's importable(...) check (here --rollout-router sglang) is this machine's too."""
    with pytest.raises(ConfigError, match=r"^--rollout-router sglang needs the sglang_router package"):
        parse_args(_args(tmp_path, "--rollout-router", "sglang"))
    cfg = parse_args(_args(tmp_path, "--rollout-router", "sglang", "--check-config"))
    assert any(w.startswith("--rollout-router sglang needs the sglang_router package") for w in cfg.warnings)


def test_a_partial_megatron_checkpoint_as_ref_load_names_what_is_missing(tmp_path):
    """slime's and Miles' launchers pass --ref-load <model>_torch_dist; one whose tracker names a folder it lacks
    is refused naming it (complete ones: tests/integration/test_torch_dist_checkpoints.py)."""
    ref = tmp_path / "Qwen3-4B_torch_dist"
    (ref / "iter_0000000").mkdir(parents=True)
    (ref / "latest_checkpointed_iteration.txt").write_text("release")
    with pytest.raises(
        ConfigError,
        match=rf"^--ref-load: {ref}/latest_checkpointed_iteration.txt names 'release', but release/ is missing",
    ):
        parse_args(_args(tmp_path, "--ref-load", str(ref)))


def test_miles_optimizer_memory_flags_take_the_distributed_optimizer_and_say_what_is_missing_here(tmp_path, caplog):
    """--optimizer-cpu-offload, --overlap-cpu-optimizer-d2h-h2d and --use-precision-aware-optimizer reach
    megatron-core's OptimizerConfig (``optimizer_memory``) with the distributed optimizer, which Miles turns on for
    every run. On this machine (no GPU, no Transformer Engine) each says it takes effect on the GPU nodes; the GPU
    path is scripts/gpu/check_megatron_gpu.py's optimizer_offload check."""
    from miles_async.backends.megatron.model import optimizer_memory

    if module_installed("transformer_engine"):
        pytest.skip("Transformer Engine is installed here")
    flags = ["--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer"]
    warnings = _warnings(caplog, _args(tmp_path, *MEGATRON, *flags))
    assert warnings == [
        "--optimizer-cpu-offload and --use-precision-aware-optimizer run with the distributed optimizer only "
        "(megatron-core's): --use-distributed-optimizer is turned on, as Miles does for every run",
        "--optimizer-cpu-offload moves the optimizer's state and step from the GPU to the CPU; without a GPU here "
        "they are on the CPU already (it takes effect on GPU nodes)",
        "--use-precision-aware-optimizer is Transformer Engine's FusedAdam, absent here: the optimizer keeps fp32 "
        "master weights and fp32 state",
    ]
    m = parse_args(_args(tmp_path, *MEGATRON, *flags, "--optimizer-offload-fraction", "0.5")).train.megatron
    assert m.use_distributed_optimizer and m.optimizer_cpu_offload and m.optimizer_offload_fraction == 0.5
    assert optimizer_memory(m, cuda=True, te=True) == {
        "optimizer_cpu_offload": True,
        "optimizer_offload_fraction": 0.5,
        "overlap_cpu_optimizer_d2h_h2d": True,
        "use_precision_aware_optimizer": True,
    }
    assert optimizer_memory(m, cuda=False, te=False) == {
        "optimizer_cpu_offload": False,
        "optimizer_offload_fraction": 0.0,
        "overlap_cpu_optimizer_d2h_h2d": False,
        "use_precision_aware_optimizer": False,
    }
    assert optimizer_memory(m, cuda=True, te=False)["use_precision_aware_optimizer"] is False
    # Without --optimizer-cpu-offload its two companions are named as doing nothing; the torch backend names all.
    alone = _warnings(caplog, _args(tmp_path, *MEGATRON, "--overlap-cpu-optimizer-d2h-h2d"))
    assert alone == [
        "--overlap-cpu-optimizer-d2h-h2d is ignored: it only takes effect with --train-backend megatron "
        "--optimizer-cpu-offload"
    ]
    fsdp = _warnings(caplog, _args(tmp_path, "--optimizer-cpu-offload"))
    assert fsdp == ["--optimizer-cpu-offload is ignored: it only takes effect with --train-backend megatron"]

import json
import re

import pytest

from miles_async.arguments import ConfigError, parse_args
from miles_async.rollout.data_source import DataError
from miles_async.utils.plugins import PluginError
from tests.flag_helpers import minimal_flags


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "label": str(i)}) + "\n" for i in range(16)))
    return path


def base(tmp_path, data, *extra):
    return [*minimal_flags(tmp_path, data=data), "--n-samples-per-prompt", "2", "--num-rollout", "3", *extra]


def test_valid_flags_build_typed_configs(tmp_path, data):
    cfg = parse_args(
        base(
            tmp_path, data, "--global-batch-size", "4", "--eval-prompt-data", "held", str(data), "--eval-interval", "2"
        )
    )
    assert cfg.train.num_steps_per_rollout == 2  # 4 prompts * 2 samples / 4
    assert cfg.train.global_batch_size == 4
    assert cfg.loop.num_rollout == 3 and cfg.loop.num_rollout_per_epoch == 4
    assert cfg.eval.datasets == (("held", str(data)),)
    assert cfg.rollout.sampling.max_new_tokens == 128


def test_stop_token_ids_reach_the_engines_sampling_params_in_rollouts_and_evals(tmp_path, data):
    evals = ["--eval-prompt-data", "held", str(data), "--eval-interval", "2"]
    cfg = parse_args(base(tmp_path, data, *evals, "--rollout-stop-token-ids", "7", "9"))
    assert cfg.rollout.sampling.to_sglang()["stop_token_ids"] == [7, 9]
    assert cfg.eval.sampling.to_sglang()["stop_token_ids"] == [7, 9]
    assert "stop_token_ids" not in parse_args(base(tmp_path, data)).rollout.sampling.to_sglang()


def test_num_epoch_sets_num_rollout(tmp_path, data):
    args = base(tmp_path, data)
    args[args.index("--num-rollout") : args.index("--num-rollout") + 2] = ["--num-epoch", "2"]
    assert parse_args(args).loop.num_rollout == 8


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (["--global-batch-size", "16"], "--global-batch-size 16 is larger than one rollout"),
        (["--global-batch-size", "3"], "must divide"),
        (["--num-steps-per-rollout", "3"], "--num-steps-per-rollout 3 must divide"),
        (["--save-interval", "2"], "--save-interval needs --save"),
        (["--eval-interval", "2"], "--eval-interval needs --eval-prompt-data"),
        (["--use-kl-loss", "--kl-loss-coef", "0.1"], "needs --ref-load"),
        (["--tis-clip", "0.5", "--tis-clip-low", "1.0"], "--tis-clip must be > --tis-clip-low"),
        (["--num-epoch", "1"], "only one of --num-rollout and --num-epoch"),
        (["--eps-clip-c", "0.5"], "--eps-clip-c"),
        (["--rollout-stop-token-ids", "5", "-1"], "--rollout-stop-token-ids must be >= 0"),
    ],
)
def test_contradictions_name_the_flag(tmp_path, data, extra, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("-", "\\-").replace("*", "\\*")):
        parse_args(base(tmp_path, data, *extra))


def test_batch_larger_than_dataset(tmp_path, data):
    args = base(tmp_path, data)
    args[args.index("--rollout-batch-size") + 1] = "32"
    with pytest.raises(ConfigError, match="fewer than --rollout-batch-size"):
        parse_args(args)


def test_missing_data_file_is_named(tmp_path):
    with pytest.raises(DataError, match="--prompt-data: file not found: .*nope.jsonl"):
        parse_args(base(tmp_path, tmp_path / "nope.jsonl"))


def test_missing_key_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "label": "1"}\n{"prompt": "b", "label": "2"}\n{"prompt": "c"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:3: missing key 'label' \(--label-key\)"):
        parse_args(base(tmp_path, path))


def test_invalid_json_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "label": "1"}\n{not json\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: invalid JSON"):
        parse_args(base(tmp_path, path))


def test_unknown_rm_type_is_rejected(tmp_path, data):
    with pytest.raises(ConfigError, match="^--rm-type: unknown reward type 'nonsense'; choose from math, "):
        parse_args(base(tmp_path, data)[:-4] + ["--rm-type", "nonsense"])


def test_custom_rm_that_does_not_import(tmp_path, data):
    args = [a for a in base(tmp_path, data) if a not in ("--rm-type", "integer")]
    with pytest.raises(PluginError, match="--custom-rm-path: cannot import module 'no_such_module_xyz'"):
        parse_args(args + ["--custom-rm-path", "no_such_module_xyz:reward"])


def test_custom_rm_missing_attribute(tmp_path, data):
    args = [a for a in base(tmp_path, data) if a not in ("--rm-type", "integer")]
    with pytest.raises(PluginError, match="has no attribute 'nope'"):
        parse_args(args + ["--custom-rm-path", "miles_async.rollout.rewards:nope"])


def test_yaml_config_supplies_values_and_cli_wins(tmp_path, data):
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("lr: 0.001\nn-samples-per-prompt: 4\nrollout_max_response_len: 7\n")
    cfg = parse_args(base(tmp_path, data, "--config", str(cfg_file)))
    assert cfg.train.optimizer.lr == 0.001
    assert cfg.rollout.sampling.max_new_tokens == 7
    assert cfg.rollout.n_samples_per_prompt == 2  # the command line said 2


def test_yaml_unknown_key(tmp_path, data):
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("learning-rate: 0.1\n")
    with pytest.raises(ConfigError, match="unknown flag 'learning-rate'"):
        parse_args(base(tmp_path, data, "--config", str(cfg_file)))


@pytest.mark.parametrize("made", [True, False])
def test_an_empty_or_missing_load_folder_starts_a_fresh_run(tmp_path, data, made, caplog):
    """Megatron-LM's and Miles' first start: --load = --save, empty or not made yet; the run starts at rollout 0,
    restores nothing, and says so. The policy starts from --ref-load when one is given (Miles' rule)."""
    import logging

    ckpt = tmp_path / "ckpt"
    if made:
        ckpt.mkdir()
    flags = base(tmp_path, data, "--load", str(ckpt), "--save", str(ckpt))
    with caplog.at_level(logging.INFO, logger="miles_async.config.checkpoint"):
        cfg = parse_args(flags)
        ref = parse_args([*flags, "--ref-load", str(tmp_path / "model")])
    assert (cfg.loop.start_rollout_id, cfg.checkpoint.load, cfg.train.init_weights) == (0, None, None)
    assert ref.train.init_weights == str(tmp_path / "model")
    assert caplog.messages == [
        f"--load {ckpt} holds no checkpoint: a fresh run from rollout 0, the policy from --hf-checkpoint "
        f"{tmp_path / 'model'}",
        f"--load {ckpt} holds no checkpoint: a fresh run from rollout 0, the policy from --ref-load "
        f"{tmp_path / 'model'}",
    ]
    # Without --load the policy stays --hf-checkpoint's, whatever --ref-load is.
    assert parse_args(base(tmp_path, data, "--ref-load", str(tmp_path / "model"))).train.init_weights is None


@pytest.mark.parametrize(
    "layout, missing",
    [
        ({"latest_checkpointed_iteration.txt": "2"}, "names iteration 2, but iter_0000002/ is missing from"),
        ({"latest_checkpointed_iteration.txt": "release"}, "names 'release', but release/ is missing from"),
        ({"iter_0000002/COMPLETE": ""}, "holds iter_0000002/ but no latest_checkpointed_iteration.txt"),
        ({"latest_checkpointed_iteration.txt": "2", "iter_0000002/actor/x": ""}, "is incomplete (no COMPLETE)"),
        ({"latest_checkpointed_iteration.txt": "two"}, "holds 'two', neither an iteration number nor 'release'"),
    ],
)
def test_a_partial_load_folder_is_refused_naming_what_is_missing(tmp_path, data, layout, missing):
    """A tracker without its iteration, or an iteration without the tracker, is not an empty folder."""
    ckpt = tmp_path / "ckpt"
    for name, text in layout.items():
        (ckpt / name).parent.mkdir(parents=True, exist_ok=True)
        (ckpt / name).write_text(text)
    with pytest.raises(ConfigError, match=r"^--load: .*" + re.escape(missing)):
        parse_args(base(tmp_path, data, "--load", str(ckpt)))


def test_load_sets_start_rollout_id(tmp_path, data):
    from miles_async.utils.checkpoint import iteration_dir, mark_complete

    ckpt = tmp_path / "ckpt"
    iteration_dir(ckpt, 1).mkdir(parents=True)
    mark_complete(ckpt, 1)
    assert parse_args(base(tmp_path, data, "--load", str(ckpt))).loop.start_rollout_id == 2


@pytest.mark.parametrize("mode, name", [([], "the one-step-off loop"), (["--fully-async"], "--fully-async")])
def test_async_training_without_an_off_policy_correction_gets_tis_at_miles_clip(tmp_path, data, mode, name):
    """Miles' launchers pass no correction (51 of them); the run was refused. It gets TIS at Miles' default clip
    (2 and 0), named in a warning; a correction given, or a clip given, is kept."""
    args = [a for a in base(tmp_path, data, *mode) if a != "--use-tis"]
    cfg = parse_args(args)
    assert (cfg.train.algorithm.use_tis, cfg.train.algorithm.tis_clip, cfg.train.algorithm.tis_clip_low) == (
        True,
        2.0,
        0.0,
    )
    assert [w for w in cfg.warnings if "off-policy" in w] == [
        f"{name} trains on samples generated by an older policy and no off-policy correction was given: --use-tis "
        "is turned on (truncated importance sampling against the rollout log-probs, at Miles' clip --tis-clip 2.0 "
        "--tis-clip-low 0.0); give --use-tis, --use-rollout-logprobs or --keep-old-actor to choose"
    ]
    assert parse_args(args + ["--tis-clip", "3"]).train.algorithm.tis_clip == 3.0
    chosen = parse_args(args + ["--use-rollout-logprobs"])
    assert chosen.train.algorithm.use_rollout_logprobs and not chosen.train.algorithm.use_tis
    assert not [w for w in chosen.warnings if "off-policy" in w]


def test_fully_async_config(tmp_path, data):
    cfg = parse_args(base(tmp_path, data, "--fully-async", "--max-staleness-steps", "2"))
    assert cfg.rollout.fully_async.max_concurrent_groups == 4 * 3 and cfg.loop.fully_async


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (["--update-weights-interval", "2"], "needs --update-weights-interval 1"),
        (["--async-max-concurrent-groups", "2"], "must lie between"),
        (["--max-weight-staleness", "-1"], "--max-staleness-steps must be >= 0"),
    ],
)
def test_fully_async_contradictions(tmp_path, data, extra, fragment):
    with pytest.raises(ConfigError, match=fragment):
        parse_args(base(tmp_path, data, "--fully-async", "--use-tis", *extra))


def test_zero_variance_filter_is_dynamic_sampling_in_either_loop(tmp_path, data):
    for loop in ([], ["--fully-async"]):
        ds = parse_args(base(tmp_path, data, "--zero-variance-filter", *loop)).rollout.dynamic_sampling
        assert ds.filter_path == "miles_async.rollout.filters.zero_variance"
        assert ds.filter_name == "--zero-variance-filter"


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (["--use-rollout-logprobs"], "--use-tis has no effect with --use-rollout-logprobs"),
        (["--keep-old-actor", "--partial-rollout", "--fully-async"], "add --mask-offpolicy-in-partial-rollout"),
        (["--kl-coef", "0.1"], "only ppo and reinforce_plus_plus"),
        (["--kl-coef", "0.1", "--advantage-estimator", "reinforce_plus_plus"], "--kl-coef > 0 needs --ref-load"),
        (["--advantage-estimator", "gspo", "--policy-loss-type", "cispo"], "--policy-loss-type cispo contradicts it"),
        (["--critic-lr", "1e-5"], "--critic-lr needs --advantage-estimator ppo"),
        (["--num-critic-only-steps", "1"], "--num-critic-only-steps needs --advantage-estimator ppo"),
        (["--advantage-estimator", "ppo", "--num-critic-only-steps", "3"], "leaves no rollout"),
        (["--advantage-estimator", "ppo", "--critic-num-gpus-per-node", "3"], "over 3 critic workers"),
        (["--gamma", "1.5"], "--gamma must lie in [0, 1]"),
        (["--normalize-advantages"], "--normalize-advantages applies to ppo"),
    ],
)
def test_algorithm_contradictions_name_the_flag(tmp_path, data, extra, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("-", "\\-").replace("[", "\\[").replace("]", "\\]")):
        parse_args(base(tmp_path, data, *extra))


def test_estimators_map_to_loss_and_critic(tmp_path, data):
    gspo = parse_args(base(tmp_path, data, "--advantage-estimator", "gspo", "--eps-clip", "3e-4"))
    assert gspo.train.algorithm.loss_type == "gspo" and gspo.critic is None
    ppo = parse_args(
        base(
            tmp_path,
            data,
            "--advantage-estimator",
            "ppo",
            "--critic-lr",
            "1e-4",
            "--lr",
            "1e-6",
            "--value-clip",
            "0",
            "--num-critic-only-steps",
            "1",
            "--critic-lr-warmup-iters",
            "2",
        )
    )
    assert ppo.critic.role == "critic" and ppo.critic.model_path == ppo.train.model_path
    assert ppo.critic.optimizer.lr == 1e-4 and ppo.train.optimizer.lr == 1e-6
    assert ppo.critic.optimizer.lr_warmup_iters == 2 and ppo.train.optimizer.lr_warmup_iters == 0
    assert ppo.train.algorithm.value_clip is None  # 0 turns the clip off
    assert ppo.loop.num_critic_only_steps == 1 and ppo.cluster.num_critic_workers == 1
    keep = parse_args(
        base(
            tmp_path,
            data,
            "--keep-old-actor",
            "--fully-async",
            "--max-staleness-steps",
            "3",
            "--pause-generation-mode",
            "abort",
        )
    )
    assert keep.train.algorithm.keep_old_actor and keep.train.max_kept_weight_versions == 5


def test_synchronous_mode_needs_no_correction_only_when_on_policy(tmp_path, data):
    args = [a for a in base(tmp_path, data, "--synchronous") if a != "--use-tis"]
    on_policy = parse_args(args)
    assert on_policy.loop.synchronous and not on_policy.train.algorithm.use_tis
    assert not [w for w in on_policy.warnings if "off-policy" in w]
    stale = parse_args(args + ["--update-weights-interval", "2"])
    assert stale.train.algorithm.use_tis
    assert [w.split(" and no")[0] for w in stale.warnings if "off-policy" in w] == [
        "--synchronous with --update-weights-interval > 1 trains on samples generated by an older policy"
    ]
    with pytest.raises(ConfigError, match="exclude each other"):
        parse_args(base(tmp_path, data, "--synchronous", "--fully-async"))


@pytest.mark.parametrize("flag", ["--hf-checkpoint", "--ref-load"])
def test_model_folder_without_config_json_is_refused_up_front(tmp_path, data, flag):
    empty = tmp_path / "no_config"
    empty.mkdir()
    args = base(tmp_path, data)
    if flag == "--hf-checkpoint":
        args[args.index(flag) + 1] = str(empty)
    else:
        args += [flag, str(empty)]
    with pytest.raises(ConfigError, match=f"{flag}: .*no_config has no config.json"):
        parse_args(args)
    (empty / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=f"{flag}: .*config.json is not valid JSON"):
        parse_args(args)


def test_train_async_names_a_model_folder_without_config_json_before_ray_starts(tmp_path, data):
    import subprocess
    import sys

    from tests.scripts.helpers import ROOT

    empty = tmp_path / "no_config"
    empty.mkdir()
    args = base(tmp_path, data)
    args[args.index("--hf-checkpoint") + 1] = str(empty)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train_async.py"), *args], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"error: --hf-checkpoint: {empty} has no config.json" in proc.stderr
    assert "Traceback" not in proc.stderr and "ray" not in proc.stderr.lower()
    assert not (tmp_path / "out").exists()  # nothing was started, nothing written


def test_fully_async_keep_old_actor_needs_abort_pauses(tmp_path, data):
    """An in-place pause resumes a request under the new weights, so a sample mixes two versions that no kept
    copy generated (training raised mid-run); abort pauses keep each trained token on one version."""
    args = base(tmp_path, data, "--fully-async", "--keep-old-actor")
    with pytest.raises(ConfigError, match=r"--fully-async --keep-old-actor needs --pause-generation-mode abort"):
        parse_args(args)
    assert parse_args(args + ["--pause-generation-mode", "abort"]).train.algorithm.keep_old_actor
    assert parse_args(
        args + ["--pause-generation-mode", "abort", "--partial-rollout", "--mask-offpolicy-in-partial-rollout"]
    ).rollout.mask_offpolicy_in_partial_rollout
    assert parse_args(base(tmp_path, data, "--keep-old-actor")).train.algorithm.keep_old_actor  # one-step-off drains


@pytest.mark.parametrize("mode", [[], ["--fully-async"], ["--synchronous"]])
def test_cpu_threads_default_to_half_the_cores_where_generation_and_training_overlap(tmp_path, data, mode, monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    cfg = parse_args(base(tmp_path, data, *mode))
    want = 8 if mode == ["--synchronous"] else 4  # --synchronous takes turns: each side gets every core
    assert (cfg.engine.num_threads, cfg.train.num_threads) == (want, want)
    pinned = parse_args(base(tmp_path, data, *mode, "--rollout-num-threads", "3", "--train-num-threads", "2"))
    assert (pinned.engine.num_threads, pinned.train.num_threads) == (3, 2)

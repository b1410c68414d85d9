"""The TRL peer benchmark's pure parts: settings taken from the quickstart launcher, TRL's config, the comparison."""

import json
import subprocess

import pytest

from benchmarks import trl_grpo_runner as runner
from benchmarks import trl_peer
from benchmarks import trl_peer_report as report
from benchmarks.common import ROOT, eval_curve, step_seconds, time_to_reach

# Real-shaped curves: (step, held-out accuracy, training wall seconds when the eval's weights were ready).
OURS = [(0, 0.16, -2.0), (10, 0.41, 310.0), (20, 0.62, 640.0), (30, 0.70, 950.0)]
TRL = [(0, 0.16, 0.0), (10, 0.30, 900.0), (20, 0.45, 1800.0), (30, 0.52, 2700.0)]


def _quickstart_ns(*extra: str):
    out = subprocess.run(
        ["bash", str(trl_peer.LAUNCHER), "--dry-run", *extra],
        env={"MODEL": "/m", "DATA": "/d", "OUT": "/o", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    return trl_peer.parse_ours(trl_peer.launcher_argv(out))


def _flags(args: list[str]) -> dict[str, str]:
    return dict(zip(args[::2], args[1::2], strict=True))


def test_peer_flags_come_from_the_quickstart_launcher():
    ns = _quickstart_ns("--num-rollout", "2", "--eval-interval", "1")
    assert str(ns.hf_checkpoint) == "/m" and ns.eval_prompt_data == ["mul", "/d/eval.jsonl"]
    flags = _flags(trl_peer.peer_args(ns))
    assert flags == {
        "--steps": "2",
        "--eval-interval": "1",
        "--lr": "1e-05",
        "--lr-schedule": "cosine",
        "--min-lr": "1e-06",
        "--seed": "1234",
        "--prompts-per-step": "8",
        "--num-generations": "8",
        "--max-completion-length": "8",
        "--temperature": "1.0",
        "--top-p": "1.0",
        "--top-k": "0",
        "--epsilon": "0.2",
        "--beta": "0.0",
        "--entropy-coef": "0.0",
        "--scale-rewards": "group",
        "--max-grad-norm": "1.0",
        "--adam-beta1": "0.9",
        "--adam-beta2": "0.98",
        "--adam-eps": "1e-08",
        "--weight-decay": "0.0",
        "--precision": "bf16",
        "--eval-samples": "4",
        "--eval-temperature": "1.0",
        "--eval-top-p": "1.0",
        "--eval-max-new-tokens": "8",
    }
    # The runner's own defaults are the quickstart's, so a direct run matches it too.
    defaults = runner.build_parser().parse_args(["--model", "m", "--train", "t", "--eval", "e", "--out", "o"])
    parsed = runner.build_parser().parse_args(
        ["--model", "m", "--train", "t", "--eval", "e", "--out", "o", *trl_peer.peer_args(_quickstart_ns())]
    )
    assert vars(parsed) == vars(defaults)


def test_peer_flags_follow_changed_settings_and_refuse_untranslatable_ones():
    ns = _quickstart_ns("--lr", "1e-4", "--disable-grpo-std-normalization", "--eps-clip-high", "0.28")
    flags = _flags(trl_peer.peer_args(ns))
    assert (flags["--lr"], flags["--scale-rewards"], flags["--epsilon-high"]) == ("0.0001", "none", "0.28")
    flags = _flags(trl_peer.peer_args(_quickstart_ns("--lr-decay-style", "cosine", "--min-lr", "1e-6")))
    assert (flags["--lr-schedule"], flags["--min-lr"]) == ("cosine", "1e-06")
    with pytest.raises(ValueError, match="--lr-decay-style linear"):
        trl_peer.peer_args(_quickstart_ns("--lr-decay-style", "linear"))
    with pytest.raises(ValueError, match="--global-batch-size 16"):
        trl_peer.peer_args(_quickstart_ns("--global-batch-size", "16"))
    flags = _flags(trl_peer.peer_args(_quickstart_ns("--lr-decay-iters", "60")))
    assert (flags["--lr-decay-iters"], flags["--steps"]) == ("60", "30")
    assert "--lr-decay-iters" not in _flags(trl_peer.peer_args(_quickstart_ns()))
    with pytest.raises(ValueError, match="--lr-decay-iters 20: the TRL peer's cosine must span the run"):
        trl_peer.peer_args(_quickstart_ns("--lr-decay-iters", "20"))


@pytest.mark.parametrize("has_bf16,expected", [(True, "bf16"), (False, "float32")])
def test_trl_computes_at_the_precision_our_run_resolves_to(has_bf16, expected):
    from miles_async.config.precision import fall_back

    ns, _ = fall_back(_quickstart_ns(), on_gpu=False, has_bf16=has_bf16)
    assert _flags(trl_peer.peer_args(ns))["--precision"] == expected
    argv = ["--model", "m", "--train", "t", "--eval", "e", "--out", "/tmp/x", "--precision", expected]
    assert runner.grpo_config_kwargs(runner.build_parser().parse_args(argv))["bf16"] is (expected == "bf16")
    # An engine at another precision than the trainer's: one precision for TRL cannot match both.
    ns, _ = fall_back(_quickstart_ns("--rollout-dtype", "float32"), on_gpu=False, has_bf16=True)
    with pytest.raises(ValueError, match="--rollout-dtype float32 with --bf16: the TRL peer generates and trains"):
        trl_peer.peer_args(ns)


def test_grpo_config_kwargs_translate_our_settings():
    args = runner.build_parser().parse_args(
        ["--model", "m", "--train", "t", "--eval", "e", "--out", "/tmp/x", "--steps", "30", "--lr", "5e-5"]
        + ["--lr-schedule", "constant"]
    )
    kw = runner.grpo_config_kwargs(args)
    # 8 prompts x 8 completions in one generation batch and one optimizer step per batch.
    assert (kw["per_device_train_batch_size"], kw["gradient_accumulation_steps"], kw["num_generations"]) == (64, 1, 8)
    assert (kw["num_iterations"], kw["max_steps"], kw["max_completion_length"]) == (1, 30, 8)
    assert (kw["learning_rate"], kw["lr_scheduler_type"], kw["warmup_steps"]) == (5e-5, "constant", 0)
    assert (kw["adam_beta2"], kw["max_grad_norm"], kw["beta"], kw["epsilon"], kw["epsilon_high"]) == (
        0.98,
        1.0,
        0.0,
        0.2,
        0.2,
    )
    assert (kw["loss_type"], kw["scale_rewards"], kw["bf16"], kw["gradient_checkpointing"]) == (
        "dapo",
        "group",
        True,  # the quickstart's --bf16
        False,
    )


def test_eval_schedule_is_ours():
    assert [s for s in range(31) if runner.eval_due(s, 10, 30)] == [0, 10, 20, 30]
    assert [s for s in range(8) if runner.eval_due(s, 3, 7)] == [0, 3, 6, 7]


def test_reward_is_our_integer_reward_on_trl_completions(tmp_path):
    completions = [[{"role": "assistant", "content": "7 * 8 = 56"}], [{"role": "assistant", "content": "54"}], "x"]
    assert runner.integer_reward_func(completions, label=["56", "56", "1"]) == [1.0, 0.0, 0.0]
    # The runner's reward function also keeps the step's prompts, each once, as TRL drew them.
    args = runner.build_parser().parse_args(["--model", "m", "--train", "t", "--eval", "e", "--out", str(tmp_path)])
    recorder = runner.Recorder(args, [], tokenizer=None)
    prompts = [[{"role": "user", "content": "What is 7 * 8?"}]] * 2 + [[{"role": "user", "content": "1 * 1?"}]]
    assert recorder.reward_func()(completions, label=["56", "56", "1"], prompts=prompts) == [1.0, 0.0, 0.0]
    assert recorder.step_prompts == ["What is 7 * 8?", "1 * 1?"]


def test_time_to_reach_skips_step_zero_and_says_none_when_never_reached():
    assert time_to_reach(OURS, 0.52) == (20, 640.0)
    assert time_to_reach(TRL, 0.52) == (30, 2700.0)
    assert time_to_reach(TRL, 0.70) is None
    assert time_to_reach(TRL, 0.10) == (10, 900.0)  # step 0's 0.16 does not count


def test_compare_reports_step_ratio_and_time_to_the_peers_final_accuracy():
    ours, trl = {"step_seconds": [30.0, 32.0, 40.0], "curve": OURS}, {"step_seconds": [90.0] * 3, "curve": TRL}
    cmp = report.compare(ours, trl)
    assert cmp["ours"]["median"] == 32.0 and cmp["ours"]["mean"] == pytest.approx(34.0)
    assert cmp["step_ratio_median"] == pytest.approx(90 / 32)
    assert (cmp["ours"]["final_accuracy"], cmp["trl"]["final_accuracy"]) == (0.70, 0.52)
    at_trl, at_ours = cmp["levels"]
    assert (at_trl["of"], at_trl["ours_seconds"], at_trl["trl_seconds"]) == ("trl", 640.0, 2700.0)
    assert at_trl["speedup"] == pytest.approx(2700 / 640)
    assert (at_ours["of"], at_ours["ours_seconds"], at_ours["trl_seconds"], at_ours["speedup"]) == (
        "ours",
        950.0,
        None,
        None,
    )
    assert report.ratio(None, 3.0) is None and report.ratio(3.0, 0.0) is None


def test_headline_rows():
    cmp = report.compare({"step_seconds": [32.0], "curve": OURS}, {"step_seconds": [90.0], "curve": TRL})
    rows = report.headline({"steps": 30, "comparison": cmp})
    assert rows == [
        [
            "TRL GRPOTrainer peer, SmolLM2 quickstart, 30 steps, ours one-step-off: seconds per step, train_async.py "
            "vs TRL (median)",
            "32.0 s vs 90.0 s (2.81x)",
        ],
        [
            "TRL GRPOTrainer peer, SmolLM2 quickstart, 30 steps, ours one-step-off: wall time to TRL's final held-out "
            "accuracy (0.52), "
            "ours vs TRL",
            "640 s vs 2700 s (4.22x); final accuracy 0.70 vs 0.52 (goal: 3x)",
        ],
    ]
    synchronous = report.headline({"steps": 30, "comparison": cmp, "results": {"mode": "synchronous"}})
    assert synchronous[0][0].startswith("TRL GRPOTrainer peer, SmolLM2 quickstart, 30 steps, ours synchronous: ")
    # Ours never reaching TRL's level (a much better TRL) is said, not hidden.
    worse = report.compare({"step_seconds": [32.0], "curve": TRL}, {"step_seconds": [90.0], "curve": OURS})
    assert report.headline({"steps": 30, "comparison": worse})[1][1] == (
        "ours not reached, TRL 950 s; final accuracy 0.52 vs 0.70 (goal: 3x)"
    )
    tables = report.tables(cmp, {"ours": OURS, "trl": TRL}, "test")
    assert tables[0]["rows"][0][0] == "train_async.py (one-step-off)"
    assert tables[1]["rows"][1] == ["0.700 (our final)", "950 s (step 30)", "not reached", "-"]
    assert tables[2]["rows"][0] == [0, "0.160", "-2", "0.160", "0"]


def test_our_loop_mode_comes_from_the_launchers_flags_and_names_our_row():
    assert trl_peer.loop_mode(_quickstart_ns()) == "one-step-off"
    assert trl_peer.loop_mode(_quickstart_ns("--fully-async")) == "fully-async"
    sync = trl_peer.loop_mode(_quickstart_ns("--synchronous"))
    assert sync == "synchronous"
    cmp = report.compare({"step_seconds": [32.0], "curve": OURS}, {"step_seconds": [90.0], "curve": TRL})
    assert report.tables(cmp, {"ours": OURS, "trl": TRL}, "test", sync)[0]["rows"][0][0] == (
        "train_async.py (synchronous)"
    )


def test_our_curve_reads_background_evals_in_step_order():
    metrics = [{"rollout/started_at": 1000.0}]
    evals = [
        {"step": 2, "eval/mul/accuracy": 0.5, "eval/started_at": 1100.0},
        {"step": 0, "eval/mul/accuracy": 0.2, "eval/started_at": 999.0},
    ]
    assert eval_curve(metrics, evals, "eval/mul/accuracy") == [(0, 0.2, -1.0), (2, 0.5, 100.0)]


def test_our_curve_takes_evals_run_between_steps_out_of_the_clock_as_trls():
    metrics = [{"rollout/started_at": 1000.0}]
    evals = [
        {"step": 0, "eval/mul/accuracy": 0.2, "eval/started_at": 990.0, "eval/seconds": 10.0},
        {"step": 10, "eval/mul/accuracy": 0.8, "eval/started_at": 1200.0, "eval/seconds": 15.0},
        {"step": 20, "eval/mul/accuracy": 0.9, "eval/started_at": 1415.0, "eval/seconds": 15.0},
    ]
    # Step 0's eval ended before the first rollout; step 10's 15 s come off step 20's time.
    assert eval_curve(metrics, evals, "eval/mul/accuracy", between_steps=True) == [
        (0, 0.2, -10.0),
        (10, 0.8, 200.0),
        (20, 0.9, 400.0),
    ]
    # Background evals: nothing to take out.
    assert eval_curve(metrics, evals, "eval/mul/accuracy")[2] == (20, 0.9, 415.0)
    rows = [{"time/step_seconds": 20.0}, {"time/step_seconds": 35.0, "time/eval_seconds": 15.0}]
    assert step_seconds(rows, between_steps=True) == [20.0, 20.0]
    assert step_seconds(rows) == [20.0, 35.0]


def test_launcher_argv_needs_the_script():
    assert trl_peer.launcher_argv(f"python {ROOT}/train_async.py \\\n  --lr 5e-5") == ["--lr", "5e-5"]
    with pytest.raises(ValueError, match="no train_async.py"):
        trl_peer.launcher_argv("echo hi")


def test_mixed_version_evals_names_background_evals_that_straddled_an_update():
    evals = [
        {"step": 1, "eval/mul/weight_version_min": 1, "eval/mul/weight_version_max": 1},
        {"step": 0, "eval/mul/weight_version_min": 0, "eval/mul/weight_version_max": 1},
    ]
    assert trl_peer.mixed_version_evals(evals) == [[0, 0, 1]]


@pytest.mark.parametrize("steps,span", [(60, None), (30, 60), (30, 30)])
def test_a_cosine_schedule_gives_trl_our_learning_rate_at_every_step(steps, span):
    """Over the whole run (span None: the run's length) and over a --lr-decay-iters longer than the run."""
    import torch
    from transformers.optimization import get_scheduler

    from miles_async.backends.worker import lr_lambda
    from miles_async.config.train import OptimizerConfig

    argv = ["--model", "m", "--train", "t", "--eval", "e", "--out", "/tmp/x", "--steps", str(steps), "--lr", "1e-5"]
    argv += ["--lr-schedule", "cosine", "--min-lr", "1e-6"] + ([] if span is None else ["--lr-decay-iters", str(span)])
    kw = runner.grpo_config_kwargs(runner.build_parser().parse_args(argv))
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=kw["learning_rate"])
    hf = get_scheduler(
        kw["lr_scheduler_type"], opt, 0, kw["max_steps"], scheduler_specific_kwargs=kw["lr_scheduler_kwargs"]
    )
    ours = lr_lambda(
        OptimizerConfig("adam", 1e-5, 1e-6, 0, "cosine", 0.0, 0.9, 0.98, 1e-8, 1.0, lr_decay_iters=span), steps
    )
    for step in range(steps):
        assert opt.param_groups[0]["lr"] == pytest.approx(1e-5 * ours(step), rel=1e-9), step
        opt.step()
        hf.step()
    if span == 60:  # half-way down the cosine after 30 of 60 steps: (1e-5 + 1e-6) / 2
        assert opt.param_groups[0]["lr"] == pytest.approx(5.5e-6, rel=1e-9)


def test_the_runner_refuses_a_cosine_span_shorter_than_the_run(tmp_path):
    argv = ["--model", str(tmp_path), "--train", str(tmp_path), "--eval", str(tmp_path), "--out", str(tmp_path)]
    args = runner.build_parser().parse_args([*argv, "--steps", "30", "--lr-decay-iters", "20"])
    with pytest.raises(SystemExit, match="--lr-decay-iters 20 must be at least --steps 30"):
        runner.check_args(args)


def _write_prompts(path, n: int) -> None:
    path.write_text("".join(json.dumps({"prompt": f"What is {i} * 3?", "label": str(3 * i)}) + "\n" for i in range(n)))


def _ns_on(data, *extra: str):
    return _quickstart_ns("--prompt-data", str(data), "--num-rollout", "3", *extra)


def test_trl_trains_on_our_prompts_step_by_step(tmp_path):
    from miles_async.config import rollout
    from miles_async.rollout.data_source import DataSource

    data = tmp_path / "train.jsonl"
    _write_prompts(data, 20)
    ns = _ns_on(data)
    source = DataSource(rollout.build(ns, None).data, 8)
    # Our run's three rollouts (the 4 left of the first epoch are skipped), in our order and not the file's.
    ours = [(item.prompt, item.label) for _ in range(3) for item in source.next_batch()]
    seq = trl_peer.prompt_sequence(ns)
    assert [(r["prompt"], r["label"]) for r in seq] == ours
    # What each run drew is checked against it: a step's prompts in any order pass, another prompt does not.
    uids = [[r["uid"] for r in seq[i : i + 8]] for i in (0, 8, 16)]
    trl_peer.check_same_prompts("our run", seq, 8, [u[::-1] for u in uids], "uid")
    with pytest.raises(ValueError, match=r"TRL, step 2: trained on"):
        texts = [[r["prompt"] for r in seq[i : i + 8]] for i in (0, 8, 16)]
        trl_peer.check_same_prompts("TRL", seq, 8, [texts[0], texts[2], texts[1]], "prompt")
    with pytest.raises(ValueError, match="our run trained 2 steps; the prompt order has 3"):
        trl_peer.check_same_prompts("our run", seq, 8, uids[:2], "uid")
    assert len(seq) == 24 and [r["prompt"] for r in seq[:8]] != [f"What is {i} * 3?" for i in range(8)]
    other = trl_peer.prompt_sequence(_ns_on(data, *trl_peer.seed_args(7)))
    assert other != seq and sorted(r["label"] for r in other[:16]) != sorted(r["label"] for r in seq[:16])
    with pytest.raises(ValueError, match="--dynamic-sampling-filter-path / --zero-variance-filter"):
        trl_peer.prompt_sequence(_ns_on(data, "--zero-variance-filter", "--over-sampling-batch-size", "16"))
    with pytest.raises(ValueError, match="--rollout-max-prompt-len"):
        trl_peer.prompt_sequence(_ns_on(data, "--rollout-max-prompt-len", "64"))


def test_the_runner_takes_prompts_in_order_and_refuses_too_few(tmp_path):
    argv = ["--model", str(tmp_path), "--train", str(tmp_path / "t.jsonl"), "--eval", str(tmp_path / "t.jsonl")]
    argv += ["--out", str(tmp_path / "o"), "--steps", "3"]
    _write_prompts(tmp_path / "t.jsonl", 23)
    assert (
        runner.grpo_config_kwargs(runner.build_parser().parse_args([*argv, "--in-order"]))["shuffle_dataset"] is False
    )
    assert runner.grpo_config_kwargs(runner.build_parser().parse_args(argv))["shuffle_dataset"] is True
    with pytest.raises(SystemExit, match=r"--in-order: .*t.jsonl holds 23 prompts, fewer than --steps x "):
        runner.main([*argv, "--in-order"])


def _raw(ours_curve, trl_curve, ours_s, trl_s, mode="synchronous"):
    return {
        "ours": {"step_seconds": ours_s, "curve": ours_curve, "mixed_version_evals": []},
        "trl": {"step_seconds": trl_s, "curve": trl_curve},
        "mode": mode,
        "launcher_args": ["--synchronous"],
        "trl_flags": ["--steps", "2"],
        "trl_version": "1.16.0",
        "trl_transformers_version": "5.24.0",
    }


SEED_A = _raw(
    [(0, 0.2, -1.0), (1, 0.6, 10.0), (2, 0.9, 20.0)],
    [(0, 0.2, 0.0), (1, 0.7, 40.0), (2, 1.0, 80.0)],
    [10.0, 10.0],
    [40.0, 40.0],
)
SEED_B = _raw(
    [(0, 0.1, -3.0), (1, 0.8, 12.0), (2, 0.9, 24.0)],
    [(0, 0.1, 0.0), (1, 0.5, 44.0), (2, 0.8, 84.0)],
    [12.0, 12.0],
    [42.0, 42.0],
)


def test_seeds_are_summed_up_as_their_mean_curves(tmp_path):
    assert report.mean_curve([SEED_A["ours"]["curve"], SEED_B["ours"]["curve"][:2]]) == [
        (0, pytest.approx(0.15), -2.0),
        (1, pytest.approx(0.7), 11.0),
    ]
    entry = report.summarize_seeds(2, 1, {"1": SEED_A, "2": SEED_B}, tmp_path)
    cmp = entry["comparison"]
    assert cmp["ours"]["median"] == 11.0 and cmp["trl"]["median"] == 41.0
    # TRL's mean ends at 0.9, reached by our mean at step 2 (22 s) and by TRL's at step 2 (82 s).
    at_trl = next(lv for lv in cmp["levels"] if lv["of"] == "trl")
    assert (at_trl["level"], at_trl["ours_step"], at_trl["ours_seconds"]) == (pytest.approx(0.9), 2, 22.0)
    assert at_trl["speedup"] == pytest.approx(82 / 22)
    # Seed 2 on its own: TRL's 0.8 is reached by ours at step 1.
    assert entry["per_seed_comparison"]["2"]["levels"][0]["ours_step"] == 1
    curve_rows = entry["tables"][2]["rows"]
    assert curve_rows[1] == [1, "0.700 (0.600-0.800)", "11", "0.600 (0.500-0.700)", "42"]
    assert [r[0] for r in entry["tables"][3]["rows"]] == ["1", "2"]
    assert report.headline(entry)[0][0].startswith(
        "TRL GRPOTrainer peer, SmolLM2 quickstart, 2 steps, ours synchronous, mean of 2 seeds: "
    )
    with pytest.raises(ValueError, match="the seeds ran different loops"):
        report.summarize_seeds(2, 1, {"1": SEED_A, "2": {**SEED_B, "mode": "one-step-off"}}, tmp_path)


def test_from_results_sums_up_an_earlier_seeds_run_without_running(tmp_path, capsys):
    for seed, raw in (("1", SEED_A), ("2", SEED_B)):
        (tmp_path / f"seed-{seed}.json").write_text(json.dumps(raw))
    out = tmp_path / "out"
    files = [str(tmp_path / "seed-1.json"), str(tmp_path / "seed-2.json")]
    assert trl_peer.main(["--steps", "2", "--eval-interval", "1", "--out", str(out), "--from-results", *files]) == 0
    entry = json.loads((out / "results.json").read_text())
    assert entry["seeds"] == ["1", "2"] and entry["comparison"]["trl"]["median"] == 41.0
    assert "mean of 2 seeds" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        trl_peer.main(["--steps", "2", "--out", str(out), "--from-results", str(out / "results.json")])
    with pytest.raises(SystemExit):
        trl_peer.main(["--steps", "3", "--out", str(out), "--from-results", *files])
    with pytest.raises(SystemExit):  # before anything runs
        trl_peer.main(["--seeds", "1", "2", "--out", str(out), "--", "--rollout-seed", "7"])
    assert "leave --rollout-seed out of the launcher flags" in capsys.readouterr().err

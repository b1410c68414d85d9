"""The TRL peer comparison is like for like: TRL runs the settings of our quickstart launcher, at the precision
our run resolves to, on our prompts step by step, with our learning-rate schedule, reward and eval clock;
settings it cannot match are refused; the comparison and the seed means the reported figures rest on are
computed as they should be."""

import json
import subprocess

import pytest

from benchmarks import trl_grpo_runner as runner
from benchmarks import trl_peer
from benchmarks import trl_peer_report as report
from benchmarks.common import eval_curve, step_seconds, time_to_reach

# Real-shaped curves: (step, held-out accuracy, training wall seconds when the eval's weights were ready).
OURS = [(0, 0.16, -2.0), (10, 0.41, 310.0), (20, 0.62, 640.0), (30, 0.70, 950.0)]
TRL = [(0, 0.16, 0.0), (10, 0.30, 900.0), (20, 0.45, 1800.0), (30, 0.52, 2700.0)]


@pytest.fixture(scope="module")
def quickstart():
    """Our settings as the quickstart launcher sets them: its ``--dry-run`` runs once, and ``quickstart(*extra)``
    parses its train_async.py flags with ``extra`` after them, where the launcher puts its own arguments."""
    out = subprocess.run(
        ["bash", str(trl_peer.LAUNCHER), "--dry-run"],
        env={"MODEL": "/m", "DATA": "/d", "OUT": "/o", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    argv = trl_peer.launcher_argv(out)
    return lambda *extra: trl_peer.parse_ours([*argv, *extra])


def _flags(args: list[str]) -> dict[str, str]:
    return dict(zip(args[::2], args[1::2], strict=True))


def _runner_args(*extra: str):
    return runner.build_parser().parse_args(["--model", "m", "--train", "t", "--eval", "e", "--out", "/tmp/x", *extra])


def test_trl_runs_the_settings_of_the_quickstart_launcher(quickstart):
    ns = quickstart("--num-rollout", "2", "--eval-interval", "1")
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
        "--max-tokens-per-micro-batch": "8192",
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
    parsed = _runner_args(*trl_peer.peer_args(quickstart()))
    assert vars(parsed) == vars(_runner_args())
    # And TRL's GRPOConfig gets them: 8 prompts x 8 completions in one generation batch, one optimizer step each.
    kw = runner.grpo_config_kwargs(parsed)
    assert (kw["per_device_train_batch_size"], kw["gradient_accumulation_steps"], kw["num_generations"]) == (64, 1, 8)
    assert (kw["num_iterations"], kw["max_steps"], kw["max_completion_length"]) == (1, 30, 8)
    # Under our token budget (--max-tokens-per-gpu 8192) as ours: 64 rows of 300-token prompts and 32-token answers
    # go in 4 micro-batches of 16 (5,312 tokens each), still one generation batch and one optimizer step.
    long = runner.grpo_config_kwargs(_runner_args("--max-completion-length", "32"), longest_prompt=300)
    assert (long["per_device_train_batch_size"], long["gradient_accumulation_steps"]) == (16, 4)
    assert runner.micro_batch_rows(64, 332, 0) == 64 and runner.micro_batch_rows(6, 9000, 8192) == 1
    assert (kw["learning_rate"], kw["lr_scheduler_type"], kw["warmup_steps"]) == (1e-5, "cosine_with_min_lr", 0)
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
    kw = runner.grpo_config_kwargs(_runner_args("--lr", "5e-5", "--lr-schedule", "constant"))
    assert (kw["learning_rate"], kw["lr_scheduler_type"]) == (5e-5, "constant")


def test_peer_flags_follow_changed_settings_and_refuse_untranslatable_ones(quickstart):
    ns = quickstart("--lr", "1e-4", "--disable-grpo-std-normalization", "--eps-clip-high", "0.28")
    flags = _flags(trl_peer.peer_args(ns))
    assert (flags["--lr"], flags["--scale-rewards"], flags["--epsilon-high"]) == ("0.0001", "none", "0.28")
    flags = _flags(trl_peer.peer_args(quickstart("--lr-decay-style", "cosine", "--min-lr", "1e-6")))
    assert (flags["--lr-schedule"], flags["--min-lr"]) == ("cosine", "1e-06")
    with pytest.raises(ValueError, match="--lr-decay-style linear"):
        trl_peer.peer_args(quickstart("--lr-decay-style", "linear"))
    with pytest.raises(ValueError, match="--global-batch-size 16"):
        trl_peer.peer_args(quickstart("--global-batch-size", "16"))
    flags = _flags(trl_peer.peer_args(quickstart("--lr-decay-iters", "60")))
    assert (flags["--lr-decay-iters"], flags["--steps"]) == ("60", "30")
    assert "--lr-decay-iters" not in _flags(trl_peer.peer_args(quickstart()))
    with pytest.raises(ValueError, match="--lr-decay-iters 20: the TRL peer's cosine must span the run"):
        trl_peer.peer_args(quickstart("--lr-decay-iters", "20"))
    # The runner, run directly, refuses it too.
    with pytest.raises(SystemExit, match="--lr-decay-iters 20 must be at least --steps 30"):
        runner.check_args(_runner_args("--steps", "30", "--lr-decay-iters", "20"))


@pytest.mark.parametrize("has_bf16,expected", [(True, "bf16"), (False, "float32")])
def test_trl_computes_at_the_precision_our_run_resolves_to(quickstart, has_bf16, expected):
    from miles_async.config.precision import fall_back

    ns, _ = fall_back(quickstart(), on_gpu=False, has_bf16=has_bf16)
    assert _flags(trl_peer.peer_args(ns))["--precision"] == expected
    assert runner.grpo_config_kwargs(_runner_args("--precision", expected))["bf16"] is (expected == "bf16")
    # An engine at another precision than the trainer's: one precision for TRL cannot match both.
    ns, _ = fall_back(quickstart("--rollout-dtype", "float32"), on_gpu=False, has_bf16=True)
    with pytest.raises(ValueError, match="--rollout-dtype float32 with --bf16: the TRL peer generates and trains"):
        trl_peer.peer_args(ns)


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


def test_compare_reports_step_ratio_and_time_to_the_peers_final_accuracy():
    # A level is reached at the first eval after step 0 at or above it (step 0's 0.16 does not count).
    assert time_to_reach(OURS, 0.52) == (20, 640.0)
    assert time_to_reach(TRL, 0.52) == (30, 2700.0)
    assert time_to_reach(TRL, 0.70) is None
    assert time_to_reach(TRL, 0.10) == (10, 900.0)
    ours, trl = {"step_seconds": [30.0, 32.0, 40.0], "curve": OURS}, {"step_seconds": [90.0] * 3, "curve": TRL}
    cmp = report.compare(ours, trl)
    assert cmp["ours"]["median"] == 32.0 and cmp["ours"]["mean"] == pytest.approx(34.0)
    assert cmp["step_ratio_median"] == pytest.approx(90 / 32)
    assert (cmp["ours"]["final_accuracy"], cmp["trl"]["final_accuracy"]) == (0.70, 0.52)
    at_trl, at_ours = cmp["levels"]
    assert (at_trl["of"], at_trl["ours_seconds"], at_trl["trl_seconds"]) == ("trl", 640.0, 2700.0)
    assert at_trl["speedup"] == pytest.approx(2700 / 640)
    # TRL never reaches our final accuracy: no time and no speed-up, rather than a made-up one.
    assert (at_ours["of"], at_ours["ours_seconds"], at_ours["trl_seconds"], at_ours["speedup"]) == (
        "ours",
        950.0,
        None,
        None,
    )
    assert report.ratio(None, 3.0) is None and report.ratio(3.0, 0.0) is None


def test_our_curve_is_on_trls_clock():
    metrics = [{"rollout/started_at": 1000.0}]
    evals = [  # as eval.jsonl may hold them: background evals finish out of step order
        {"step": 10, "eval/mul/accuracy": 0.8, "eval/started_at": 1200.0, "eval/seconds": 15.0},
        {"step": 0, "eval/mul/accuracy": 0.2, "eval/started_at": 990.0, "eval/seconds": 10.0},
        {"step": 20, "eval/mul/accuracy": 0.9, "eval/started_at": 1415.0, "eval/seconds": 15.0},
    ]
    # Evals between steps (--synchronous, as TRL's): step 0's eval ended before the first rollout; step 10's
    # 15 s come off step 20's time, as TRL's runner takes its evals out of its clock.
    assert eval_curve(metrics, evals, "eval/mul/accuracy", between_steps=True) == [
        (0, 0.2, -10.0),
        (10, 0.8, 200.0),
        (20, 0.9, 400.0),
    ]
    # Background evals: in step order, timed from the first rollout, nothing to take out.
    assert eval_curve(metrics, evals, "eval/mul/accuracy") == [(0, 0.2, -10.0), (10, 0.8, 200.0), (20, 0.9, 415.0)]
    rows = [{"time/step_seconds": 20.0}, {"time/step_seconds": 35.0, "time/eval_seconds": 15.0}]
    assert step_seconds(rows, between_steps=True) == [20.0, 20.0]
    assert step_seconds(rows) == [20.0, 35.0]


@pytest.mark.parametrize("steps,span", [(60, None), (30, 60), (30, 30)])
def test_a_cosine_schedule_gives_trl_our_learning_rate_at_every_step(steps, span):
    """Over the whole run (span None: the run's length) and over a --lr-decay-iters longer than the run."""
    import torch
    from transformers.optimization import get_scheduler

    from miles_async.backends.worker import lr_lambda
    from miles_async.config.train import OptimizerConfig

    extra = ["--steps", str(steps), "--lr", "1e-5", "--lr-schedule", "cosine", "--min-lr", "1e-6"]
    kw = runner.grpo_config_kwargs(_runner_args(*extra, *([] if span is None else ["--lr-decay-iters", str(span)])))
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


def _write_prompts(path, n: int) -> None:
    path.write_text("".join(json.dumps({"prompt": f"What is {i} * 3?", "label": str(3 * i)}) + "\n" for i in range(n)))


def test_trl_trains_on_our_prompts_step_by_step(quickstart, tmp_path):
    from miles_async.config import rollout
    from miles_async.rollout.data_source import DataSource

    data = tmp_path / "train.jsonl"
    _write_prompts(data, 20)

    def on_data(*extra: str):
        return quickstart("--prompt-data", str(data), "--num-rollout", "3", *extra)

    ns = on_data()
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
    other = trl_peer.prompt_sequence(on_data(*trl_peer.seed_args(7)))
    assert other != seq and sorted(r["label"] for r in other[:16]) != sorted(r["label"] for r in seq[:16])
    with pytest.raises(ValueError, match="--dynamic-sampling-filter-path / --zero-variance-filter"):
        trl_peer.prompt_sequence(on_data("--zero-variance-filter", "--over-sampling-batch-size", "16"))
    with pytest.raises(ValueError, match="--rollout-max-prompt-len"):
        trl_peer.prompt_sequence(on_data("--rollout-max-prompt-len", "64"))


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
    # Step 1's means with the seeds' range: ours 0.7 (0.6-0.8) at 11 s, TRL's 0.6 (0.5-0.7) at 42 s.
    assert entry["tables"][2]["rows"][1] == [1, "0.700 (0.600-0.800)", "11", "0.600 (0.500-0.700)", "42"]
    with pytest.raises(ValueError, match="the seeds ran different loops"):
        report.summarize_seeds(2, 1, {"1": SEED_A, "2": {**SEED_B, "mode": "one-step-off"}}, tmp_path)


SEED_LOW = _raw(
    [(0, 0.2, -1.0), (1, 0.5, 10.0), (2, 0.6, 20.0)],
    [(0, 0.2, 0.0), (1, 0.7, 40.0), (2, 0.8, 80.0)],
    [10.0, 10.0],
    [40.0, 40.0],
)


def test_the_headline_explains_a_time_to_accuracy_miss_by_steps_and_by_the_seeds_spread(tmp_path):
    rows = dict(report.headline(report.summarize_seeds(2, 1, {"1": SEED_A, "2": SEED_LOW}, tmp_path)))
    # Mean curves: ours 0.55 at step 1 (10 s) and 0.75 at step 2 (20 s); TRL 0.7 (40 s) and 0.9 (80 s).
    (tta,) = [w for w in rows if "wall time to TRL's final" in w]
    assert rows[tta] == "ours not reached, TRL 80 s; final accuracy 0.75 vs 0.90 (goal: 3x)"
    # Our final 0.75, which TRL's mean first reaches at step 2: 80 s against our 20 s.
    (ours,) = [w for w in rows if "wall time to our final held-out accuracy (0.75)" in w]
    assert rows[ours] == "20 s (step 2) vs 80 s (step 2) (4.00x)"
    # Finals 0.9 and 0.6 (variance 0.045) against 1.0 and 0.8 (0.02): gap 0.15 over sqrt(0.045/2 + 0.02/2).
    (spread,) = [w for w in rows if "by seed" in w]
    assert rows[spread] == "0.90 vs 1.00, 0.60 vs 0.80; gap +0.15, t 0.8 over 2 seeds a side"
    # Where TRL's final is reached, the row gives the step at which each side reached it, and no second level.
    rows = dict(report.headline(report.summarize_seeds(2, 1, {"1": SEED_A, "2": SEED_B}, tmp_path)))
    (tta,) = [w for w in rows if "wall time to TRL's final" in w]
    assert rows[tta] == "22 s (step 2) vs 82 s (step 2) (3.73x); final accuracy 0.90 vs 0.90 (goal: 3x)"
    assert not [w for w in rows if "wall time to our final" in w]


def test_welch_t_is_the_gap_of_the_means_over_its_standard_error():
    # means 2 and 5, variances 1 and 7: standard error sqrt(1/3 + 7/3)
    assert report.welch_t([1.0, 2.0, 3.0], [3.0, 4.0, 8.0]) == pytest.approx(3 / (8 / 3) ** 0.5)
    assert report.welch_t([3.0, 4.0, 8.0], [1.0, 2.0, 3.0]) == pytest.approx(-3 / (8 / 3) ** 0.5)
    assert report.welch_t([1.0], [2.0, 3.0]) is None  # one seed: no spread to measure
    assert report.welch_t([1.0, 1.0], [2.0, 2.0]) is None


def test_from_results_sums_up_an_earlier_seeds_run_and_refuses_mismatched_ones(tmp_path, capsys):
    for seed, raw in (("1", SEED_A), ("2", SEED_B)):
        (tmp_path / f"seed-{seed}.json").write_text(json.dumps(raw))
    out = tmp_path / "out"
    files = [str(tmp_path / "seed-1.json"), str(tmp_path / "seed-2.json")]
    assert trl_peer.main(["--steps", "2", "--eval-interval", "1", "--out", str(out), "--from-results", *files]) == 0
    entry = json.loads((out / "results.json").read_text())
    assert entry["seeds"] == ["1", "2"] and entry["comparison"]["trl"]["median"] == 41.0
    with pytest.raises(SystemExit):  # not a seed's raw result
        trl_peer.main(["--steps", "2", "--out", str(out), "--from-results", str(out / "results.json")])
    with pytest.raises(SystemExit):  # the seeds ran 2 steps
        trl_peer.main(["--steps", "3", "--out", str(out), "--from-results", *files])
    capsys.readouterr()
    with pytest.raises(SystemExit):  # before anything runs
        trl_peer.main(["--seeds", "1", "2", "--out", str(out), "--", "--rollout-seed", "7"])
    assert "leave --rollout-seed out of the launcher flags" in capsys.readouterr().err

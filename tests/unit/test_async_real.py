"""The real async benchmark's account: rates over the steps after the first, each side's idle fraction, the overlap
bound and the gain against it, accuracy at equal wall time, and the long-tail comparison."""

import json

import pytest

from benchmarks import async_real as ar


def _rows(n: int, step: float, train: float, generate: float, samples: int = 64, idle: float | None = 0.25) -> list:
    rows = []
    for i in range(n):
        row = {
            "step": i + 1,
            "train/finished_at": 1000.0 + step * (i + 1),
            "train/seconds": train,
            "time/step_seconds": step,
            "rollout/generate_seconds": generate,
            "rollout/num_samples": samples,
            "rollout/response_len_mean": 6.0 + i,
            "rollout/started_at": 1000.0 + step * i,
        }
        if idle is not None:
            row["engine/idle_frac"] = idle
        rows.append(row)
    return rows


def test_rates_leave_the_first_step_out_and_each_side_idles_for_what_it_did_not_do():
    rows = _rows(5, step=10.0, train=6.0, generate=3.0)
    rows[0]["train/seconds"] = 50.0  # the pipeline's fill: not counted
    s = ar.run_stats(rows, [], synchronous=False)
    assert s["steps"] == 4 and s["samples_per_s"] == pytest.approx(64 / 10.0)
    assert s["trainer_idle"] == pytest.approx(0.4) and s["engine_idle"] == pytest.approx(0.25)
    assert (s["step_median"], s["train_median"], s["generate_median"]) == (10.0, 6.0, 3.0)
    assert s["response_len_mean"] == pytest.approx(8.5) and s["curve"] == []
    assert ar.run_stats(_rows(3, 10.0, 6.0, 3.0, idle=None), [], True)["engine_idle"] is None


def test_a_run_of_one_step_has_no_rate():
    with pytest.raises(ValueError, match="two or more"):
        ar.run_stats(_rows(1, 10.0, 6.0, 3.0), [], synchronous=True)


def test_the_overlap_bound_and_accuracy_at_a_wall_time():
    assert ar.overlap_bound(6.0, 3.0) == pytest.approx(1.5) and ar.overlap_bound(4.0, 4.0) == pytest.approx(2.0)
    curve = [(0, 0.1, -1.0), (5, 0.4, 50.0), (10, 0.7, 100.0)]
    assert ar.accuracy_at(curve, 99.0) == 0.4 and ar.accuracy_at(curve, 100.0) == 0.7
    assert ar.accuracy_at(curve, -5.0) is None


def _stats(step: float, samples_per_s: float, curve_end: float, train: float = 6.0, generate: float = 3.0) -> dict:
    return {
        "samples_per_s": samples_per_s,
        "step_median": step,
        "train_median": train,
        "generate_median": generate,
        "trainer_idle": 0.1,
        "engine_idle": 0.5,
        "response_len_mean": 7.0,
        "response_len_max": 40,
        "curve": [(0, 0.2, -1.0), (5, 0.5, curve_end)],
    }


def test_the_summary_takes_the_gain_against_the_synchronous_pinned_runs_bound():
    stats = {
        ar.MODES[0].name: _stats(9.0, 6.0, 40.0),
        ar.MODES[1].name: _stats(6.5, 8.0, 30.0),
        ar.MODES[2].name: _stats(6.0, 8.8, 31.0),
        ar.MODES[3].name: _stats(7.0, 7.0, 35.0),
    }
    long_tail = {ar.LONG_TAIL[0].name: _stats(20.0, 3.0, 99.0), ar.LONG_TAIL[1].name: _stats(18.0, 3.6, 99.0)}
    entry = ar.summarize(stats, long_tail)
    assert entry["bound"] == pytest.approx(1.5) and entry["one_step_off_gain"] == pytest.approx(9.0 / 6.5)
    assert entry["fraction_of_bound"] == pytest.approx(9.0 / 6.5 / 1.5)
    assert entry["fully_async_vs_one_step_off"] == pytest.approx(1.1) and entry["long_tail_ratio"] == pytest.approx(1.2)
    main, bound, lt = entry["tables"]
    assert main["columns"][-1] == "accuracy at 30 s"  # the shortest run's last eval
    assert [r[-1] for r in main["rows"]] == ["0.200", "0.500", "0.200", "0.200"]
    assert bound["rows"][0][2:] == ["1.50x", "1.38x", "92%"]
    assert [r[1] for r in lt["rows"]] == ["3.00", "3.60"]
    assert ar.headline(entry)[0][1] == "1.38x of a 1.50x bound (92%; goal 90%)"


def test_a_run_kept_with_the_same_flags_and_all_its_steps_is_read_back_not_run(tmp_path):
    mode = ar.MODES[1]
    keep = tmp_path / "kept"
    keep.mkdir()
    rows = _rows(4, step=10.0, train=6.0, generate=3.0)
    (keep / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    flags = ["--num-rollout", "4", "--eval-interval", "5", "--save-interval", "40", "--n-samples-per-eval-prompt", "1"]
    (keep / "flags.json").write_text(json.dumps([*flags, "--no-plot", *mode.flags]))
    # A model and data that do not exist: running would fail.
    stats = ar._measure(mode, 4, 5, tmp_path / "no-model", tmp_path / "no-data", keep, ())
    assert stats["steps"] == 3 and stats["samples_per_s"] == pytest.approx(6.4)
    with pytest.raises(RuntimeError, match="launcher failed"):  # other flags: run again
        ar._measure(mode, 4, 10, tmp_path / "no-model", tmp_path / "no-data", keep, ())

"""The TRL peer's shape set runs what each shape says: both sides get the shape's group size, answer cap and
prompts (through our launcher's flags, which TRL's runner follows), the long answers are asked for and the long
prompts are long; the table reports each shape's ratio against the goal."""

import json

import pytest

from benchmarks import run as bench_run
from benchmarks import trl_peer
from benchmarks import trl_peer_shapes as shapes
from miles_async.assets.arith_dataset import MUL_TEMPLATES, make_multiplication_dataset


def test_each_shape_reaches_both_sides_through_the_launchers_flags():
    env = {"MODEL": "/m", "DATA": "/d", "OUT": "/o", "PATH": "/usr/bin:/bin"}
    ns = trl_peer.launcher_namespace(shapes.Shape(128, 4, 300).launcher_args(), env)
    assert trl_peer.loop_mode(ns) == "synchronous"
    args = trl_peer.peer_args(ns)
    flags = dict(zip(args[::2], args[1::2], strict=True))
    assert flags["--num-generations"] == "4" and flags["--max-completion-length"] == "128"
    assert flags["--eval-max-new-tokens"] == "128" and flags["--prompts-per-step"] == "8"
    assert flags["--eval-samples"] == "1" and flags["--max-tokens-per-micro-batch"] == "8192"
    # a shape with its own micro-batch budget gives it to both sides
    long_answers = next(s for s in shapes.SHAPES if s.name == "128x8x40")
    ns = trl_peer.launcher_namespace(long_answers.launcher_args(), env)
    assert ns.max_tokens_per_gpu == 4096
    assert trl_peer.peer_args(ns)[trl_peer.peer_args(ns).index("--max-tokens-per-micro-batch") + 1] == "4096"


@pytest.mark.parametrize("template", MUL_TEMPLATES)
def test_long_answers_ask_for_the_working_and_short_ones_keep_the_bare_number(template):
    prompt = template.format(a=7, b=8)
    assert shapes.shaped_prompt(prompt, shapes.Shape(8, 8, 40)) == prompt
    long_answer = shapes.shaped_prompt(prompt, shapes.Shape(32, 4, 40))
    assert long_answer.endswith(shapes.WORKING) and "7" in long_answer and "8" in long_answer
    assert "number." not in long_answer.removesuffix(shapes.WORKING)


def test_a_prompt_without_a_bare_number_request_is_refused():
    with pytest.raises(ValueError, match="no bare-number request"):
        shapes.shaped_prompt("What is 7 * 8?", shapes.Shape(32, 4, 40))


def test_long_prompts_are_about_300_tokens_and_keep_labels_and_uids(tmp_path, smollm2):
    source = tmp_path / "src"
    make_multiplication_dataset(source)
    short = shapes.write_shaped_data(source, shapes.Shape(32, 8, 40), tmp_path / "short")
    long = shapes.write_shaped_data(source, shapes.Shape(32, 8, 300), tmp_path / "long")
    for split in ("train.jsonl", "eval.jsonl"):
        a = [json.loads(x) for x in (source / split).read_text().splitlines()]
        b = [json.loads(x) for x in (long / split).read_text().splitlines()]
        assert [(r["uid"], r["label"]) for r in a] == [(r["uid"], r["label"]) for r in b]
        assert all(r["prompt"].startswith(shapes.preamble()) for r in b)
    assert 30 < shapes.prompt_tokens(smollm2, short) < 60
    assert 250 < shapes.prompt_tokens(smollm2, long) < 350


def _raw(ours: list[float], trl: list[float]) -> dict:
    return {
        "ours": {"step_seconds": ours, "response_len_mean": [20.0, 30.0]},
        "trl": {"step_seconds": trl, "response_len_mean": [32.0, None]},
        "prompt_tokens": 301.4,
    }


def _bound(seconds: float) -> dict:
    phase = {"seconds": seconds, "bound_seconds": seconds / 4, "fraction": 0.25}
    phases = {"train fwd+bwd": phase}
    return {"phases": phases, "seconds": seconds, "bound_seconds": seconds / 4, "peak": 4e11, "bandwidth": 4e10}


def test_a_missed_shape_says_what_fraction_of_its_steps_roofline_the_goal_needs():
    # ours 8 s, TRL 20 s: 5x needs 4 s; the step's phases can take no less than 2 s here, so 5x needs 50% of it
    row = shapes.shape_row(shapes.Shape(32, 4, 40), {**_raw([8.0], [20.0]), "roofline": _bound(8.0)})
    assert row["ratio"] == pytest.approx(2.5) and row["bound_seconds"] == 2.0
    assert row["ours_fraction"] == pytest.approx(0.25) and row["goal_fraction"] == pytest.approx(0.5)
    entry = shapes.summarize([row], steps=1)
    assert entry["tables"][0]["rows"][0][6:] == ["2.0", "25%", "50%", "missed"]
    assert entry["notes"] == [
        "32x4x40: 5x TRL's 20.0 s needs our step at 4.0 s, 50% of the least time its phases can take here (2.0 s at "
        "400 GFLOP/s and 40 GB/s); it runs at 25%. Its phases in the roofline's run (8.0 s in all): train fwd+bwd "
        "8.0 s (25% of its 2.00 s)."
    ]
    assert shapes.headline(entry)[0][1] == (
        "8.0 s vs 20.0 s (2.50x; goal 5x); our step at 25% of its roofline bound (2.0 s), 5x needs 50%"
    )
    # the roofline runs at the lengths the run had: its mean prompt, our mean answer
    s = shapes.roofline_settings(shapes.Shape(32, 4, 300), _raw([8.0], [20.0]))
    assert (s.prompts, s.samples, s.prompt_len, s.response_len) == (8, 4, 301, 25)


def test_the_table_gives_each_shapes_median_ratio_against_the_goal():
    met = shapes.shape_row(shapes.Shape(8, 8, 40), _raw([2.0, 3.0, 100.0], [20.0, 16.0, 15.0]))
    missed = shapes.shape_row(shapes.Shape(32, 8, 300), _raw([5.0, 5.0, 5.0], [9.0, 10.0, 11.0]))
    assert met["ratio"] == pytest.approx(16.0 / 3.0) and missed["ratio"] == pytest.approx(2.0)
    assert met["ours_answer_tokens"] == 25.0 and met["trl_answer_tokens"] == 32.0
    entry = shapes.summarize([met, missed], steps=3)
    rows = entry["tables"][0]["rows"]
    assert rows[0][0] == "8x8x40" and rows[0][4] == "5.33x" and rows[0][-1] == "met"
    assert rows[1][2:5] == ["5.0", "10.0", "2.00x"] and rows[1][-1] == "missed"
    assert rows[1][6:9] == ["-", "-", "-"] and entry["notes"] == []  # no roofline measured: nothing to explain
    fewer = shapes.shape_row(shapes.Shape(32, 8, 300, trl_steps=2), _raw([5.0, 5.0, 5.0], [9.0, 11.0]))
    assert shapes.summarize([fewer], steps=3)["tables"][0]["rows"][0][3] == "10.0 (3 / 2 steps)"
    assert [r[1] for r in shapes.headline(entry)] == [
        "3.0 s vs 16.0 s (5.33x; goal 5x)",
        "5.0 s vs 10.0 s (2.00x; goal 5x)",
    ]


def test_benchmarks_run_takes_names_comma_separated():
    assert bench_run._names("roofline,trl_peer_shapes") == ["roofline", "trl_peer_shapes"]
    with pytest.raises(Exception, match="not a benchmark"):
        bench_run._names("roofline,nope")


def test_a_kept_shape_is_read_back_only_for_its_flags_and_all_its_steps(tmp_path):
    """The set takes hours on 2 cores: a shape kept from an earlier invocation is reused, unless it ran other flags
    or was cut short."""
    shape, path = shapes.Shape(32, 4, 40), tmp_path / "32x4x40.json"
    raw = {
        "launcher_args": shape.launcher_args(),
        "ours": {"step_seconds": [1.0] * 3},
        "trl": {"step_seconds": [2.0] * 3},
    }
    path.write_text(json.dumps(raw))
    assert shapes._kept(path, shape, 3) == raw
    assert shapes._kept(path, shape, 10) is None  # cut short
    assert shapes._kept(path, shapes.Shape(32, 8, 40), 3) is None  # another shape's flags
    assert shapes._kept(tmp_path / "none.json", shape, 3) is None
    # a shape whose TRL side runs fewer steps is whole with that many
    slow = shapes.Shape(32, 8, 300, trl_steps=2)
    path.write_text(json.dumps({**raw, "launcher_args": slow.launcher_args(), "trl": {"step_seconds": [9.0] * 2}}))
    assert shapes._kept(path, slow, 3) is not None and shapes._kept(path, shape, 3) is None

import dataclasses
import json
import struct

import pytest

from miles_async.arguments import parse_args
from miles_async.utils.plots import plot_run
from miles_async.utils.tracking import Tracker, read_jsonl


def _config(tiny_model, tiny_task, out, *extra):
    train, held_out = tiny_task
    return parse_args(
        [
            "--hf-checkpoint",
            str(tiny_model),
            "--prompt-data",
            str(train),
            "--eval-prompt-data",
            "mul",
            str(held_out),
            "--use-tis",
            "--rm-type",
            "integer",
            "--rollout-batch-size",
            "8",
            "--n-samples-per-prompt",
            "4",
            "--num-rollout",
            "4",
            "--lr",
            "3e-3",
            "--output-dir",
            str(out),
            *extra,
        ]
    )


def _wandb_records(run_dir):
    """Every record of an offline wandb run, read from its ``.wandb`` file (LevelDB log framing: 32 KiB
    blocks of chunks with a 7-byte header, each record a wandb ``Record`` protobuf)."""
    from wandb.proto import wandb_internal_pb2

    data = next(run_dir.glob("*.wandb")).read_bytes()
    assert data[:4] == b":W&B"
    pos, chunks, block = 7, b"", 32 * 1024
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def _finished_wandb_records(run_dir, timeout: float = 120.0) -> list:
    """The run's records once wandb's writer has written its exit record: ``finish()`` can return while
    wandb's service process is still flushing the file, and a read then sees a truncated run record."""
    import time

    from google.protobuf.message import DecodeError

    deadline = time.monotonic() + timeout
    while True:
        try:
            records = list(_wandb_records(run_dir))
        except DecodeError:
            records = []
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        assert time.monotonic() < deadline, f"wandb wrote no exit record to {run_dir} within {timeout} s"
        time.sleep(0.2)


def test_jsonl_tensorboard_and_plot(tiny_model, tiny_task, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    t = Tracker(_config(tiny_model, tiny_task, tmp_path, "--use-tensorboard"))
    for step in range(1, 4):
        t.log(step, {"rollout/reward_mean": step / 4, "train/loss": float("nan")})
    t.log(0, {"eval/mul/accuracy": 0.1}, kind="eval")
    t.log(3, {"eval/mul/accuracy": 0.5}, kind="eval")
    t.log(4, {"rollout/reward_mean": 1.0})
    t.close()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[0]["train/loss"] is None  # NaN is not valid JSON
    assert "eval/mul/accuracy" not in rows[0]
    assert rows[3]["eval/mul/accuracy"] == 0.5 and rows[3]["eval/step"] == 3
    assert json.loads((tmp_path / "eval.jsonl").read_text().splitlines()[1])["eval/mul/accuracy"] == 0.5
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    # the accuracy the train line repeats is not a second tensorboard point at the training step
    assert [(e.step, e.value) for e in events.Scalars("eval/mul/accuracy")] == [
        (0, pytest.approx(0.1)),
        (3, pytest.approx(0.5)),
    ]
    assert [e.step for e in events.Scalars("rollout/reward_mean")] == [1, 2, 3, 4]
    png = plot_run(tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_wandb_offline_run_keeps_config_and_late_evals_on_their_own_step(tiny_model, tiny_task, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = _config(tiny_model, tiny_task, tmp_path, "--use-wandb", "--wandb-run-name", "offline-run")
    t = Tracker(cfg)
    for step in (1, 2, 3):
        t.log(step, {"rollout/reward_mean": step / 4, "train/loss": 0.5})
    t.log(0, {"eval/mul/accuracy": 0.1, "eval/seconds": 2.0}, kind="eval")  # arrives after step 3
    t.log(2, {"eval/mul/accuracy": 0.5, "eval/seconds": 2.0}, kind="eval")
    t.log(4, {"rollout/reward_mean": 1.0, "train/loss": 0.25})
    t.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    records = _finished_wandb_records(runs[0])

    logged_config = {
        item.key: json.loads(item.value_json)
        for r in records
        if r.WhichOneof("record_type") == "run"
        for item in r.run.config.update
    }
    expected = json.loads(json.dumps(dataclasses.asdict(cfg)))
    assert {k: logged_config.get(k) for k in expected} == expected
    assert logged_config["train"]["optimizer"]["lr"] == 3e-3

    history = [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    assert [(h["eval/step"], h["eval/mul/accuracy"]) for h in history if "eval/step" in h] == [(0, 0.1), (2, 0.5)]
    assert [(h["train/step"], h["rollout/reward_mean"]) for h in history if "train/step" in h] == [
        (1, 0.25),
        (2, 0.5),
        (3, 0.75),
        (4, 1.0),
    ]
    axes = {
        r.metric.glob_name or r.metric.name: r.metric.step_metric
        for r in records
        if r.WhichOneof("record_type") == "metric"
    }
    assert axes["eval/*"] == "eval/step"
    assert axes["rollout/*"] == axes["train/*"] == "train/step"

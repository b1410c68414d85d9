import json

from miles_async.config import TrackingConfig
from miles_async.utils.plots import plot_run
from miles_async.utils.tracking import Tracker, read_jsonl


def test_jsonl_tensorboard_and_plot(tmp_path):
    cfg = TrackingConfig(str(tmp_path), False, "p", None, None, True, None, True)
    t = Tracker(cfg)
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
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    png = plot_run(tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_wandb_runs_offline_without_a_key(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = TrackingConfig(str(tmp_path), True, "miles-async-test", None, "offline-run", False, None, False)
    t = Tracker(cfg, run_config={"lr": 1e-3})
    t.log(1, {"rollout/reward_mean": 0.5})
    t.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))

"""The end-of-run picture: reward and eval accuracy per step."""

from __future__ import annotations

from pathlib import Path

from miles_async.utils.tracking import read_jsonl


def plot_run(output_dir: str | Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(output_dir)
    train = read_jsonl(out / "metrics.jsonl")
    evals = read_jsonl(out / "eval.jsonl")
    if not train and not evals:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot([r["step"] for r in train], [r.get("rollout/reward_mean") for r in train], label="train reward (mean)")
    for key in sorted({k for r in evals for k in r if k.endswith("/accuracy")}):
        pts = [(r["step"], r[key]) for r in evals if r.get(key) is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=key)
    ax.set_xlabel("rollout (training step)")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = out / "reward_and_accuracy.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

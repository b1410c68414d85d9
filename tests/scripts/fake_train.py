"""Stand-in training command for the Slurm script tests: joins the Ray cluster the script
started, reports what it sees, and honours the save sentinel the way train_async.py does
(save after the current step, then delete the file).

Reads the flags the Slurm script appends; FAKE_TRAIN_DIR is where it writes report.json
and where the test drops a "finish" file to end the run (holding the exit status).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ray-address", required=True)
    p.add_argument("--save", required=True)
    p.add_argument("--save-trigger-sentinel", required=True)
    p.add_argument("--load", default=None)
    p.add_argument("--max-seconds", type=float, default=120)
    args, unknown = p.parse_known_args()
    work = Path(os.environ["FAKE_TRAIN_DIR"])

    import ray

    ray.init(address=args.ray_address, logging_level=logging.ERROR, log_to_driver=False)
    nodes = [n for n in ray.nodes() if n["Alive"]]
    report = {
        "argv": sys.argv[1:],
        "unknown": unknown,
        "load": args.load,
        "gpus": ray.cluster_resources().get("GPU", 0),
        "nodes": len(nodes),
        "node_gpus": sorted(n["Resources"].get("GPU", 0) for n in nodes),
        "saves": 0,
    }
    write_json(work / "report.json", report)
    print("[fake_train] joined the cluster:", report, flush=True)

    sentinel, save = Path(args.save_trigger_sentinel), Path(args.save)
    deadline = time.monotonic() + args.max_seconds
    step = 0
    while time.monotonic() < deadline:
        step += 1
        time.sleep(0.2)  # one "training step"
        if sentinel.exists():
            save.mkdir(parents=True, exist_ok=True)
            (save / "latest_checkpointed_iteration.txt").write_text(str(step))
            sentinel.unlink()
            report["saves"] += 1
            write_json(work / "report.json", report)
            print(f"[fake_train] saved at step {step} on the sentinel", flush=True)
        if (work / "finish").exists():  # its text, if any, is the exit status
            return int((work / "finish").read_text().strip() or 0)
    print("[fake_train] no finish file within --max-seconds", flush=True)
    return 3


if __name__ == "__main__":
    sys.exit(main())

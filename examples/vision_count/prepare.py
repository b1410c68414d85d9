"""The example's model, built once and cached: SmolLM2 converted, the VLM assembled (``model.py``), then the
supervised warm-up (``warmup.py``, ``WARMUP_STEPS`` steps on ``sft.jsonl``). Prints the warmed-up folder.

    python -m examples.vision_count.prepare --data DIR [--cache-dir DIR]

Both folders appear by an atomic rename, under a file lock, so concurrent callers build once.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import shutil
import tempfile
import time
from pathlib import Path

from examples.vision_count.model import build_vlm
from examples.vision_count.warmup import WARMUP_STEPS, Counter
from miles_async.assets.smollm2 import default_cache_dir, prepare_smollm2

INIT = "SmolLM2-vision-count-init"
WARM = f"SmolLM2-vision-count-sft{WARMUP_STEPS}"


def _build(target: Path, make) -> Path:
    """``make(tmp)`` fills a temporary folder beside ``target``, which then becomes ``target``."""
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").is_file():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            make(tmp)
            tmp.rename(target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(tmp)
    return target


def prepare(data_dir: Path, cache_dir: Path | None = None) -> Path:
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    smollm2 = prepare_smollm2(cache)
    init = _build(cache / "models" / INIT, lambda out: build_vlm(smollm2, out))

    def warm_up(out: Path) -> None:
        t0 = time.perf_counter()
        counter = Counter(init, data_dir)
        counter.train(seed=0, steps=WARMUP_STEPS, seconds=None, curve=out / "warmup.jsonl", every_s=1e9)
        counter.model.save_pretrained(out)
        counter.processor.save_pretrained(out)
        (out / "warmup_seconds.txt").write_text(f"{time.perf_counter() - t0:.0f}\n")

    return _build(cache / "models" / WARM, warm_up)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="the folder data.py wrote")
    parser.add_argument("--cache-dir", type=Path, default=None, help="default: $MILES_ASYNC_CACHE or ~/.cache/...")
    args = parser.parse_args()
    print(prepare(args.data, args.cache_dir))


if __name__ == "__main__":
    main()

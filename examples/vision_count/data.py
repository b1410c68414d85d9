"""The example's images and prompts: count the shapes in a picture, drawn with PIL.

Each image is 112x112 pixels: one to four filled shapes (squares, discs, triangles) of random size, colour and
place on a dark background, none overlapping. The question is the same for every image and the answer a digit,
checked by ``--rm-type integer``. Three splits from disjoint seeds:

- ``sft.jsonl``: the few labelled images the supervised warm-up (``warmup.py``) sees;
- ``train.jsonl``: the RL prompts, whose labels only the reward reads;
- ``eval.jsonl``: held out from both.

    python -m examples.vision_count.data --out DIR   # writes DIR/{sft,train,eval}.jsonl and DIR/images/
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SIZE = 112
MAX_COUNT = 4
QUESTION = "How many shapes? Answer with one digit."
SPLITS = {"sft": (1, 96), "train": (2, 2000), "eval": (3, 200)}  # name: (seed, images)


def _place(rng: random.Random, taken: list[tuple[int, int, int, int]]) -> tuple[int, int, int, int]:
    """A box of 16-26 pixels inside the image, clear of ``taken`` by 3 pixels (so shapes never touch)."""
    for _ in range(1000):
        s = rng.randint(16, 26)
        x, y = rng.randint(2, SIZE - s - 2), rng.randint(2, SIZE - s - 2)
        if all(x + s + 3 <= a or a + c + 3 <= x or y + s + 3 <= b or b + c + 3 <= y for a, b, c, _ in taken):
            return x, y, s, s
    raise RuntimeError("no room for another shape")  # four boxes of 26 px always fit in 112 px


def draw(rng: random.Random, count: int):
    """An image of ``count`` shapes (PIL)."""
    from PIL import Image, ImageDraw

    shade = rng.randint(0, 50)
    image = Image.new("RGB", (SIZE, SIZE), (shade, shade, shade))
    pen = ImageDraw.Draw(image)
    taken: list[tuple[int, int, int, int]] = []
    for _ in range(count):
        x, y, s, _ = box = _place(rng, taken)
        taken.append(box)
        colour = tuple(rng.randint(110, 255) for _ in range(3))
        kind = rng.choice(("square", "disc", "triangle"))
        if kind == "square":
            pen.rectangle((x, y, x + s, y + s), fill=colour)
        elif kind == "disc":
            pen.ellipse((x, y, x + s, y + s), fill=colour)
        else:
            pen.polygon(((x, y + s), (x + s, y + s), (x + s // 2, y)), fill=colour)
    return image


def write_split(out_dir: Path, name: str, seed: int, n: int) -> Path:
    """``n`` records of ``name`` (counts balanced, order shuffled), their PNGs under ``out_dir/images/name``."""
    rng = random.Random(seed)
    counts = [1 + i % MAX_COUNT for i in range(n)]
    rng.shuffle(counts)
    image_dir = out_dir / "images" / name
    image_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.jsonl"
    with open(path, "w", encoding="utf-8") as fh:
        for i, count in enumerate(counts):
            rel = f"images/{name}/{i:05d}.png"
            draw(rng, count).save(out_dir / rel)
            rec = {"uid": f"{name}-{i}", "prompt": QUESTION, "images": [rel], "label": str(count)}
            fh.write(json.dumps(rec) + "\n")
    return path


def make_dataset(out_dir: Path) -> Path:
    """All three splits under ``out_dir``; skipped when a finished copy is there (the splits are fixed by seed)."""
    out_dir = Path(out_dir)
    done = out_dir / "COMPLETE"
    if not done.is_file():
        for name, (seed, n) in SPLITS.items():
            write_split(out_dir, name, seed, n)
        done.write_text(json.dumps({k: v[1] for k, v in SPLITS.items()}) + "\n")
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the splits and their images")
    print(make_dataset(parser.parse_args().out))


if __name__ == "__main__":
    main()

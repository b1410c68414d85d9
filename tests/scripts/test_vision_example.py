"""examples/vision_count: the pictures hold the number of shapes their label says, the VLM assembled around a Llama
computes the Llama's logits on text (``build_vlm`` checks it before saving), and run.sh's exact command passes
``train_async.py --check-config`` on that model and the example's data. The RL run itself and its control are
measured by ``python -m examples.vision_count.study`` (docs/examples/vision-count.md), not here."""

from __future__ import annotations

import json
import random
import sys

import pytest

from examples.vision_count.data import MAX_COUNT, SIZE, draw, write_split
from tests.scripts.test_launchers import _env, _run, _words

SCRIPT = "examples/vision_count/run.sh"


def _blobs(image) -> int:
    """Connected regions of pixels brighter than any background (4-neighbour flood fill)."""
    px = image.convert("L").load()
    seen: set[tuple[int, int]] = set()
    count = 0
    for x in range(SIZE):
        for y in range(SIZE):
            if (x, y) in seen or px[x, y] <= 60:
                continue
            count += 1
            stack = [(x, y)]
            while stack:
                p = stack.pop()
                if p in seen or not (0 <= p[0] < SIZE and 0 <= p[1] < SIZE) or px[p] <= 60:
                    continue
                seen.add(p)
                stack += [(p[0] + 1, p[1]), (p[0] - 1, p[1]), (p[0], p[1] + 1), (p[0], p[1] - 1)]
    return count


def test_each_picture_holds_as_many_shapes_as_its_label(tmp_path):
    rng = random.Random(0)
    for count in [1 + i % MAX_COUNT for i in range(24)]:
        assert _blobs(draw(rng, count)) == count
    path = write_split(tmp_path, "eval", seed=3, n=8)
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert sorted(r["label"] for r in recs) == ["1", "1", "2", "2", "3", "3", "4", "4"]  # balanced
    from PIL import Image

    for r in recs:
        assert _blobs(Image.open(tmp_path / r["images"][0])) == int(r["label"])


@pytest.fixture(scope="module")
def example_model(tiny_model, tmp_path_factory):
    """The example's VLM assembled around the tiny Llama (the real SmolLM2 takes the same path at 576 wide, and
    costs a conversion): ``build_vlm`` refuses to save unless its text logits equal the Llama's."""
    from examples.vision_count.model import build_vlm

    return build_vlm(tiny_model, tmp_path_factory.mktemp("vision_count_init"))


def test_run_sh_passes_check_config_on_the_assembled_model(example_model, tmp_path):
    data = tmp_path / "data"
    write_split(data, "train", seed=2, n=32)
    write_split(data, "eval", seed=3, n=8)
    env = _env({"MODEL": str(example_model), "DATA": str(data), "OUT": str(tmp_path / "out"), "PYTHON": sys.executable})
    dry = _run(SCRIPT, env, ["--dry-run"])
    assert dry.returncode == 0, dry.stderr
    words = _words(dry.stdout)
    assert words[words.index("--multimodal-keys") + 1] == '{"image": "images"}'
    assert words[words.index("--only-train-params-name-list") + 1] == "visual"
    proc = _run(SCRIPT, env, ["--check-config"], timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.rstrip().endswith("check-config: OK, the run would start")
    wrong = _run(SCRIPT, env, ["--check-config", "--multimodal-keys", '{"image": "pictures"}'], timeout=240)
    assert wrong.returncode != 0 and "'pictures'" in wrong.stderr and "train.jsonl:1" in wrong.stderr
    assert not (tmp_path / "out").exists()

"""A vision-language model on SGLang's and vLLM's real CPU servers: a tiny random VLM's image prompts (two sizes and a
text-only prompt in one batch) get the engine log-probs the torch backend computes, the images count (another image of
the same size changes them), and a weight update that moves only the vision tower reaches the engine (SGLang's tensor
route, vLLM's disk route: the one each has). SGLang serves a Qwen2.5-VL with the real models' 14-pixel patches (the
layout of the Qwen2.5-VL launcher, which runs SGLang), and each engine a Qwen3-VL (16-pixel patches, learned vision
positions as strong as the patches' features, deepstack; its rotary frequencies interleaved, as a real Qwen3-VL's config
says: without ``mrope_interleaved`` both engines took Qwen2-VL's blocks and differed from the trainer on every image
prompt, 2026-12-06). ``MILES_ASYNC_ALL_VLM_LAYOUTS=1`` adds the other layouts (vLLM's Qwen2-VL and Qwen2.5-VL, SGLang's
Qwen2-VL).

Both engines expand each image's placeholder themselves: the client sends one placeholder per image
(``inference/vlm_requests.py``). vLLM gets the images as data: URIs through ``/inference/v1/generate``'s
``content_parts``; its processor imports torchvision, made importable by ``inference/vllm/cpu_shims``. The tiny
model's heads are 32 wide: vLLM's CPU attention has no kernel for 16.

SGLang's side of a VLM, and what the tiny model adapts to (a real Qwen2-VL checkpoint already has each):
* its processor loads the checkpoint's video processor (torchvision: importable through cpu_shims/sitecustomize.py),
  which transformers 5 finds in ``preprocessor_config.json``; its Qwen2-VL builds the tower from
  ``vision_config.in_chans``;
* for a ``qwen2_vl`` model SGLang replaces the processor's image size rule by Qwen2-VL's default (at least
  56x56 = 3136 pixels, at most 1003520; ``sglang/srt/utils/hf_transformers/processor.py``), so the tiny model's
  processor takes that rule too and the images here need no resizing (sides multiples of 8, area >= 3136);
* the client sends one placeholder per image, which SGLang expands (``SGLangEngineClient.generate``);
* SGLang's Qwen2.5-VL takes pixel rows of any width but 1176 (3 x 2 x 14 x 14) for precomputed embeddings
  (``Qwen2_5_VLForConditionalGeneration.get_image_feature``): its tiny model's patches are 14 pixels.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
import torch

from miles_async.arguments import parse_args
from miles_async.inference.engines import make_client, make_engine_process
from miles_async.rollout.batch import to_train_batch
from miles_async.rollout.data_source import PromptItem
from miles_async.rollout.generate import encode_item
from miles_async.rollout.sample import Sample
from miles_async.weights.update import WeightUpdate, route_for
from tests.tolerance import StepBounds, assert_rejected, assert_within

# The tiny VLM layouts (layout, patch size): the real models' patches (14, 16) where an engine assumes them, 4 (the
# tiny default, 49 placeholders an image) where none does.
LAYOUTS = {"qwen2_vl": ("qwen2_vl", 4), "qwen2_5_vl": ("qwen2_5_vl", 14), "qwen3_vl": ("qwen3_vl", 16)}
# What the suite runs (its time budget, docs/testing.md): SGLang a Qwen2.5-VL and a Qwen3-VL, vLLM a Qwen3-VL.
# MILES_ASYNC_ALL_VLM_LAYOUTS=1 runs every layout on every engine (six servers, about 5 minutes on 2 cores; all passed
# on 2026-12-06, docs/guides/vision.md).
PAIRS = [("sglang", "qwen2_5_vl"), ("sglang", "qwen3_vl"), ("vllm", "qwen3_vl")]
if os.environ.get("MILES_ASYNC_ALL_VLM_LAYOUTS") == "1":
    PAIRS = [(backend, layout) for backend in ("sglang", "vllm") for layout in LAYOUTS]
# Each patch size's square image side (at least 56: SGLang's area rule), and its placeholders once patches merge 2x2.
SIDE = {4: 56, 14: 56, 16: 64}
PLACEHOLDERS = {4: 49, 14: 4, 16: 4}
# Red, green and yellow: the same size, so the same tokens; blue half as wide again. (width, height) in sides.
IMAGES = {
    "red.png": ((1, 1), (220, 30, 30)),
    "blue.png": ((1.5, 1), (20, 40, 230)),
    "green.png": ((1, 1), (0, 200, 0)),
    "yellow.png": ((1, 1), (230, 220, 0)),
}
GREEDY = {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}


@pytest.fixture
def layout(family: str) -> tuple[str, int]:
    return LAYOUTS[family]


@pytest.fixture
def vlm(layout, tmp_path_factory) -> Path:
    """The tiny VLM with SGLang's image size rule for Qwen2-VL, a legacy preprocessor_config.json and ``in_chans``, as
    real Qwen-VL checkpoints have them."""
    from miles_async.assets.tiny_vlm import make_tiny_vlm

    arch, patch = layout
    out = make_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm_engines"), seed=0, arch=arch, head_dim=32, patch_size=patch)
    proc = json.loads((out / "processor_config.json").read_text())
    proc["image_processor"]["size"] = {"shortest_edge": 3136, "longest_edge": 1003520}
    (out / "processor_config.json").write_text(json.dumps(proc, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps(proc["image_processor"], indent=2))
    config = json.loads((out / "config.json").read_text())
    config["vision_config"]["in_chans"] = 3
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


@pytest.fixture
def images(layout, tmp_path_factory) -> dict[str, str]:
    from PIL import Image

    root, side = tmp_path_factory.mktemp("vlm_engine_images"), SIDE[layout[1]]
    for name, ((w, h), color) in IMAGES.items():
        img = Image.new("RGB", (int(w * side), int(h * side)), color)
        img.putpixel((1, 1), (255, 255, 255))  # not flat: the tower's attention sees differing patches
        img.save(root / name)
    return {name: str(root / name) for name in IMAGES}


def _generate(engine, requests):
    async def go():
        async with make_client(engine.cfg.backend, engine.url, 120, engine.cfg.api_key) as c:
            return await asyncio.gather(*[c.generate(ids, GREEDY, image_data=imgs or None) for ids, imgs in requests])

    return asyncio.run(go())


def _engine_logprobs(outputs) -> dict[int, list[float]]:
    return {i: [x[0] for x in o["meta_info"]["output_token_logprobs"]] for i, o in enumerate(outputs)}


def _trainer_logprobs(actor, rows) -> dict[int, list[float]]:
    samples = [
        Sample(uid=str(i), group_index=i, index=0, prompt="", prompt_tokens=p, response_tokens=r, images=imgs, reward=0)
        for i, (p, imgs, r) in enumerate(rows)
    ]
    return actor._logprobs_of(actor.module, to_train_batch([[s] for s in samples]), list(range(len(samples))), 1.0)


def _update_tower(actor, engine, backend: str, folder: Path) -> None:
    """The actor's weights into the engine at version 2, by the engine's route: SGLang's shared-memory tensors, vLLM's
    checkpoint folder."""
    if backend == "sglang":
        actor.push_weights(
            WeightUpdate(version=2, route=route_for("tensor", backend), dtype="float32", timeout=60,
                         targets=(engine.url,), engine=backend, bucket_bytes=64 * 1024, api_key=engine.cfg.api_key)
        )  # fmt: skip
        return
    actor.save_weights_for_engines(
        WeightUpdate(version=2, route="disk", dtype="float32", timeout=60, folder=str(folder))
    )

    async def load():
        async with make_client(backend, engine.url, 120, engine.cfg.api_key) as c:
            await c.pause("in_place")
            res = await c.update_weights_from_disk(str(folder), 2)
            await c.resume()
            return res

    assert asyncio.run(load())["success"]


@pytest.mark.parametrize("backend, family", PAIRS, indirect=["backend"])
def test_the_engine_serves_a_vlm_and_its_vision_tower_updates(backend, engine_python, layout, vlm, images, tmp_path):
    from transformers import AutoTokenizer

    from miles_async.backends.fsdp.actor import FSDPTrainActor
    from miles_async.vision.hf import load_processor

    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "what color?", "images": [images["red.png"]], "label": "1"}) + "\n")
    cfg = parse_args(
        ["--hf-checkpoint", str(vlm), "--prompt-data", str(data), "--multimodal-keys", '{"image": "images"}',
         "--apply-chat-template", "--rollout-batch-size", "1", "--n-samples-per-prompt", "2", "--num-rollout", "1",
         "--rm-type", "first_integer", "--rollout-dtype", "float32", "--use-tis", "--rollout-backend", backend,
         f"--{backend}-python", engine_python, "--engine-startup-timeout", "400",
         "--output-dir", str(tmp_path / "out")]
    )  # fmt: skip
    tok, processor = AutoTokenizer.from_pretrained(vlm), load_processor(str(vlm))

    def encode(prompt: str, imgs: list[str]) -> list[int]:
        item = PromptItem(uid="0", prompt=prompt, label="", metadata={}, images=tuple(imgs))
        return encode_item(tok, processor, item, True)

    requests = [
        (encode("what color?", [images["red.png"]]), [images["red.png"]]),
        (encode("and this one?", [images["blue.png"]]), [images["blue.png"]]),
        (encode("say 7", []), []),
        (encode("what color?", [images["green.png"]]), [images["green.png"]]),  # red's tokens, another image
    ]
    image_token = json.loads((vlm / "config.json").read_text())["image_token_id"]
    assert requests[0][0] == requests[3][0] and requests[0][0].count(image_token) == PLACEHOLDERS[layout[1]]
    actor = FSDPTrainActor(cfg.train, rank=0, world_size=1, total_optimizer_steps=10)
    with make_engine_process(cfg.engine, 0, str(tmp_path / "logs")) as engine:
        try:
            before = _generate(engine, requests)
            rows = [(ids, imgs, o["output_ids"]) for (ids, imgs), o in zip(requests, before)]
            assert [o["meta_info"]["prompt_tokens"] for o in before] == [len(ids) for ids, _ in requests]
            tol = StepBounds.of(vlm, [p + r for p, _, r in rows]).logprob
            engine_lp = _engine_logprobs(before)
            assert_within(engine_lp, _trainer_logprobs(actor, rows), tol, f"{backend} vs trainer log-probs")
            # The images count: red's tokens and response with green's pixels must not match the engine's for red.
            swapped = {0: _trainer_logprobs(actor, [(rows[0][0], [images["green.png"]], rows[0][2])])[0]}
            assert_rejected(swapped, {0: engine_lp[0]}, tol, "the same tokens with another image")

            with torch.no_grad():  # move the vision tower only: only its update changes the image prompts
                for name, p in actor.module.named_parameters():
                    if ".visual." in f".{name}":
                        p.add_(torch.randn_like(p) * 0.5)
            _update_tower(actor, engine, backend, tmp_path / "v2")
            late = (requests[0][0], [images["yellow.png"]])  # an image the engine has not seen before
            after = _generate(engine, [requests[0], late])
        finally:
            actor._weight_sender.close()
    assert after[0]["meta_info"]["weight_version"] == 2
    new_rows = [(ids, imgs, o["output_ids"]) for (ids, imgs), o in zip([requests[0], late], after)]
    trained = _trainer_logprobs(actor, new_rows)
    # Both the image seen before the update (SGLang would reuse its old embeddings unless its VLM cache is off: the
    # launcher's SGLANG_VLM_CACHE_SIZE_MB=0) and a new one.
    assert_within(_engine_logprobs(after), trained, tol, f"{backend} vs trainer log-probs after the tower's update")
    # The tower's update changed what the engine computes for the image prompt.
    assert_rejected({0: engine_lp[0]}, {0: _engine_logprobs(after)[0]}, tol, "the engine's log-probs before the update")

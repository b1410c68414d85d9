"""A vision-language model end to end on the embedded engine and the torch backend, with a tiny random Qwen2-VL:
the engine's log-probs for image prompts equal the trainer's, a weight update reaches the vision tower, and bad
image input is refused with errors naming the record."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from miles_async.arguments import parse_args
from miles_async.inference.client import EngineClient, EngineError
from miles_async.inference.embedded.launcher import EmbeddedEngineProcess
from miles_async.rollout.batch import to_train_batch
from miles_async.rollout.data_source import DataError, load_prompts
from miles_async.rollout.generate import encode_item
from miles_async.rollout.sample import Sample
from miles_async.vision.hf import load_processor
from miles_async.weights.update import WeightUpdate
from tests.tolerance import StepBounds, assert_rejected, assert_within

# Two images of different sizes (8x8 and 4x2 patches: 16 and 2 placeholder tokens) and a text-only prompt share the
# engine's batch and the trainer's micro-batch. The larger image's 3-D positions span 4 where its tokens span 16: a
# decode step without the rope delta is 12 positions off.
IMAGES = {
    "red.png": ((32, 32), (220, 30, 30)),
    "blue.png": ((16, 8), (20, 40, 230)),
    "green.png": ((32, 32), (0, 200, 0)),
}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    from PIL import Image

    root = tmp_path_factory.mktemp("vlm_data")
    for name, (size, color) in IMAGES.items():
        img = Image.new("RGB", size, color)
        img.putpixel((1, 1), (255, 255, 255))  # not flat: the tower's attention sees differing patches
        img.save(root / name)
    records = [
        {"prompt": "what color?", "images": ["red.png"], "label": "red"},
        {"prompt": "and this one?", "images": ["blue.png"], "label": "blue"},
        {"prompt": "say 7", "images": [], "label": "7"},
    ]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return root


def _cfg(model: Path, data: Path, out: Path):
    return parse_args(
        [
            "--use-tis",
            "--num-rollout",
            "4",
            "--hf-checkpoint",
            str(model),
            "--prompt-data",
            str(data / "train.jsonl"),
            "--multimodal-keys",
            '{"image": "images"}',
            "--apply-chat-template",
            "--rollout-batch-size",
            "1",
            "--n-samples-per-prompt",
            "2",
            "--rm-type",
            "first_integer",
            "--rollout-dtype",
            "float32",
            "--lr",
            "5e-2",
            "--update-weight-buffer-size",
            "20000",
            "--output-dir",
            str(out),
        ]
    )


@pytest.fixture(scope="module")
def cfg(tiny_vlm, data, tmp_path_factory):
    return _cfg(tiny_vlm, data, tmp_path_factory.mktemp("vlm_out"))


@pytest.fixture(scope="module")
def engine(cfg, tmp_path_factory):
    with EmbeddedEngineProcess(cfg.engine, 0, str(tmp_path_factory.mktemp("vlm_engine"))) as proc:
        yield proc


@pytest.fixture(scope="module")
def prompts(cfg, tiny_vlm):
    """The dataset's items and their prompt tokens, as the rollout makes them."""
    from transformers import AutoTokenizer

    items = load_prompts(cfg.rollout.data.path, "prompt", "label", image_key=cfg.rollout.data.image_key)
    processor = load_processor(str(tiny_vlm))
    tok = AutoTokenizer.from_pretrained(tiny_vlm)
    return [(item, encode_item(tok, processor, item, True)) for item in items]


def _generate(engine, cfg, requests: list[tuple[list[int], list[str]]], n_tokens: int = 6) -> list[dict]:
    async def go():
        async with EngineClient(engine.url, timeout=60, api_key=cfg.engine.api_key) as c:
            return await asyncio.gather(
                *[
                    c.generate(ids, {"temperature": 1.0, "max_new_tokens": n_tokens}, image_data=images)
                    for ids, images in requests
                ]
            )

    return asyncio.run(go())


def _trainer_logprobs(actor, rows: list[tuple[list[int], list[str], list[int]]]) -> dict[int, list[float]]:
    samples = [
        Sample(uid=str(i), group_index=i, index=0, prompt="", prompt_tokens=p, response_tokens=r, images=imgs, reward=0)
        for i, (p, imgs, r) in enumerate(rows)
    ]
    batch = to_train_batch([[s] for s in samples])
    return actor._logprobs_of(actor.module, batch, list(range(len(samples))), 1.0)


def _engine_logprobs(outputs: list[dict]) -> dict[int, list[float]]:
    return {i: [x[0] for x in o["meta_info"]["output_token_logprobs"]] for i, o in enumerate(outputs)}


def _train_and_push(actor, rows, outputs: list[dict], cfg, engine, version: int, steps: int = 2) -> None:
    """Train ``actor`` a few steps rewarding a one-token cut of each output over the output itself, then push its
    weights to ``engine`` as ``version``."""
    logprobs = _engine_logprobs(outputs)
    groups = [
        [
            Sample(
                uid=str(g),
                group_index=g,
                index=i,
                prompt="",
                prompt_tokens=p,
                response_tokens=r[:n],
                rollout_logprobs=logprobs[g][:n],  # --use-tis weighs by them
                images=imgs,
                reward=float(i),
            )
            for i, n in enumerate([len(r), 1])
        ]
        for g, (p, imgs, r) in enumerate(rows)
    ]
    batch = to_train_batch(groups)
    for step in range(steps):
        actor.train(step, batch)
    update = WeightUpdate(
        version=version,
        route="http",
        dtype="float32",
        timeout=60,
        targets=(engine.url,),
        bucket_bytes=cfg.train.update_weight_buffer_size,
        api_key=cfg.engine.api_key,
    )
    assert actor.push_weights(update)["weights/bytes"] > 0


def test_engine_and_trainer_logprobs_agree_on_image_prompts_and_updates_reach_the_tower(
    cfg, engine, prompts, tiny_vlm, data
):
    """The key check of a VLM: the engine (vision tower at prefill, 3-D positions, a KV cache across decode steps)
    and the trainer (whole rows, pixels from the same processor) give the same per-token log-probs. Negative
    control: the trainer's log-probs with another image of the same size (the same tokens) must not pass. Then a
    trained policy's weights, the vision tower's included, reach the engine, and the log-probs agree again, also
    for a sample resumed from its partial response."""
    from miles_async.backends.fsdp.actor import FSDPTrainActor

    requests = [(ids, list(item.images)) for item, ids in prompts]
    # The first prompt's tokens with another image of the same size: the engine must not share its prefill.
    requests.append((prompts[0][1], [str(data / "green.png")]))
    outputs = _generate(engine, cfg, requests)
    rows = [(ids, imgs, o["output_ids"]) for (ids, imgs), o in zip(requests, outputs)]
    actor = FSDPTrainActor(cfg.train, rank=0, world_size=1, total_optimizer_steps=10)
    tol = StepBounds.of(tiny_vlm, [p + r for p, _, r in rows]).logprob
    assert_within(_engine_logprobs(outputs), _trainer_logprobs(actor, rows), tol, "engine vs trainer log-probs")
    other = [(rows[0][0], [str(data / "green.png")], rows[0][2])]  # red.png's size: the same tokens
    stale = {0: _trainer_logprobs(actor, other)[0]}
    assert_rejected(stale, {0: _engine_logprobs(outputs)[0]}, tol, "the same tokens with another image")

    tower = {n: p.detach().clone() for n, p in actor.module.named_parameters() if ".visual." in f".{n}"}
    _train_and_push(actor, rows, outputs, cfg, engine, version=2)
    moved = [n for n, p in actor.module.named_parameters() if n in tower and not p.detach().equal(tower[n])]
    assert moved, "training moved no parameter of the vision tower"
    after = _generate(engine, cfg, requests)
    assert all(o["meta_info"]["weight_version"] == 2 for o in after)
    rows = [(ids, imgs, o["output_ids"]) for (ids, imgs), o in zip(requests, after)]
    trained = _trainer_logprobs(actor, rows)
    assert_within(_engine_logprobs(after), trained, tol, "engine vs trainer log-probs after the update")

    # A partial rollout resumed: the engine continues prompt + response so far with the prompt's images, and its
    # 3-D positions carry on from the image's, as the trainer's do over the whole row.
    ids, images = requests[0]
    first = _generate(engine, cfg, [(ids, images)], n_tokens=3)[0]
    rest = _generate(engine, cfg, [(ids + first["output_ids"], images)], n_tokens=3)[0]
    resumed = {0: _engine_logprobs([first])[0] + _engine_logprobs([rest])[0]}
    whole = _trainer_logprobs(actor, [(ids, images, first["output_ids"] + rest["output_ids"])])
    assert_within(resumed, whole, tol, "a resumed image sample's log-probs vs the trainer's")


def test_qwen3_vl_engine_and_trainer_agree_before_and_after_an_update(tiny_vlm_3, data, prompts, tmp_path):
    """Qwen3-VL's layout (learned vision position embeddings, deepstack features added to the first decoder
    layer): the embedded engine's log-probs for image prompts equal the trainer's, before and after a step whose
    weights, the tower's included, reach the engine."""
    from miles_async.backends.fsdp.actor import FSDPTrainActor

    cfg = _cfg(tiny_vlm_3, data, tmp_path / "out")
    requests = [(ids, list(item.images)) for item, ids in prompts]  # the same tokenizer and processor
    with EmbeddedEngineProcess(cfg.engine, 0, str(tmp_path / "engine")) as engine:
        outputs = _generate(engine, cfg, requests)
        rows = [(ids, imgs, o["output_ids"]) for (ids, imgs), o in zip(requests, outputs)]
        actor = FSDPTrainActor(cfg.train, rank=0, world_size=1, total_optimizer_steps=10)
        tol = StepBounds.of(tiny_vlm_3, [p + r for p, _, r in rows]).logprob
        assert_within(_engine_logprobs(outputs), _trainer_logprobs(actor, rows), tol, "Qwen3-VL engine vs trainer")
        _train_and_push(actor, rows, outputs, cfg, engine, version=2)
        after = _generate(engine, cfg, requests)
        assert all(o["meta_info"]["weight_version"] == 2 for o in after)
        rows = [(ids, imgs, o["output_ids"]) for (ids, imgs), o in zip(requests, after)]
        trained = _trainer_logprobs(actor, rows)
        assert_within(_engine_logprobs(after), trained, tol, "Qwen3-VL engine vs trainer after the update")
        base = FSDPTrainActor(cfg.train, rank=0, world_size=1, total_optimizer_steps=10)
        assert_rejected(_trainer_logprobs(base, rows), trained, tol, "the log-probs of the weights before the step")


def test_lora_on_the_language_model_reaches_the_engine(cfg, engine, prompts, tiny_vlm):
    """--lora-rank on a VLM: adapters on the language model only (the vision tower takes none and stays as
    loaded), and the merged weights the engine gets give the trainer's log-probs for image prompts."""
    import dataclasses

    from miles_async.backends.fsdp.actor import FSDPTrainActor
    from miles_async.config.train import LoraSettings

    lora = LoraSettings(4, 16.0, 0.0, ("all-linear",), False)
    actor = FSDPTrainActor(dataclasses.replace(cfg.train, lora=lora), rank=0, world_size=1, total_optimizer_steps=10)
    adapted = [n for n, _ in actor.module.named_parameters() if ".lora_" in n]
    assert adapted and all(n.startswith("model.language_model.") for n in adapted), adapted
    requests = [(ids, list(item.images)) for item, ids in prompts]
    outputs = _generate(engine, cfg, requests)
    rows = [(ids, imgs, o["output_ids"]) for (ids, imgs), o in zip(requests, outputs)]
    _train_and_push(actor, rows, outputs, cfg, engine, version=5)
    after = _generate(engine, cfg, requests)
    assert all(o["meta_info"]["weight_version"] == 5 for o in after)
    rows = [(ids, imgs, o["output_ids"]) for (ids, imgs), o in zip(requests, after)]
    tol = StepBounds.of(tiny_vlm, [p + r for p, _, r in rows]).logprob
    trained = _trainer_logprobs(actor, rows)
    assert_within(_engine_logprobs(after), trained, tol, "engine vs LoRA trainer log-probs")
    # Negative control: the adapters moved the log-probs beyond the tolerance, so unmerged weights would fail.
    base = FSDPTrainActor(cfg.train, rank=0, world_size=1, total_optimizer_steps=10)
    assert_rejected(_trainer_logprobs(base, rows), trained, tol, "the log-probs without the adapters")


@pytest.mark.parametrize("model", ["tiny_vlm", "tiny_vlm_2_5", "tiny_vlm_3"])
def test_engine_decode_positions_are_the_trainers(model, prompts, request):
    """Qwen2-VL's 3-D positions: the engine's prefill and each decode step (1-D position plus the row's rope delta)
    give every token the position the trainer's whole-row ``get_rope_index`` gives it, for a large image (delta
    -12), a small one and no image, left padded in one batch. (The tiny random model is nearly blind to positions,
    so the log-prob comparisons alone would let an offset of a few positions pass.) Qwen2-VL and Qwen2.5-VL: the
    prompts' tokens are the same, their processors being the same."""
    import torch

    from miles_async.backends.fsdp.vision import VisionInputs
    from miles_async.backends.packing import collate
    from miles_async.inference.embedded.batch import prefill_inputs
    from miles_async.inference.embedded.model import CausalLM
    from miles_async.inference.embedded.records import SamplingParams, Seq
    from miles_async.inference.embedded.vision import decode_positions, prepare_images, vision_prefill

    tiny_vlm = request.getfixturevalue(model)
    lm = CausalLM(str(tiny_vlm), torch.float32)
    response = [10, 11, 12, 13]
    seqs = []
    for item, ids in prompts:
        images = prepare_images(lm, list(item.images), ids) if item.images else None
        seqs.append(
            Seq(
                rid="r",
                prompt=ids,
                params=SamplingParams(),
                future=None,
                submitted_at=0.0,
                image_refs=images.refs if images else (),
                pixels=images.pixels if images else None,
            )
        )
    ids, mask, flat = prefill_inputs([tuple(s.prompt) for s in seqs], lm.pad_id)
    engine_prefill, _ = vision_prefill(lm, seqs, ids, mask)
    assert [s.rope_delta for s in seqs] == [-12, 0, 0]  # the 1x2 merged patches of blue span 2 positions

    mb = collate([s.prompt for s in seqs], [response] * 3, [[1] * 4] * 3, lm.pad_id)
    VisionInputs(str(tiny_vlm), lm.model).attach(mb, [list(item.images) for item, _ in prompts], ["a", "b", "c"])
    p = ids.shape[1]
    assert torch.equal(mb.position_ids[:, :, :p], engine_prefill)
    for step in range(len(response)):
        one_d = torch.tensor([[len(s.prompt) + step] for s in seqs])  # the batch's 1-D position of the step's token
        assert torch.equal(decode_positions(seqs, one_d)[:, :, 0], mb.position_ids[:, :, p + step]), step

    # The engine's prefill (vision tower included) predicts the first response token as the trainer's forward does.
    with torch.inference_mode():
        _, pixels = vision_prefill(lm, seqs, ids, mask)
        engine = lm.forward(ids, mask, engine_prefill, lm.new_cache(), last_only=True, pixels=pixels)
        out = lm.model(
            input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids, **mb.pixels
        )
    tol = StepBounds.of(tiny_vlm, [s.prompt for s in seqs]).logprob
    assert_within(engine.log_softmax(-1), out.logits[:, p - 1].float().log_softmax(-1), tol, "prefill log-probs")


@pytest.mark.parametrize(
    "selection, trains_vision",
    [
        (dict(freeze_vision_tower=True), False),
        (dict(only_train_params=("visual",)), True),  # --only-train-params-name-list visual
        (dict(freeze_params=(r"^model\.language_model\.",)), True),  # --freeze-params-name-list
    ],
    ids=["freeze-vision-tower", "only-train-visual", "freeze-language-model"],
)
def test_a_step_moves_only_the_selected_weights(cfg, prompts, selection, trains_vision):
    """--freeze-vision-tower trains the language model only; --only-train-params-name-list visual and
    --freeze-params-name-list on the language model train the vision tower only: a step moves the selected
    weights, and every other weight stays as loaded."""
    import dataclasses

    from miles_async.backends.fsdp.actor import FSDPTrainActor

    actor = FSDPTrainActor(dataclasses.replace(cfg.train, **selection), rank=0, world_size=1, total_optimizer_steps=10)
    before = {n: p.detach().clone() for n, p in actor.module.named_parameters()}
    (item, ids) = prompts[0]
    samples = [
        Sample(
            uid="0",
            group_index=0,
            index=i,
            prompt="",
            prompt_tokens=ids,
            response_tokens=[10 + i, 11],
            rollout_logprobs=[-3.0, -3.0],
            images=list(item.images),
            reward=float(i),
        )
        for i in range(2)
    ]
    actor.train(0, to_train_batch([samples]))
    changed = {n for n, p in actor.module.named_parameters() if not p.detach().equal(before[n])}
    vision = {n for n in changed if ".visual." in f".{n}"}
    assert changed and (vision == changed if trains_vision else not vision), sorted(changed)


def test_bad_image_requests_are_refused(cfg, engine, prompts):
    """/generate names image_data's problem: an unreadable image, images whose patches do not fill the prompt's
    placeholders, and placeholders sent without their images."""
    (_, ids), (blue, _) = prompts[0], prompts[1]
    with pytest.raises(EngineError, match=r"image_data: \[0\]: image file not found"):
        _generate(engine, cfg, [(ids, ["/nonexistent.png"])])
    with pytest.raises(EngineError, match="image_data: input_ids hold 16 image placeholder tokens .* fill 2"):
        _generate(engine, cfg, [(ids, list(blue.images))])
    with pytest.raises(EngineError, match="image_data: input_ids hold 16 image placeholder tokens .* and no image_"):
        _generate(engine, cfg, [(ids, [])])


def _trained_sample(g: int, i: int, ids: list[int], images: list[str], response: list[int], reward: float) -> Sample:
    """Sample ``i`` of group ``g``, with the engine log-probs --use-tis weighs by."""
    return Sample(
        uid=f"{g}-{i}",
        group_index=g,
        index=i,
        prompt="",
        prompt_tokens=ids,
        response_tokens=response,
        rollout_logprobs=[-3.0] * len(response),
        images=images,
        reward=reward,
    )


def test_shared_prefix_shares_a_prompt_with_its_images_and_keeps_each_rows_positions(cfg, prompts, tiny_vlm, data):
    """--shared-prefix on a VLM: the samples of a group share one copy of their prompt, image placeholders included,
    while the same tokens with another image of the same size form a sequence of their own. Every token keeps the
    3-D position its own row gives it (``get_rope_index`` on the unpadded sample), and the log-probs and one step's
    gradients equal those of one row per sample. Negative control: the red and green groups (the same tokens) get
    log-probs apart, so each group's log-probs matching its own row means each saw its own image."""
    import dataclasses

    import torch

    from miles_async.backends.fsdp.actor import FSDPTrainActor
    from miles_async.vision.rope import row_positions
    from tests.integration.test_data_parallel import record_torch_step
    from tests.tolerance import assert_same_first_step

    (red, red_ids), (blue, blue_ids), (_, text_ids) = prompts
    prompt_rows = [(red_ids, list(red.images)), (blue_ids, list(blue.images)), (red_ids, [str(data / "green.png")])]
    prompt_rows.append((text_ids, []))
    responses = [[10, 11], [12, 13, 14]]
    groups = [
        [_trained_sample(g, i, ids, imgs, resp, float(i)) for i, resp in enumerate(responses)]
        for g, (ids, imgs) in enumerate(prompt_rows)
    ]
    batch = to_train_batch(groups)
    idx = list(range(len(batch.tokens)))
    roomy = dataclasses.replace(cfg.train, max_tokens_per_gpu=4096)  # one micro-batch for both layouts
    shared = FSDPTrainActor(roomy, rank=0, world_size=1, total_optimizer_steps=10)
    one_row = FSDPTrainActor(
        dataclasses.replace(roomy, shared_prefix=False), rank=0, world_size=1, total_optimizer_steps=10
    )
    assert shared._shares_prefix and not one_row._shares_prefix
    (rows,) = shared._micro_batches(batch, idx)
    mb = shared._collate(batch, rows)
    layout = mb.shared
    assert layout.input_ids.shape[0] == 4, "one sequence per prompt and images: red and green apart"
    assert layout.pixels["image_grid_thw"].shape[0] == 3  # red, blue and green once each; the text prompt none

    for g in range(layout.input_ids.shape[0]):
        for c in range(layout.input_ids.shape[1]):
            row, pos = int(layout.source_row[g, c]), int(layout.source_pos[g, c])
            if pos < 0:
                continue
            refs = batch.images[row]
            grid = shared._vision.pixels_of(refs)["image_grid_thw"] if refs else None
            want, _ = row_positions(shared.module, batch.tokens[row], grid)
            assert torch.equal(layout.position_ids[:, g, c], want[:, pos]), (g, c, row, pos)

    def logprobs(actor):
        return actor._per_sample(lambda mb: actor._forward(actor.model, mb)[0], batch, idx)

    bounds = StepBounds.of(tiny_vlm, batch.tokens, group_size=2)
    a, b = logprobs(shared), logprobs(one_row)
    assert_within(a, b, bounds.logprob, "VLM log-probs, shared prefix vs one row per sample")
    red_rows, green_rows = [0, 1], [4, 5]
    assert_rejected(
        {i: a[r] for i, r in enumerate(red_rows)},
        {i: a[g] for i, g in enumerate(green_rows)},
        bounds.logprob,
        "the red group's log-probs vs the green group's (the same tokens)",
    )

    first_shared, first_rows = record_torch_step(shared), record_torch_step(one_row)
    shared.train(0, batch)
    one_row.train(0, batch)
    assert_same_first_step(first_rows, first_shared, bounds)


def _fsdp2_steps(rank: int, world: int, port: int, train_cfgs: dict, batch, out: Path) -> None:
    """One rank of ``world``, for each config: its shard's log-probs (every rank's gathered), then one optimizer
    step recorded."""
    import torch

    from miles_async.backends.data_parallel import all_gather_dict, shard
    from miles_async.backends.fsdp.actor import FSDPTrainActor
    from tests.integration.test_data_parallel import record_torch_step

    report = {}
    for name, train_cfg in train_cfgs.items():
        torch.manual_seed(0)
        actor = FSDPTrainActor(train_cfg, rank, world, total_optimizer_steps=10)
        actor.init_process_group("127.0.0.1", port)  # one process group: the second actor joins the first's
        _, mine = shard(len(batch.tokens), train_cfg.global_batch_size, actor.dp)
        logprobs = all_gather_dict(actor._logprobs_of(actor.module, batch, mine, 1.0), actor.dp)
        first = record_torch_step(actor)
        actor.train(0, batch)
        report[name] = {"logprobs": logprobs, "step": first}
    if rank == 0:
        torch.save(report, out)


def test_two_fsdp2_workers_match_one_on_image_and_text_samples(prompts, tiny_vlm, tiny_vlm_3, data, tmp_path):
    """FSDP2 shards the vision tower block by block, so a rank must run it whenever another does, images or not:
    the samples alternate image and text prompts, so one rank holds only image samples and the other only text.
    The pair's log-probs and first step equal one worker's within tests/tolerance.py's float32 bounds, for
    Qwen2-VL and for Qwen3-VL (whose deepstack mergers and learned positions train beside the tower's blocks)."""
    import dataclasses

    import torch

    from tests.ports import spawn_ranks
    from tests.tolerance import assert_same_first_step

    (red, red_ids), (blue, blue_ids), (_, text_ids) = prompts
    rows = [(red_ids, list(red.images)), (text_ids, []), (blue_ids, list(blue.images)), (text_ids, [])]
    samples = [
        _trained_sample(g, 0, ids, imgs, [10 + g, 11, 12][: 2 + g % 2], float(g % 3 == 0))
        for g, (ids, imgs) in enumerate(rows)
    ]
    batch = to_train_batch([[s] for s in samples])
    # Groups of one (so the two ranks' samples differ in kind): REINFORCE++ normalizes over the batch, where GRPO
    # would give every singleton group an advantage of 0.
    models = {"qwen2_vl": tiny_vlm, "qwen3_vl": tiny_vlm_3}
    train_cfgs = {}
    for name, model in models.items():
        train = _cfg(model, data, tmp_path / name).train
        algorithm = dataclasses.replace(train.algorithm, advantage_estimator="reinforce_plus_plus")
        train_cfgs[name] = dataclasses.replace(train, global_batch_size=4, algorithm=algorithm)
    for world in (1, 2):
        out = tmp_path / f"{world}.pt"
        assert spawn_ranks(_fsdp2_steps, world, train_cfgs, batch, out, timeout=150) == [0] * world
    one, two = torch.load(tmp_path / "1.pt"), torch.load(tmp_path / "2.pt")
    for name, model in models.items():
        bounds = StepBounds.of(model, batch.tokens)
        assert_within(two[name]["logprobs"], one[name]["logprobs"], bounds.logprob, f"{name}: 2 workers vs 1")
        assert_same_first_step(one[name]["step"], two[name]["step"], bounds)


def _write(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_bad_image_data_names_file_line_and_key(tmp_path, data, tiny_vlm):
    """A missing file, an unreadable image, a wrong key and an image count that does not match the placeholders
    each fail naming the data file, the record's line and the key."""
    from transformers import AutoTokenizer

    (tmp_path / "broken.png").write_bytes(b"not an image")
    ok = {"prompt": "hi", "images": [str(data / "red.png")]}
    cases = [
        ({"prompt": "hi", "images": ["missing.png"]}, r"bad.jsonl:2: 'images'\[0\]: image file not found: missing.png"),
        ({"prompt": "hi", "images": ["broken.png"]}, r"bad.jsonl:2: 'images'\[0\]: not a readable image: broken.png"),
        ({"prompt": "hi", "pictures": ["red.png"]}, r"bad.jsonl:2: missing key 'images' \(--multimodal-keys"),
        ({"prompt": "hi", "images": [7]}, r"bad.jsonl:2: 'images' \(--multimodal-keys\) must be an image reference"),
    ]
    for record, message in cases:
        path = _write(tmp_path / "bad.jsonl", [ok, record])
        with pytest.raises(DataError, match=message):
            load_prompts(path, "prompt", None, image_key="images")
    # Two placeholders written in the prompt, one image: found when the prompt is tokenized.
    text = "<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|image_pad|><|vision_end|>two?"
    items = load_prompts(
        _write(tmp_path / "bad.jsonl", [ok, {**ok, "prompt": text}]), "prompt", None, None, image_key="images"
    )
    tok = AutoTokenizer.from_pretrained(tiny_vlm)
    with pytest.raises(DataError, match=r"bad.jsonl:2: the prompt has 2 image placeholder\(s\) .* for 1 image"):
        encode_item(tok, load_processor(str(tiny_vlm)), items[1], False)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--train-backend", "megatron"], "--multimodal-keys.*megatron.*no vision tower"),
        (["--advantage-estimator", "ppo"], "--multimodal-keys with --advantage-estimator ppo: the critic"),
    ],
)
def test_vision_language_runs_refuse_what_does_not_carry_images(tiny_vlm, tiny_model, data, extra, message):
    from miles_async.config.declare import ConfigError

    base = ["--prompt-data", str(data / "train.jsonl"), "--multimodal-keys", '{"image": "images"}', "--use-tis"]
    base += ["--num-rollout", "4", "--rollout-batch-size", "1", "--rm-type", "first_integer"]
    with pytest.raises(ConfigError, match=message):
        parse_args(["--hf-checkpoint", str(tiny_vlm), *base, *extra])
    # The eval datasets' records load their images from the same column as the training data's.
    assert parse_args(["--hf-checkpoint", str(tiny_vlm), *base]).eval.image_key == "images"
    with pytest.raises(ConfigError, match="--multimodal-keys: --hf-checkpoint .* has no vision tower"):
        parse_args(["--hf-checkpoint", str(tiny_model), *base])

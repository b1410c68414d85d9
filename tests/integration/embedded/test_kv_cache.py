"""The embedded engine's cache appends in place and decodes what the model says: rows decoded past several
reallocations, merged into a running batch, repeated (a group's prefill) and dropped (a finished row) give
transformers' own greedy tokens, while the cache's storage is reallocated a few times rather than once a token."""

from __future__ import annotations

from pathlib import Path

import torch

from miles_async.inference.embedded.batch import KVBatch, prefill_inputs
from miles_async.inference.embedded.kv_cache import GrowingLayer, new_cache, select_rows, spare_columns
from miles_async.inference.embedded.model import CausalLM
from miles_async.inference.embedded.records import SamplingParams, Seq
from tests.integration.embedded.helpers import hf_greedy, load_local, make_prompts

NEW_TOKENS = 90  # past the first reallocation's spare columns, and the second's


def _prefill(
    lm: CausalLM, prompts: list[list[int]], repeat: list[int], first_rid: int = 0
) -> tuple[list[Seq], object, torch.Tensor]:
    """The engine's admission: each distinct prompt prefilled once, its cache rows repeated as ``repeat`` says."""
    ids, mask, positions = prefill_inputs([tuple(p) for p in prompts], lm.pad_id)
    cache = new_cache(lm.config)  # the lever itself, whatever the engine's default (GROWING_KV_CACHE)
    logits = lm.forward(ids, mask, positions, cache, last_only=True)
    idx = torch.tensor(repeat)
    select_rows(cache, idx)
    seqs = [
        Seq(f"r{first_rid + i}", list(prompts[row]), SamplingParams(), future=None, submitted_at=0.0)
        for i, row in enumerate(repeat)
    ]
    for seq, tok in zip(seqs, logits.index_select(0, idx).argmax(-1).tolist()):
        seq.output.append(tok)
    return seqs, cache, mask.index_select(0, idx)


def test_rows_decode_greedy_through_reallocations_merges_and_drops(model_dirs: dict[str, Path]) -> None:
    lm = CausalLM(str(model_dirs["base"]), torch.float32)
    prompts = make_prompts(5)
    batch = KVBatch()
    with torch.inference_mode():
        # Two prompts of other lengths, the first twice over (a GRPO group's copies share one prefill).
        seqs, cache, mask = _prefill(lm, prompts[:2], [0, 1, 0])
        assert all(isinstance(layer, GrowingLayer) for layer in cache.layers)
        batch.add(seqs, cache, mask)
        storages = {batch.cache.layers[0].keys.untyped_storage().data_ptr()}
        for step in range(NEW_TOKENS - 1):
            if step == 10:  # a request arriving while the batch decodes is merged into it
                late, cache, mask = _prefill(lm, [prompts[4]], [0], first_rid=3)
                batch.add(late, cache, mask)
            if step == 40:  # a finished row leaves; columns that only it used are trimmed
                batch.rows[1].finished = True
                batch.drop_finished()
            last, positions, mask = batch.step_inputs()
            logits = lm.forward(last, mask, positions, batch.cache, last_only=False)
            for seq, tok in zip(batch.rows, logits.argmax(-1).tolist()):
                if len(seq.output) < NEW_TOKENS:
                    seq.output.append(tok)
            storages.add(batch.cache.layers[0].keys.untyped_storage().data_ptr())

    ref = load_local(model_dirs["base"])
    done = {s.rid: s for s in seqs + late}
    assert len(done["r1"].output) == 41  # dropped after its 41st token
    for rid, prompt in (("r0", prompts[0]), ("r2", prompts[0]), ("r1", prompts[1]), ("r3", prompts[4])):
        got = done[rid].output
        want = hf_greedy(ref, prompt, len(got))
        # hf_greedy stops at EOS; these prompts' answers run long enough to cross the reallocations
        assert len(want) > 60 or rid == "r1", (rid, len(want))
        assert got[: len(want)] == want, rid
    # One storage a token would be ~90; the prefill, the merge, the drop and a few reallocations make a handful.
    assert len(storages) <= 8, len(storages)


def test_a_reallocation_leaves_spare_columns_and_appends_go_into_them() -> None:
    layer = GrowingLayer()
    first = torch.randn(2, 3, 40, 4)
    keys, _ = layer.update(first, first.clone())
    assert torch.equal(keys, first)
    storage = layer.keys.untyped_storage().data_ptr()
    added = []
    for _ in range(spare_columns(40)):
        added.append(torch.randn(2, 3, 1, 4))
        layer.update(added[-1], added[-1].clone())
    assert layer.keys.untyped_storage().data_ptr() == storage  # every append fitted in place
    layer.update(torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4))
    assert layer.keys.untyped_storage().data_ptr() != storage  # the first that did not fit reallocated
    assert torch.equal(layer.keys[:, :, :40], first)
    assert torch.equal(layer.keys[:, :, 40:-1], torch.cat(added, dim=2))
    assert layer.get_seq_length() == 40 + spare_columns(40) + 1

    # Rows kept in another order, repeated, and the first columns trimmed: what a DynamicLayer's copy gives.
    before = layer.keys.clone()
    select_rows_of = torch.tensor([1, 1, 0])
    layer.select(select_rows_of, first_column=5)
    assert torch.equal(layer.keys, before.index_select(0, select_rows_of)[:, :, 5:])
    storage = layer.keys.untyped_storage().data_ptr()
    layer.update(torch.zeros(3, 3, 1, 4), torch.zeros(3, 3, 1, 4))
    assert layer.keys.untyped_storage().data_ptr() == storage  # the selection kept its spare columns

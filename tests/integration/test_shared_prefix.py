"""--shared-prefix on a tiny real model: the policy's log-probs and one training step's gradients equal those of
one row per sample, with fewer micro-batches under the same --max-tokens-per-gpu (no Ray)."""

from __future__ import annotations

import pytest
import torch

from miles_async.backends.fsdp.actor import FSDPTrainActor, response_logits
from miles_async.backends.packing import collate
from tests.integration.test_algorithms_in_trainer import _batch, _cfg


def _actor(cfg) -> FSDPTrainActor:
    torch.manual_seed(0)
    return FSDPTrainActor(cfg.train, 0, 1, total_optimizer_steps=4)


def test_shared_prefix_trains_like_one_row_per_sample(tiny_model, tiny_task, tmp_path):
    budget = ("--use-tis", "--max-tokens-per-gpu", "64")
    shared = _actor(_cfg(tiny_model, tiny_task, tmp_path, *budget))
    rows = _actor(_cfg(tiny_model, tiny_task, tmp_path, *budget, "--no-shared-prefix"))
    assert shared._shares_prefix and not rows._shares_prefix
    batch = _batch()
    idx = list(range(len(batch.tokens)))
    # Four prompts of 3-6 tokens, four samples each: the shared layout needs fewer passes for the same budget.
    assert len(shared._micro_batches(batch, idx)) < len(rows._micro_batches(batch, idx))
    mb = shared._collate(batch, shared._micro_batches(batch, idx)[0])
    assert mb.shared.input_ids.shape[0] < mb.input_ids.shape[0]  # fewer sequences than samples

    def logprobs(actor):
        return actor._per_sample(lambda mb: actor._forward(actor.model, mb)[0], batch, idx)

    a, b = logprobs(shared), logprobs(rows)
    for i in idx:
        assert torch.allclose(torch.tensor(a[i]), torch.tensor(b[i]), atol=1e-5), i

    # (train/loss is a mean over micro-batches, which differ; the step's gradient is the whole step's.)
    m_shared, m_rows = shared.train(0, batch), rows.train(0, batch)
    assert m_shared["train/grad_norm"] == pytest.approx(m_rows["train/grad_norm"], rel=1e-4)
    for (name, p), q in zip(shared.module.named_parameters(), rows.module.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-3, atol=1e-6), name


def test_eager_attention_takes_the_same_block_mask(tiny_model):
    """HF's eager attention adds the mask to the scores: the shared layout gives it an additive mask."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="eager").eval()
    prompts, responses = [[7, 8, 9, 10]] * 3 + [[11, 12]], [[13, 14], [15], [16, 17, 18], [19, 20]]
    masks = [[1] * len(r) for r in responses]
    with torch.no_grad():
        cpu = torch.device("cpu")
        one = response_logits(model, collate(prompts, responses, masks), cpu, "eager")
        shared = response_logits(model, collate(prompts, responses, masks, share_prefix=True), cpu, "eager")
    for i, r in enumerate(responses):
        assert torch.allclose(shared[i, : len(r)], one[i, : len(r)], atol=1e-4), i

"""--shared-prefix on a tiny real model: the policy's log-probs and one training step's gradients equal those of
one row per sample, with fewer micro-batches under the same --max-tokens-per-gpu (no Ray); the shared layout's passes
run through the attention that computes only the blocks its mask opens (backends/fsdp/prefix_attention.py)."""

from __future__ import annotations

import pytest
import torch

from miles_async.backends.fsdp.actor import FSDPTrainActor, response_hidden
from miles_async.backends.fsdp.prefix_attention import SHARED_PREFIX_SDPA
from miles_async.backends.packing import collate
from tests.integration.test_algorithms_in_trainer import _batch, _cfg
from tests.integration.test_data_parallel import record_torch_step
from tests.tolerance import (
    StepBounds,
    assert_rejected,
    assert_same_first_step,
    assert_within,
    forward_tolerance,
    transformer_depth,
)


def _actor(cfg) -> FSDPTrainActor:
    torch.manual_seed(0)
    return FSDPTrainActor(cfg.train, 0, 1, total_optimizer_steps=4)


@pytest.mark.parametrize("split", [True, False], ids=["attention-split", "attention-dense"])
def test_shared_prefix_trains_like_one_row_per_sample(tiny_model, tiny_task, tmp_path, monkeypatch, split):
    """Both ways the shared layout's attention runs: split into the blocks its mask opens (forced here: the tiny
    batch's groups are too small for it to pay) and HF's sdpa on the whole mask."""
    import miles_async.backends.fsdp.prefix_attention as prefix_attention

    monkeypatch.setattr(prefix_attention, "MIN_SCORE_RATIO", 0.0 if split else float("inf"))
    budget = ("--use-tis", "--max-tokens-per-gpu", "64")
    shared = _actor(_cfg(tiny_model, tiny_task, tmp_path, *budget))
    rows = _actor(_cfg(tiny_model, tiny_task, tmp_path, *budget, "--no-shared-prefix"))
    assert shared._shares_prefix and not rows._shares_prefix
    # the shared layout's passes run the attention that skips its closed blocks (prefix_attention.py)
    assert shared.module.config._attn_implementation == SHARED_PREFIX_SDPA
    assert rows.module.config._attn_implementation == "sdpa"
    batch = _batch()
    idx = list(range(len(batch.tokens)))
    # Four prompts of 3-6 tokens, four samples each: the shared layout needs fewer passes for the same budget.
    assert len(shared._micro_batches(batch, idx)) < len(rows._micro_batches(batch, idx))
    mb = shared._collate(batch, shared._micro_batches(batch, idx)[0])
    assert mb.shared.input_ids.shape[0] < mb.input_ids.shape[0]  # fewer sequences than samples

    def logprobs(actor):
        return actor._per_sample(lambda mb: actor._forward(actor.model, mb)[0], batch, idx)

    # The shared layout sums the same terms in other orders (one prompt's keys and values serve several samples):
    # log-probs, gradients and the step agree within tests/tolerance.py's float32 bounds.
    bounds = StepBounds.of(tiny_model, batch.tokens, group_size=4)
    a, b = logprobs(shared), logprobs(rows)
    assert_within(a, b, bounds.logprob, "log-probs, shared prefix vs one row per sample")
    assert_rejected({i: lp[1:] + lp[:1] for i, lp in a.items()}, b, bounds.logprob, "log-probs shifted by one")

    # (train/loss is a mean over micro-batches, which differ; the step's gradient is the whole step's.)
    first_shared, first_rows = record_torch_step(shared), record_torch_step(rows)
    shared.train(0, batch)
    rows.train(0, batch)
    margins = assert_same_first_step(first_rows, first_shared, bounds)
    print(f"shared prefix vs one row per sample, largest |diff| / tolerance: {margins}")


def test_eager_attention_takes_the_same_block_mask(tiny_model):
    """HF's eager attention adds the mask to the scores: the shared layout gives it an additive mask. The logits
    agree within tests/tolerance.py's float32 bound (terms the size of the largest logit, at least 1); logits
    one position off do not."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="eager").eval()
    prompts, responses = [[7, 8, 9, 10]] * 3 + [[11, 12]], [[13, 14], [15], [16, 17, 18], [19, 20]]
    masks = [[1] * len(r) for r in responses]

    def logits(mb):
        hidden, head = response_hidden(model, mb, torch.device("cpu"), "eager")
        return head(hidden)

    with torch.no_grad():
        one = logits(collate(prompts, responses, masks))
        shared = logits(collate(prompts, responses, masks, share_prefix=True))
    got = {i: shared[i, : len(r)] for i, r in enumerate(responses)}
    want = {i: one[i, : len(r)] for i, r in enumerate(responses)}
    seq_len = max(len(p) + len(r) for p, r in zip(prompts, responses))
    tol = forward_tolerance(
        transformer_depth(AutoConfig.from_pretrained(tiny_model), seq_len), max(1.0, one.abs().max())
    )
    assert_within(got, want, tol, "logits, shared prefix vs one row per sample")
    assert_rejected({i: x.roll(1, 0) for i, x in got.items()}, want, tol, "logits one position off")


def test_frozen_model_projects_its_logits_in_one_matrix_product(tiny_model, tiny_task, tmp_path):
    """The reference model's weights are frozen. Its output projection must still run as a matrix product of the
    chunk's [tokens x hidden] states, as the trained policy's does: fed a view not contiguous across sequences,
    torch's matmul on a frozen weight runs a batched product against the weight expanded per sequence instead (a 3x
    slower reference forward on SmolLM2-135M, before the passes projected chunks). In both layouts every product with
    a vocabulary-wide side is ``aten::mm``, and the reference's log-probs equal the policy's (same checkpoint)."""
    from torch.profiler import profile

    ref_flags = ("--use-tis", "--ref-load", str(tiny_model), "--use-kl-loss", "--kl-loss-coef", "0.01")
    batch = _batch()
    idx = list(range(len(batch.tokens)))
    for layout in ((), ("--no-shared-prefix",)):
        actor = _actor(_cfg(tiny_model, tiny_task, tmp_path, *ref_flags, *layout))
        vocab = actor.module.config.vocab_size
        mb = actor._collate(batch, actor._micro_batches(batch, idx)[0])
        with profile(record_shapes=True) as prof:
            got = actor._chunked_logprobs(actor.ref_model, mb, 1.0)
        products = [e for e in prof.events() if e.name in ("aten::mm", "aten::bmm")]
        projections = [(e.name, e.input_shapes) for e in products if e.input_shapes[-1][-1:] == [vocab]]
        assert projections and {name for name, _ in projections} == {"aten::mm"}, projections
        assert torch.equal(got, actor._chunked_logprobs(actor.module, mb, 1.0)), layout


def _projections(fn, vocab: int, hidden: int) -> tuple[int, int]:
    """While ``fn`` ran (forward and backward): the most token rows any matrix product with a ``vocab``-wide side
    took (how many tokens' logits, or gradients of them, existed at once), and how many products projected hidden
    states to logits (each chunk once, twice where its backward recomputes it)."""
    from torch.profiler import profile

    with profile(record_shapes=True) as prof:
        fn()
    products = [e.input_shapes for e in prof.events() if e.name in ("aten::mm", "aten::addmm", "aten::bmm")]
    rows = [n for shapes in products for s in shapes if vocab in s[-2:] for n in s[-2:] if n not in (vocab, hidden)]
    forward = sum(1 for shapes in products if shapes[-1][-2:] == [hidden, vocab])
    return max(rows, default=0), forward


def test_chunked_passes_equal_those_of_the_whole_logits(tiny_model, tiny_task, tmp_path, monkeypatch):
    """Every pass of the policy projects the last hidden states and reduces their logits a few tokens at a time, over
    real response tokens only; the training pass checkpoints each chunk and projects it again in its backward.

    - The no-gradient passes (old and reference log-probs) equal the whole [B, R, V] logits' log-probs, in both
      layouts, at a temperature, through the policy and the frozen reference model, with chunks smaller than a
      micro-batch (the last one ragged); padding gets 0; log-probs one token off are rejected by the same bound.
    - The training step (entropy bonus on, so the entropy's gradient counts too) equals the step taken from the
      whole logits (``benchmarks/levers.py``'s ``whole_logits_forward``, the pass before the chunks): gradients and
      weights within tests/tolerance.py's bounds, with its negative controls.
    - No matrix product with a vocabulary-wide side takes more tokens than a chunk, in the forward or the backward;
      the whole logits' pass takes the micro-batch's (the check's own control). The backward projects each chunk
      again only where keeping the logits would take more than ``RECOMPUTE_ABOVE_BYTES`` (forced both ways here)."""
    import miles_async.backends.fsdp.actor as actor_module
    from benchmarks.levers import whole_logits_forward

    monkeypatch.setattr(actor_module, "LOGPROB_CHUNK_TOKENS", 5)
    monkeypatch.setattr(actor_module, "RECOMPUTE_ABOVE_BYTES", 0)
    batch = _batch()
    idx = list(range(len(batch.tokens)))
    bounds = StepBounds.of(tiny_model, batch.tokens, group_size=4)
    ref_flags = ("--use-tis", "--ref-load", str(tiny_model), "--use-kl-loss", "--kl-loss-coef", "0.01")
    for layout in ((), ("--no-shared-prefix",)):
        actor = _actor(_cfg(tiny_model, tiny_task, tmp_path, *ref_flags, *layout))
        with torch.no_grad():
            want = actor._per_sample(lambda mb, a=actor: whole_logits_forward(a, a.model, mb, 0.7)[0], batch, idx)
        mb = actor._collate(batch, actor._micro_batches(batch, idx)[0])
        padded = actor._chunked_logprobs(actor.module, mb, 0.7)
        assert (
            padded.shape == mb.response_mask.shape and padded[mb.attention_mask[:, -padded.shape[1] :] == 0].eq(0).all()
        )
        for model in (actor.module, actor.ref_model):
            got = actor._logprobs_of(model, batch, idx, 0.7)
            assert_within(got, want, bounds.logprob, f"chunked log-probs {layout}")
        assert_rejected({i: lp[1:] + lp[:1] for i, lp in got.items()}, want, bounds.logprob, "shifted by one")

    flags = ("--use-tis", "--entropy-coef", "0.01", "--rollout-temperature", "0.7")
    chunked, whole = (_actor(_cfg(tiny_model, tiny_task, tmp_path, *flags)) for _ in range(2))
    whole._forward = lambda *a, **k: whole_logits_forward(whole, *a, **k)
    first = {name: record_torch_step(a) for name, a in (("chunked", chunked), ("whole", whole))}
    chunked.train(0, batch)
    whole.train(0, batch)
    margins = assert_same_first_step(first["whole"], first["chunked"], bounds, metrics=("entropy",))
    print(f"chunked training log-probs vs the whole logits, largest |diff| / tolerance: {margins}")
    config = chunked.module.config
    shapes = (config.vocab_size, config.hidden_size)
    widest, projected = {}, {}
    for name, a, threshold in (("chunked", chunked, 0), ("kept", chunked, 2**40), ("whole", whole, 0)):
        monkeypatch.setattr(actor_module, "RECOMPUTE_ABOVE_BYTES", threshold)
        widest[name], projected[name] = _projections(lambda a=a: a.train(1, _batch(seed=1)), *shapes)
    assert widest["chunked"] == widest["kept"] == 5 < widest["whole"], widest
    # a chunk recomputed in the backward is projected twice; kept, once, as the whole logits' micro-batches are
    assert projected["chunked"] == 2 * projected["kept"] and projected["kept"] > projected["whole"], projected

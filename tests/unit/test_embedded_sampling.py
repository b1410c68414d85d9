"""The embedded engine's sampler draws from the distribution it reports: token frequencies follow the truncated,
renormalised probabilities (top-k, top-p, temperature), a token without mass is never drawn, the log-prob returned is
the drawn token's under that distribution, and a seeded generator repeats its draws."""

from __future__ import annotations

import math

import pytest
import torch

from miles_async.inference.embedded.sampling import draw, sample_tokens

N = 20_000


def _freq(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / tokens.numel()


def test_draws_follow_the_probabilities_and_never_pick_a_token_without_mass():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0])
    g = torch.Generator().manual_seed(0)
    tokens = draw(probs.expand(N, -1).contiguous(), g)
    freq = _freq(tokens, 6)
    assert freq[[0, 2, 5]].sum() == 0
    # 5 standard errors of a binomial frequency.
    assert torch.allclose(freq, probs.double(), atol=5 * math.sqrt(0.25 / N))


def test_rows_need_not_sum_to_one_and_keep_their_own_distribution():
    probs = torch.tensor([[2.0, 0.0, 6.0], [0.0, 1.0, 0.0]]).repeat(N // 2, 1)
    tokens = draw(probs, torch.Generator().manual_seed(1))
    first, second = tokens[0::2], tokens[1::2]
    assert set(second.tolist()) == {1} and 1 not in set(first.tolist())
    assert abs(float((first == 2).double().mean()) - 0.75) < 5 * math.sqrt(0.25 / (N // 2))


def test_a_uniform_number_at_the_top_of_the_row_picks_its_last_token_with_mass(monkeypatch):
    probs = torch.tensor([[0.25, 0.75, 0.0, 0.0]])
    # u = 1, which a uniform draw never gives, stands for u * total rounding up to the total.
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.ones(1, 1, dtype=torch.float64))
    assert draw(probs, None).tolist() == [1]


@pytest.mark.parametrize("top_k,top_p", [(2, 1.0), (-1, 0.6), (3, 0.9)])
def test_sample_tokens_draws_from_the_truncated_distribution_it_reports(top_k, top_p):
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])
    temperature = 0.8
    rows = N // 4
    tokens, logprobs = sample_tokens(
        logits.expand(rows, -1).contiguous(),
        torch.full((rows,), temperature),
        torch.full((rows,), top_p),
        torch.full((rows,), top_k),
        torch.Generator().manual_seed(2),
    )
    # The reference: softmax at the temperature, top-k, then top-p on the renormalised top-k mass.
    p = torch.softmax(logits / temperature, -1)
    keep = torch.zeros(6, dtype=torch.bool)
    k = 6 if top_k <= 0 else top_k
    pk = torch.zeros(6)
    pk[:k] = p[:k] / p[:k].sum()
    before = pk.cumsum(0) - pk
    keep[:k] = before[:k] <= top_p
    ref = torch.where(keep, p, torch.zeros(6))
    ref = ref / ref.sum()
    freq = _freq(tokens, 6)
    assert freq[~keep].sum() == 0
    assert torch.allclose(freq, ref.double(), atol=5 * math.sqrt(0.25 / rows))
    assert torch.allclose(logprobs, ref.log()[tokens], atol=1e-5)


def test_a_seeded_generator_repeats_its_draws():
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(3))
    args = (torch.ones(64), torch.ones(64), torch.full((64,), -1))
    a, _ = sample_tokens(logits, *args, torch.Generator().manual_seed(7))
    b, _ = sample_tokens(logits, *args, torch.Generator().manual_seed(7))
    c, _ = sample_tokens(logits, *args, torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)

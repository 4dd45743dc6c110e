"""target_probs processes logits exactly as Hugging Face's sampling does (temperature, top-k, top-p)."""

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from headstart.runtime.sampling import SamplingParams, draw, target_probs


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.3, 5, 1.0), (0.8, 10, 0.5)])
def test_matches_hf_warpers(temperature, top_k, top_p):
    logits = 3 * torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    warpers = [TemperatureLogitsWarper(temperature)]
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1:
        warpers.append(TopPLogitsWarper(top_p))
    expected = LogitsProcessorList(warpers)(None, logits.clone()).softmax(-1)
    torch.testing.assert_close(target_probs(logits, SamplingParams(temperature, top_k, top_p)), expected)


@pytest.mark.parametrize("kwargs", [{"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}])
def test_invalid_params(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_draw_follows_the_weights_and_never_draws_a_zero_weight(monkeypatch):
    """`draw` (inverse CDF): 20,000 draws per row follow the row's weights; zero weights never come out, even when
    u * total reaches total (u = 1 forced), and a row of weight 0 everywhere still gets an index."""
    weights = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0], [0.0, 0.0, 2.0, 0.0, 0.0, 6.0], [0.0] * 6])
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(3, 6)
    for _ in range(20_000):
        counts[torch.arange(3), draw(weights, gen)] += 1
    want = weights[:2] / weights[:2].sum(-1, keepdim=True)
    torch.testing.assert_close(counts[:2] / 20_000, want, atol=0.015, rtol=0)
    assert counts[:2][weights[:2] == 0].sum() == 0
    monkeypatch.setattr(torch, "rand", lambda *args, **kwargs: torch.ones(*args[0]))  # u = 1: u * total = total
    assert draw(weights, gen).tolist()[:2] == [4, 5]  # the last index of positive weight, not the zero past it

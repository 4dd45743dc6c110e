"""target_probs processes logits exactly as Hugging Face's sampling does (temperature, top-k, top-p)."""

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from headstart.runtime.sampling import SamplingParams, target_probs


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

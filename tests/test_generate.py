"""The decode loop on tiny random Llamas: greedy identity with HF generate, exact sampling, stopping."""

from __future__ import annotations

import pytest
from headstart.runtime.drafters.base import Drafter
from headstart.runtime.drafters.lookup import LookupDrafter
from headstart.runtime.drafters.options import LookupOptions
from headstart.runtime.engine import Engine
from headstart.runtime.target import Target
from helpers.exactness import assert_first_three_follow_target, assert_greedy_identity, generate_ids, sampling_model
from helpers.models import tiny_llama

BUSY_LOOKUP = LookupDrafter(LookupOptions(min_ngram=1, max_branches=3))  # drafts at almost every round: exercises the verifier

PROMPTS = [
    [5, 9, 3, 17, 22, 8, 41, 3, 17, 22, 8],
    [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5],
    [60, 12, 60, 12, 60],
]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab_size=64, init_std=0.2)


@pytest.mark.parametrize("drafter", [Drafter(), LookupDrafter(), BUSY_LOOKUP], ids=["none", "lookup", "busy-lookup"])
def test_greedy_identity_with_hf_generate(model, drafter):
    accepted = assert_greedy_identity(model, drafter, PROMPTS, max_new_tokens=48)
    if isinstance(drafter, LookupDrafter):
        assert accepted > 0  # speculation really happened


def test_eos_and_max_new_tokens(model):
    target = Target(model)
    free = generate_ids(target, PROMPTS[0], max_new_tokens=20)
    eos = free[6]
    cut = generate_ids(target, PROMPTS[0], LookupDrafter(), max_new_tokens=20, eos_ids={eos})
    assert cut == free[: free.index(eos) + 1]
    assert generate_ids(target, PROMPTS[0], LookupDrafter(), max_new_tokens=0) == []
    assert len(generate_ids(target, PROMPTS[1], LookupDrafter(), max_new_tokens=5)) == 5


def test_bad_requests_are_refused(model):
    target = Target(model)
    with pytest.raises(ValueError, match="empty prompt"):
        generate_ids(target, [])
    with pytest.raises(ValueError, match="context"):
        generate_ids(target, PROMPTS[0], max_new_tokens=600)


def test_sampling_first_three_tokens_match_plain_sampling():
    """The first 3 tokens with the lookup drafter at T=0.8, top-p 0.9 follow their exact distribution
    (chi-square; false-failure probability 0.1 %, see tests/exactness.py)."""
    assert_first_three_follow_target(sampling_model(), [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3], BUSY_LOOKUP)


def test_engine_text_stop_strings(tiny_model_dir):
    engine = Engine.load(str(tiny_model_dir), drafter="lookup")
    prompt_ids = engine.encode("the cat sat on the mat")
    full = engine.generate(prompt_ids, max_new_tokens=24)
    assert full.text.strip() and full.stats.new_tokens == len(full.token_ids)
    words = full.text.split()
    stop = words[3]
    cut = engine.generate(prompt_ids, max_new_tokens=24, stop=[stop])
    assert cut.text == full.text[: full.text.find(stop)]
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)]
    streamed = "".join(engine.stream_text(prompt_ids, max_new_tokens=24, stop=[stop]))
    assert streamed == cut.text

"""The decode loop and the engine on tiny random Llamas: stopping, limits, stop strings, text deltas.

Exactness of every drafter: tests/test_drafter_contract.py."""

from __future__ import annotations

import pytest

from headstart.runtime.drafters.lookup import LookupDrafter
from headstart.runtime.engine import Engine
from headstart.runtime.target import Target
from helpers.exactness import generate_ids
from helpers.models import tiny_llama

PROMPTS = [
    [5, 9, 3, 17, 22, 8, 41, 3, 17, 22, 8],
    [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5],
    [60, 12, 60, 12, 60],
]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab_size=64, init_std=0.2)


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

"""The decode loop on tiny random Llamas: greedy identity with HF generate, exact sampling, stopping."""

from __future__ import annotations

import itertools

import pytest
import torch

from runtime.drafters import Drafter
from runtime.drafters.lookup import LookupDrafter
from runtime.engine import Engine
from runtime.generate import GenerationStats, stream
from runtime.sampling import SamplingParams, target_probs
from runtime.target import Target
from tests.conftest import tiny_llama
from tests.stats import chi_square_pvalue

BUSY_LOOKUP = LookupDrafter(min_ngram=1, max_branches=3)  # drafts at almost every round: exercises the verifier

PROMPTS = [
    [5, 9, 3, 17, 22, 8, 41, 3, 17, 22, 8],
    [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5],
    [60, 12, 60, 12, 60],
]


def generate_ids(target, prompt, drafter=None, **kwargs):
    return [t for chunk in stream(target, prompt, drafter, **kwargs) for t in chunk.tokens]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab_size=64, init_std=0.2)


@pytest.mark.parametrize("drafter", [Drafter(), LookupDrafter(), BUSY_LOOKUP], ids=["none", "lookup", "busy-lookup"])
def test_greedy_identity_with_hf_generate(model, drafter):
    target = Target(model)
    accepted = 0
    for prompt in PROMPTS:
        stats = GenerationStats()
        ours = generate_ids(target, prompt, drafter, max_new_tokens=48, stats=stats)
        hf = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=48, pad_token_id=0)[
            0, len(prompt) :
        ].tolist()
        assert ours == hf
        assert stats.new_tokens == 48
        accepted += sum(stats.accepted_per_depth)
        assert stats.new_tokens == stats.target_passes + sum(stats.accepted_per_depth)
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
    """The first 3 tokens with the lookup drafter at T=0.8, top-p 0.9, against their exact distribution.

    The exact joint over V^3 comes from the target's processed distributions (one batched forward).
    Fails when the chi-square p-value is below 1e-3: a correct implementation fails with probability
    0.1 % (fixed seeds make the outcome reproducible).
    """
    vocab = 8
    model = tiny_llama(vocab_size=vocab, init_std=0.3, seed=3)
    params = SamplingParams(temperature=0.8, top_p=0.9)
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]
    seqs = torch.tensor([prompt + list(pair) for pair in itertools.product(range(vocab), repeat=2)])
    with torch.no_grad():
        logits = model(input_ids=seqs).logits  # (V*V, L+2, V)
    probs = target_probs(logits[:, -3:], params)  # rows: p(a), p(b|a), p(c|a,b)
    joint = torch.zeros(vocab, vocab, vocab, dtype=torch.float64)
    for i, (a, b) in enumerate(itertools.product(range(vocab), repeat=2)):
        joint[a, b] = (probs[i, 0, a] * probs[i, 1, b] * probs[i, 2]).double()
    assert abs(joint.sum() - 1) < 1e-5

    target = Target(model)
    counts = torch.zeros(vocab, vocab, vocab)
    drafted = 0
    for seed in range(3000):
        stats = GenerationStats()
        a, b, c = generate_ids(target, prompt, BUSY_LOOKUP, sampling=params, max_new_tokens=3, seed=seed, stats=stats)
        counts[a, b, c] += 1
        drafted += sum(stats.accepted_per_depth)
    assert drafted > 300  # drafts were accepted (and, with 3 tokens from fewer passes, rejected too)
    assert chi_square_pvalue(counts, joint) > 1e-3


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

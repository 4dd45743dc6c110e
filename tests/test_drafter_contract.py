"""The contract every registered drafter keeps (`registry.names()`: plain, lookup, the trained kinds, the
draft models, and each with lookup grafted on), built through the registry as users build them:

1. greedy identity: the tokens of `model.generate(do_sample=False)`, with drafts accepted;
2. exact sampling: at T = 0.8, top-p 0.9 the first three tokens follow the target's exact joint
   distribution (chi-square; p < 1e-3 fails, so a correct drafter fails 0.1 % of seeds, and the seeds are fixed);
3. cache in sync: after every round the target's KV cache equals a fresh prefill of the sequence.

The target is a tiny random Llama over 8 tokens, peaked enough for drafts to be accepted; Medusa and EAGLE
use random heads (exactness must not depend on the heads' quality) with made-up per-rank accuracies.
"""

from __future__ import annotations

import pytest
import torch
from headstart.heads.checkpoint import save_heads, target_fingerprint
from headstart.runtime.drafters.model import layerskip_model
from headstart.runtime.drafters.registry import make_drafter, names
from headstart.runtime.generate import stream
from headstart.runtime.sampling import SamplingParams
from headstart.runtime.target import Target
from helpers.exactness import assert_first_three_follow_target, assert_greedy_identity, random_heads, sampling_model
from helpers.models import WORDS, tiny_tokenizer

ACCURACY = {"medusa": [[0.5, 0.2, 0.1], [0.4, 0.2], [0.3]], "eagle": [[0.5, 0.3], [0.4, 0.3], [0.5]]}
HEAD_OPTIONS = {"medusa": {"num_heads": 3}, "eagle": {}}
PROMPTS = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [5, 6, 7, 5, 6], [3, 1, 4, 1, 5]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(model, tokenizer, {option: value} per drafter base) for the 8-token target."""
    model = sampling_model()
    tokenizer = tiny_tokenizer(WORDS[:8])
    root = tmp_path_factory.mktemp("contract")
    options = {"layerskip": {"draft_layers": 1}, "model": {"draft_model": str(root / "draft")}}
    layerskip_model(model, [0]).save_pretrained(root / "draft")
    tokenizer.save_pretrained(root / "draft")
    for kind in ("medusa", "eagle"):
        heads = random_heads(kind, model, 0.3 if kind == "medusa" else 0.1, **HEAD_OPTIONS[kind])
        fingerprint = target_fingerprint(model, tokenizer)
        extra = {"rank_accuracy": ACCURACY[kind], "dtype": "float32"}
        save_heads(root / kind, heads, kind, HEAD_OPTIONS[kind], fingerprint, extra)
        options[kind] = {"heads": str(root / kind)}
    return model, tokenizer, options


def build(name: str, setup):
    model, tokenizer, options = setup
    return make_drafter(name, model, tokenizer, **options.get(name.removesuffix("+lookup"), {}))


@pytest.mark.parametrize("name", names())
def test_greedy_identity(name, setup):
    accepted = assert_greedy_identity(setup[0], build(name, setup), PROMPTS, max_new_tokens=32)
    assert (accepted > 0) == (name != "none"), f"{name}: {accepted} draft tokens accepted"


@pytest.mark.parametrize("name", names())
def test_sampling_follows_the_target(name, setup):
    runs = 400 if name.startswith(("model", "layerskip")) else 800  # a forward per draft token: slower
    drafter = build(name, setup)
    assert_first_three_follow_target(setup[0], PROMPTS[0], drafter, runs=runs, expect_drafts=name != "none")


@pytest.mark.parametrize("name", names())
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cache_in_sync_after_each_round(name, temperature, setup):
    """After each round the cache holds every token but the root, as a fresh prefill would compute them
    (the last round, cut at max_new_tokens, ends the sequence and is not checked)."""
    model = setup[0]
    target = Target(model)
    context, limit = list(PROMPTS[0]), 24
    rounds = stream(target, context, build(name, setup), SamplingParams(temperature), max_new_tokens=limit, seed=1)
    for chunk in rounds:
        context += chunk.tokens
        if len(context) - len(PROMPTS[0]) == limit:
            break
        assert target.past_len == len(context) - 1
        fresh = Target(model)
        fresh.prefill(context[:-1])
        for ours, theirs in zip(target.cache.layers, fresh.cache.layers, strict=True):
            torch.testing.assert_close(ours.keys, theirs.keys, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(ours.values, theirs.values, atol=1e-4, rtol=1e-4)

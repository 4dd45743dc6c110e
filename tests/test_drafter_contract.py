"""The contract every registered drafter keeps (`registry.names()`: plain, lookup, the trained kinds, the
draft models, and each with lookup grafted on), built through the registry as users build them:

1. greedy identity: the tokens of `model.generate(do_sample=False)`, with drafts accepted;
2. exact sampling: at T = 0.8, top-p 0.9 the first three tokens of 3,000 seeded runs follow the target's exact
   joint distribution (chi-square; p < 1e-3 fails, so a correct drafter fails 0.1 % of seeds, and the seeds are
   fixed), and no run ever writes a sequence the target gives probability 0 (top-p cuts many);
3. cache in sync: after every round the target's KV cache equals a fresh prefill of the sequence;
4. forks: a drafter's forks (its weights shared, a state each) decode sequences side by side in one batch, each
   sequence's tokens its greedy ones;
5. together: forks drafting together (`together.propose_all`, their head forwards batched) propose, round after
   round, the trees each proposes alone, at T = 0 and T > 0.

The set-up (`helpers.drafters`, fixture `tiny_drafters` in conftest.py): a tiny random Llama over 8 tokens, random
heads, a one-layer draft model.
"""

from __future__ import annotations

import pytest
import torch

from headstart.runtime.drafters.registry import names
from headstart.runtime.generate import Request, decode_all, stream
from headstart.runtime.sampling import SamplingParams
from headstart.runtime.target import Target
from helpers.drafters import PROMPTS, build
from helpers.exactness import assert_first_three_follow_target, assert_greedy_identity


@pytest.mark.parametrize("name", names())
def test_greedy_identity(name, tiny_drafters):
    accepted = assert_greedy_identity(tiny_drafters[0], build(name, tiny_drafters), PROMPTS, max_new_tokens=32).accepted
    assert (accepted > 0) == (name != "none"), f"{name}: {accepted} draft tokens accepted"


@pytest.mark.parametrize("name", names())
def test_sampling_follows_the_target(name, tiny_drafters):
    drafter = build(name, tiny_drafters)
    assert_first_three_follow_target(tiny_drafters[0], PROMPTS[0], drafter, runs=3000, expect_drafts=name != "none")


def test_sampling_follows_the_target_through_the_live_tree_sizer(tiny_drafters, tmp_path, monkeypatch):
    """The engine's live sizer resizes the sampled tree from the acceptance of past rounds, across the 3,000 runs
    (every 4 rounds here, not 64): the trees change size between runs and the joint is still the target's."""
    from headstart.runtime.engine import Engine
    from headstart.runtime.sizing.cost_curve import choose_budget

    monkeypatch.setenv("HEADSTART_CACHE", str(tmp_path))  # a cost curve measured for this tiny target
    model, tokenizer, options = tiny_drafters
    engine = Engine(model, tokenizer)
    drafter = engine.make_drafter("eagle", heads=options["eagle"]["heads"])
    sizer = drafter.sizer
    assert sizer is not None, "the engine gives calibrated EAGLE heads a live sizer"
    # a steep cost curve (each verified row costs a fifth of a step), on which the best tree moves with the
    # acceptance the sizer sees; a flat one (this tiny target's) keeps the largest tree whatever happens
    sizer.curve, sizer.every = {n: 1.0 + 0.2 * n for n in range(1, 65)}, 4
    first = choose_budget(sizer.curve, sizer.rank_accuracy, sizer.draft_ms)
    sizer.choice = {False: first, True: first}
    drafter.resize(first, sampled=True)
    shapes, resize = {tuple(first.shape)}, drafter.resize

    def recorded(choice, sampled):
        shapes.add(tuple(choice.shape))
        resize(choice, sampled)

    drafter.resize = recorded
    assert_first_three_follow_target(model, PROMPTS[0], drafter, runs=3000)
    assert len(shapes) >= 2, f"the sizer chose one sampled shape only: {shapes}"


@pytest.mark.parametrize("name", names())
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cache_in_sync_after_each_round(name, temperature, tiny_drafters):
    """After each round the cache holds every token but the root, as a fresh prefill would compute them
    (the last round, cut at max_new_tokens, ends the sequence and is not checked)."""
    model = tiny_drafters[0]
    target = Target(model)
    context, limit = list(PROMPTS[0]), 24
    rounds = stream(
        target, context, build(name, tiny_drafters), SamplingParams(temperature), max_new_tokens=limit, seed=1
    )
    for chunk in rounds:
        context += chunk.tokens
        if len(context) - len(PROMPTS[0]) == limit:
            break
        assert target.past_len == len(context) - 1
        fresh = Target(model)
        fresh.prefill(context[:-1])
        n = target.past_len  # the committed rows of slot 0
        for ours, theirs in zip(target.cache.layers, fresh.cache.layers, strict=True):
            torch.testing.assert_close(ours._k[0, :, :n], theirs._k[0, :, :n], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(ours._v[0, :, :n], theirs._v[0, :, :n], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", names())
def test_forks_decode_side_by_side(name, tiny_drafters):
    """One drafter and its forks speculate for three sequences in one batch (trees verified in one forward):
    each sequence gets `model.generate`'s greedy tokens, and the forks share the drafter's weights."""
    model = tiny_drafters[0]
    drafter = build(name, tiny_drafters)
    forks = [drafter, drafter.fork(), drafter.fork()]
    assert forks[1] is not drafter and type(forks[1]) is type(drafter)
    for attr in ("head", "heads", "model"):  # what a trained or model drafter loaded: not copied
        inner = getattr(drafter, "inner", drafter)
        if hasattr(inner, attr):
            assert getattr(getattr(forks[2], "inner", forks[2]), attr) is getattr(inner, attr)
    requests = [Request(list(p), d, max_new_tokens=24) for p, d in zip(PROMPTS, forks, strict=True)]
    done = list(decode_all(Target(model, slots=3), requests))
    assert len(done) == 3
    for r in requests:
        hf = model.generate(torch.tensor([r.prompt_ids]), do_sample=False, max_new_tokens=24, pad_token_id=0)
        assert r.context[len(r.prompt_ids) :] == hf[0, len(r.prompt_ids) :].tolist(), f"{name}: {r.prompt_ids}"
    accepted = sum(sum(r.stats.accepted_per_depth) for r in requests)
    assert (accepted > 0) == (name != "none"), f"{name}: {accepted} draft tokens accepted"


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("name", names())
def test_forks_drafting_together_propose_what_each_proposes_alone(name, temperature, tiny_drafters, monkeypatch):
    """Three sequences decoded in one batch twice: their drafters' head forwards batched (one forward per step for
    the three: `together.propose_all`), then each drafting alone (`propose`). Every round proposes the same trees
    (tokens, parents, and the q of sampled nodes), so the batch decodes the same tokens. The heads run in the
    target's float32 here: a sequence reads only its own rows either way; on the stock kernels (transformers' layer,
    `--no-prepack`) another row count rounds a bfloat16 head's products differently, enough to swap two near-tied
    guesses (the native draft layers do not: tests/test_native_head.py)."""
    import headstart.runtime.generate as generate
    from headstart.runtime.drafters import together

    model = tiny_drafters[0]
    batched = {"steps": 0}
    run_together = together.run_together

    def counted(steps):
        batched["steps"] += len(steps) > 1
        return run_together(steps)

    monkeypatch.setattr(together, "run_together", counted)
    runs = []
    for propose in (
        together.propose_all,
        lambda drafters, contexts, sizes=None: [d.propose(c) for d, c in zip(drafters, contexts, strict=True)],
    ):
        trees: list[list] = []

        def recorded(drafters, contexts, sizes=None, propose=propose, trees=trees):
            out = propose(drafters, contexts, sizes)
            trees.append([(t.tokens, t.parents, None if t.draft_probs is None else t.draft_probs.clone()) for t in out])
            return out

        monkeypatch.setattr(generate, "propose_all", recorded)
        drafter = build(name, tiny_drafters, head_dtype="target")
        sampling = SamplingParams(temperature=temperature, top_p=0.9)
        requests = [
            Request(list(p), d, sampling, max_new_tokens=20, seed=i)
            for i, (p, d) in enumerate(zip(PROMPTS, [drafter, drafter.fork(), drafter.fork()], strict=True))
        ]
        list(decode_all(Target(model, slots=3), requests))
        runs.append((trees, [r.context for r in requests]))
    (together_trees, together_out), (alone_trees, alone_out) = runs
    assert together_out == alone_out
    assert len(together_trees) == len(alone_trees)
    for mine, theirs in zip(together_trees, alone_trees, strict=True):
        for (tokens, parents, q), (tokens2, parents2, q2) in zip(mine, theirs, strict=True):
            assert (tokens, parents) == (tokens2, parents2)
            if q is not None:
                torch.testing.assert_close(q, q2, atol=1e-6, rtol=1e-5)
    head = name.split("+")[0] in ("eagle", "eagle3")
    assert (batched["steps"] > 0) == head, f"{name}: {batched['steps']} batched head forwards"

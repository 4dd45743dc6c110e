"""The decode loop for B sequences (`generate.Batch`): each sequence's tokens are its own batch-1 decode.

Float64 tiny models (batch numerics cannot flip a near-tie there): prompts of mixed lengths, sequences joining
mid-decode (prefilled in chunks while the others decode), one leaving mid-decode, a shared prefix, a drafter's
tree verified beside plain rows, a sliding-window family past its window. At T > 0 a sequence decoded beside
others follows the target's distribution (chi-square over 3,000 runs).
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from headstart.runtime.drafters.base import Drafter
from headstart.runtime.drafters.lookup import LookupDrafter
from headstart.runtime.generate import Batch, GenerationStats, Request, SharedPrefix, decode_all, stream
from headstart.runtime.sampling import SamplingParams
from headstart.runtime.target import Target
from helpers.exactness import SAMPLING, SecondGuess, first_three_joint, sampling_model
from helpers.models import tiny_llama
from helpers.stats import chi_square_pvalue

PREFIX = [7, 7, 30, 31]  # every prompt but the last starts with it
PROMPTS = [
    [*PREFIX, 5, 9, 3, 17, 22, 8, 41, 3, 17, 22, 8],
    [*PREFIX, 60, 12, 60, 12, 60, 7],
    [*PREFIX, 1],
    [*PREFIX, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29],
    [*PREFIX, 44, 45],
    [50, 51, 52, 53, 54, 55, 56],  # no shared prefix
]
NEW = 24


def _greedy(model, prompt: list[int], new: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def _run(batch: Batch, requests: list[Request], joins: dict[int, list[Request]], leave: tuple[int, Request] | None):
    """Rounds until every request is done: `joins[k]` join before round k, `leave` = (k, request) leaves then."""
    tokens = {id(r): [] for r in requests}
    for r in joins.get(0, []):
        batch.add(r)
    k = 0
    while not all(r.done for r in requests):
        k += 1
        for r in joins.get(k, []):
            batch.add(r)
        if leave is not None and leave[0] == k:
            batch.remove(leave[1])
        for r, chunk in batch.round():
            tokens[id(r)] += chunk.tokens
        assert k < 500, "the batch never finished"
    return tokens


def _model(family: str = "llama"):
    if family == "llama":
        return tiny_llama(vocab_size=64, init_std=0.3).double()
    config = tf.MistralConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=8,
        max_position_embeddings=512,
        initializer_range=0.3,
    )
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").double()
    return model.eval().requires_grad_(False)


@pytest.mark.parametrize("fast,mix", [(False, False), (True, False), (True, True)], ids=["padded", "packed", "mixed"])
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_each_sequence_decodes_its_own_greedy_tokens_beside_others(family, fast, mix):
    """`mixed`: joiners' prompt chunks ride in the rounds' forwards (Mistral's sliding window keeps them apart)."""
    model = _model(family)
    target = Target(model, fast=fast, slots=4)
    batch = Batch(target, prefill_chunk=3, prefix=SharedPrefix(PREFIX), mix=mix and target.mixes_prefill)
    guess = SecondGuess({tuple(PROMPTS[1]): _greedy(model, PROMPTS[1], NEW)}, vocab_size=64)
    requests = [
        Request(p, max_new_tokens=NEW - 3 * i, drafter=guess if i == 1 else Drafter()) for i, p in enumerate(PROMPTS)
    ]
    leaver = requests[2]
    joins = {0: requests[:3], 2: requests[3:5], 9: requests[5:]}  # 6 requests through 4 slots
    got = _run(batch, requests, joins, leave=(5, leaver))
    for r in requests:
        want = _greedy(model, r.prompt_ids, r.max_new_tokens)
        if r is leaver:  # left after round 4: what it had so far is its greedy prefix
            assert 0 < len(got[id(r)]) < len(want) and got[id(r)] == want[: len(got[id(r)])]
        else:
            assert got[id(r)] == want, f"prompt {r.prompt_ids}"
    assert sum(requests[1].stats.accepted_per_depth) > 10  # its trees, verified beside plain rows, commit siblings
    assert len(batch) == 0 and target.cache.nbytes() == 0  # the cache is freed when the batch empties


def test_a_shared_prefix_is_computed_once():
    model = _model()
    target, calls = Target(model, fast=False, slots=2), []
    extend, extend_batch = target.extend, target.extend_batch
    target.extend = lambda ids, *a, **k: calls.append(len(ids)) or extend(ids, *a, **k)
    target.extend_batch = lambda chunks, *a, **k: (
        calls.append([len(c) for c in chunks]) or extend_batch(chunks, *a, **k)
    )
    batch = Batch(target, prefix=SharedPrefix(PREFIX))
    requests = [Request(p, max_new_tokens=4) for p in PROMPTS[:2]]
    _run(batch, requests, {0: requests[:1], 1: requests[1:]}, None)  # both join the first round: one prefill
    late = Request(PROMPTS[3], max_new_tokens=4)
    _run(batch, [late], {0: [late]}, None)  # after the batch emptied and its cache was freed
    joiner = Request(PROMPTS[4], max_new_tokens=4)
    _run(batch, [late := Request(PROMPTS[0], max_new_tokens=8), joiner], {0: [late], 2: [joiner]}, None)
    after = [len(p) - 1 - len(PREFIX) for p in PROMPTS]  # what each prompt prefills after the prefix
    assert calls == [len(PREFIX), [after[0], after[1]], [after[3]], after[3], [after[0]], after[0], after[4]]


def test_a_joiner_waits_for_the_kv_budget():
    model = _model()
    target = Target(model, fast=False, slots=4)
    per_seq = 2 * (len(PROMPTS[0]) + 8) * target.kv_bytes_per_token()
    batch = Batch(target, kv_budget=int(1.5 * per_seq))  # one sequence fits, two do not
    requests = [Request(PROMPTS[0], max_new_tokens=8), Request(PROMPTS[1], max_new_tokens=8)]
    for r in requests:
        batch.add(r)
    batch.round()
    assert [r.slot for r in requests] == [0, -1]
    got = _run(batch, requests, {}, None)
    assert got[id(requests[1])] == _greedy(model, PROMPTS[1], 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_seed_writes_the_same_tokens_alone_and_in_a_batch(dtype):
    """A sampled request (T > 0, a seed) writes the same tokens decoded alone and beside other sequences (other
    prompts, seeds and temperatures, one speculating, two joining mid-decode: prefill chunks beside its rows), on
    the fast path in the model's own dtype: a row's values do not depend on the rows beside it (tests/test_native.py)
    and its draws come from its own generator."""
    target = Target(tiny_llama().to(dtype), slots=4)

    def ours() -> Request:
        return Request(PROMPTS[0], max_new_tokens=NEW, sampling=SamplingParams(0.8), seed=123)

    alone = _run(Batch(target), [r := ours()], {0: [r]}, None)[id(r)]
    others = [
        Request(PROMPTS[1], max_new_tokens=NEW, sampling=SamplingParams(1.0), seed=5),
        Request(PROMPTS[3], max_new_tokens=10, drafter=LookupDrafter(), sampling=SAMPLING, seed=6),
        Request(PROMPTS[5], max_new_tokens=NEW),
    ]
    batched = _run(Batch(target), [r := ours(), *others], {0: [others[0], r], 2: others[1:]}, None)[id(r)]
    assert batched == alone and len(set(alone)) > 5, (alone, batched)


def test_sampling_beside_neighbours_follows_the_target():
    """3,000 runs of one prompt at T > 0, each decoded beside other sequences (other prompts and seeds, some
    speculating): the joint of its first three tokens is the target's."""
    model = sampling_model()
    prompt = [1, 5, 2, 7]
    joint = first_three_joint(model, prompt, SAMPLING)
    target = Target(model, slots=8)
    vocab = model.config.vocab_size
    counts = torch.zeros(vocab, vocab, vocab)
    runs, per_batch = 3000, 4
    for b in range(runs // per_batch):
        batch = Batch(target)
        ours = [Request(prompt, max_new_tokens=3, sampling=SAMPLING, seed=b * per_batch + i) for i in range(4)]
        others = [
            Request([3, 3, 1 + i], max_new_tokens=2 + i, sampling=SamplingParams(0.7 + 0.2 * i), seed=10**6 + b)
            for i in range(3)
        ]
        others.append(Request([1, 5, 2], max_new_tokens=5, drafter=LookupDrafter(), sampling=SAMPLING, seed=b))
        mixed = [ours[0], others[0], ours[1], others[1], others[2], ours[2], others[3], ours[3]]
        got = _run(batch, mixed, {0: mixed[:6], 1: mixed[6:]}, None)
        for r in ours:
            a, b_, c = got[id(r)]
            counts[a, b_, c] += 1
    impossible = int(counts[joint == 0].sum())
    assert impossible == 0
    assert chi_square_pvalue(counts, joint) > 1e-3


def test_stats_of_a_sequence_in_a_batch():
    model = _model()
    batch = Batch(Target(model, fast=False, slots=2))
    requests = [Request(p, max_new_tokens=6, stats=GenerationStats()) for p in PROMPTS[:2]]
    _run(batch, requests, {0: requests}, None)
    for r in requests:
        assert r.stats.new_tokens == 6 and r.stats.target_passes == 6 and r.stats.plain_passes == 6
        assert r.stats.elapsed_s > 0 and set(r.stats.phase_s) >= {"propose", "layers", "accept", "commit"}
        assert r.stats.treeless_phase_s == r.stats.phase_s  # nobody drafted: every round is treeless

    # beside a sequence that drafts in some rounds: a round where it drafted is not treeless for its neighbour
    batch = Batch(Target(model, fast=False, slots=2))
    plain = Request(PROMPTS[0], max_new_tokens=12, stats=GenerationStats())
    drafts = Request([5, 6, 7] * 3 + [5], max_new_tokens=12, drafter=LookupDrafter(), stats=GenerationStats())
    _run(batch, [plain, drafts], {0: [plain, drafts]}, None)
    assert drafts.stats.spec_steps > 0
    assert plain.stats.treeless_phase_s.get("layers", 0.0) < plain.stats.phase_s["layers"]


def test_picking_a_joiners_chunks_is_its_own_phase_not_drafting(monkeypatch):
    """The joiners' prompt chunks that ride in a round's forward are picked in a phase of their own ("stage"): batching
    work a plain server does too, which the drafting share (propose + observe) counted as drafting (served, plain's own
    "drafting" was 0.7-0.9 % of its rounds). A slow pick (50 ms here) lands in "stage", none of it in "propose"."""
    import time

    model = _model()
    batch = Batch(Target(model, fast=True, slots=2), prefill_chunk=4)
    stage = Batch._stage
    monkeypatch.setattr(Batch, "_stage", lambda self, *a, **k: time.sleep(0.05) or stage(self, *a, **k))
    first = batch.add(Request(PROMPTS[0], max_new_tokens=3, stats=GenerationStats()))
    batch.round()
    batch.add(Request(PROMPTS[1], max_new_tokens=3))
    batch.round()
    assert first.stats.phase_s["stage"] >= 0.1  # two rounds picked
    assert first.stats.phase_s["propose"] < 0.05
    assert first.stats.treeless_phase_s["stage"] == first.stats.phase_s["stage"]


@pytest.mark.parametrize("fast", [False, True])
def test_prompts_that_are_the_shared_prefix_and_a_root_decode(fast):
    """Joiners whose prompt is the shared prefix and one token (a chat template's open turn, sampled from: `headstart
    magpie`) have nothing to prefill: they decode their own tokens (a prefill forward of their empty chunks failed in
    the stock forward and crashed the process in the prepacked one)."""
    model = _model()
    requests = [Request(PROMPTS[0], max_new_tokens=4) for _ in range(3)]
    done = decode_all(Target(model, fast=fast, slots=3), requests, SharedPrefix(PROMPTS[0][:-1]))
    got = {id(r): r.context[len(r.prompt_ids) :] for r in done}
    for r in requests:
        assert got[id(r)] == _greedy(model, r.prompt_ids, 4)


def test_join_gap_measures_the_rounds_around_a_join():
    from headstart.runtime.apps.join_gap import gaps
    from headstart.runtime.engine import Engine
    from helpers.models import tiny_tokenizer

    engine = Engine(_model().float(), tiny_tokenizer(), prepack=False)
    prompts = [p[:6] for p in PROMPTS[:3]]
    long = gaps(engine, prompts, join=[1 + i % 60 for i in range(100)], chunk=8, streams=3)
    assert len(long) == 10 + 13 + 10 and all(s > 0 for s in long)  # 99 tokens to cache, 8 a round: 13 rounds
    short = gaps(engine, prompts, join=[1 + i % 60 for i in range(50)], chunk=8, streams=3)
    assert len(short) == 10 + 1 + 10  # at most WHOLE_PREFILL chunks: one round


def test_float32_fast_path_beside_others_differs_only_at_a_tie():
    """The fast path (prepacked kernels, grouped attention) in float32: a sequence decoded beside others gives its
    tokens alone, or first differs where its two candidates tie (< 1e-4 apart: batch numerics may pick either)."""
    model = tiny_llama(vocab_size=64, init_std=0.3)
    batched, alone = Target(model, slots=4), Target(model)
    batch = Batch(batched, prefill_chunk=4)
    requests = [Request(p, max_new_tokens=NEW) for p in PROMPTS[:5]]
    got = _run(batch, requests, {0: requests[:3], 3: requests[3:]}, None)
    for r in requests:
        want = [t for chunk in stream(alone, r.prompt_ids, max_new_tokens=NEW) for t in chunk.tokens]
        ours = got[id(r)]
        if ours == want:
            continue
        k = next(i for i, (a, b) in enumerate(zip(ours, want, strict=True)) if a != b)
        with torch.no_grad():
            logits = model(torch.tensor([r.prompt_ids + want[:k]])).logits[0, -1]
        assert abs(float(logits[ours[k]] - logits[want[k]])) < 1e-4, f"prompt {r.prompt_ids}: no tie at token {k}"


class FeatureReader(Drafter):
    """Drafts nothing; keeps the prompt features `start` gets (the final hidden state of every prompt token)."""

    feature_layers = (-1,)

    def start(self, prompt_ids, prompt_hidden, sampling=None, seed=None) -> None:
        self.prompt_hidden = prompt_hidden


def test_joiners_with_and_without_feature_drafters_prefill_together():
    """An idle batch prefills its joiners in one forward; a plain request beside one whose drafter reads features
    gets none, the other gets exactly its own prompt's (a plain one once got a None it could not join: a 600 s
    soak's 500s)."""
    model = _model()
    target = Target(model, fast=False, slots=2)
    batch = Batch(target)
    reader = FeatureReader()
    plain, fed = Request(PROMPTS[1], max_new_tokens=4), Request(PROMPTS[0], reader, max_new_tokens=4)
    batch.add(plain)
    batch.add(fed)
    batch.round()  # both prefilled in one forward, then a round
    alone = model(torch.tensor([PROMPTS[0][:-1]]), output_hidden_states=True).hidden_states[-1][0]
    torch.testing.assert_close(reader.prompt_hidden, alone)


def test_a_joiners_prompt_rides_in_the_rounds_forward():
    """While others decode, a joiner's prompt is fed in the round's own forward (one forward a round, no prefill of
    its own): a long prompt `prefill_chunk` tokens a round, its last chunk with its last token, so it leaves that
    round with its first token; a short one whole in one round. Their tokens are their own greedy ones."""
    model = _model()
    target = Target(model, fast=True, slots=3)
    forwards = []
    forward, extend = target._forward, target.extend
    target._forward = lambda ids, *a, **k: forwards.append(ids.shape[-1]) or forward(ids, *a, **k)
    target.extend = lambda *a, **k: pytest.fail("a prefill forward of its own while others decode")
    batch = Batch(target, prefill_chunk=4)
    first = batch.add(Request(PROMPTS[0], max_new_tokens=30))
    target.extend = lambda *a, **k: extend(*a, **k)  # alone: prefilled before its first round
    ((_, opening),) = batch.round()
    target.extend = lambda *a, **k: pytest.fail("a prefill forward of its own while others decode")
    long, short = Request(PROMPTS[3] * 2, max_new_tokens=6), Request(PROMPTS[4], max_new_tokens=6)  # 46, 6 tokens
    batch.add(long)
    batch.add(short)
    forwards.clear()
    got = {id(first): opening.tokens, id(long): [], id(short): []}
    while not short.stats.new_tokens:
        for r, chunk in batch.round():
            got[id(r)] += chunk.tokens
    # 46 > 8 chunks: 4 tokens a round, the last 2 with its first token beside the short one's first 2, then its 4
    assert forwards == [1 + 4] * 11 + [1 + 2 + 2, 2 + 4]
    assert len(got[id(long)]) == 2 and len(got[id(short)]) == 1
    while not all(r.done for r in (first, long, short)):
        for r, chunk in batch.round():
            got[id(r)] += chunk.tokens
    for r in (first, long, short):
        assert got[id(r)] == _greedy(model, r.prompt_ids, r.max_new_tokens)

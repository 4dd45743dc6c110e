"""The prefix cache (`runtime/prefix_cache.py`): finished prompts' keys, values and features kept in blocks of
BLOCK (32) tokens, copied into the slot of a joiner whose prompt starts the same way.

    kept  A: [ a0 ... a31 | a32 ... a63 | a64 ... a95 | a96 .. ]   three blocks, chained: (0, a0..31) -> 1 ...
    B = A[:40] + b:  [ a0 ... a31 | a32 .. a39 b .. ]              its first block only (the second differs)
    C = c[:32] + A[32:]: [ c ... | a32 ... a63 | ...]              nothing: a block is found after its whole prefix

Float64 tiny models: a joiner started from the cache decodes the greedy tokens of its own fresh decode and its
drafter gets exactly the features a fresh prefill gives.
"""

from __future__ import annotations

import pytest
import torch
from test_batch import FeatureReader, _greedy, _model

from headstart.runtime.generate import Batch, Request
from headstart.runtime.prefix_cache import BLOCK, PrefixCache
from headstart.runtime.target import Target

torch.manual_seed(0)
A = torch.randint(3, 64, (100,)).tolist()
B = A[:40] + torch.randint(3, 64, (50,)).tolist()
C = torch.randint(3, 64, (32,)).tolist() + A[32:]
D = torch.randint(3, 64, (100,)).tolist()


def positions(start: int, stop: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fake slot's rows: one layer whose keys hold their positions, values their negatives."""
    k = torch.arange(start, stop, dtype=torch.float64).view(1, -1, 1)
    return [(k, -k)]


def test_blocks_are_found_only_after_their_whole_prefix_within_the_limit():
    cache = PrefixCache(1 << 20)
    cache.keep(A, positions, None)
    assert [b.kv[0][0].flatten().tolist() for b in cache.match(A, 99)] == [
        list(range(i, i + BLOCK)) for i in (0, 32, 64)
    ]
    assert len(cache.match(A, 95)) == 2  # the third block ends past the limit
    assert len(cache.match(B, len(B))) == 1
    assert cache.match(C, len(C)) == []
    assert cache.stats() == {
        "blocks": 3,
        "bytes": 3 * 2 * BLOCK * 8,
        "lookups": 4,
        "looked_up_tokens": 99 + 95 + len(B) + len(C),
        "hit_tokens": (3 + 2 + 1) * BLOCK,
    }


def test_a_block_is_keyed_by_its_parent_not_only_by_its_tokens():
    """C's first block held (another prompt kept it) and its second block's tokens held after A's first: that second
    block is A's keys and values after A's prefix, not C's, and must not be found. (Keyed by its tokens alone, or by
    its tokens and position, it was: three blocks matched where one is C's.)"""
    cache = PrefixCache(1 << 20)
    cache.keep(A, positions, None)
    cache.keep(C[: BLOCK + 5], positions, None)  # C's first block alone
    assert cache.match(C, len(C)) == [cache.match(C[:BLOCK], BLOCK)[0]]


def test_a_prompt_kept_again_copies_only_its_new_blocks():
    cache, copied = PrefixCache(1 << 20), []

    def snapshot(start, stop):
        copied.append(start)
        return positions(start, stop)

    cache.keep(A, snapshot, None)
    cache.keep(A, snapshot, None)
    cache.keep(B, snapshot, None)  # shares A's first block
    assert copied == [0, 32, 64, 32]  # B's 90 tokens hold two whole blocks
    assert cache.stats()["blocks"] == 4


def test_the_memory_cap_cuts_chains_from_their_end():
    block = 2 * BLOCK * 8
    cache = PrefixCache(4 * block)
    cache.keep(A, positions, None)
    cache.keep(D, positions, None)  # six blocks: A's two deepest go, least recently used
    assert cache.nbytes == 4 * block
    assert len(cache.match(A, 99)) == 1 and len(cache.match(D, 99)) == 3
    cache.keep(A, positions, None)  # A's blocks again: D's deepest go (D's start was touched after A's)
    assert len(cache.match(A, 99)) == 3 and len(cache.match(D, 99)) == 1
    assert PrefixCache(block - 1).keep(A, positions, None) is None  # a block over the cap is not kept


@pytest.mark.parametrize("fast,mix", [(False, False), (True, True)], ids=["padded", "mixed"])
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_a_joiner_started_from_the_cache_decodes_as_alone(family, fast, mix):
    """A's request leaves, its prompt is kept; A again and B (A's first block) join beside a decoding request, start
    from the cache (3 and 1 blocks), and decode their own greedy tokens with the features of a fresh prefill.
    Mistral's window (8) is far behind the copied rows."""
    model = _model(family)
    target = Target(model, fast=fast, slots=3)
    cache = PrefixCache(1 << 30, (-1,))
    batch = Batch(target, prefill_chunk=16, mix=mix and target.mixes_prefill, prefix_cache=cache)
    first = batch.add(Request(A, FeatureReader(), max_new_tokens=6))
    while not first.done:
        batch.round()
    assert cache.stats()["blocks"] == 3 and cache.stats()["hit_tokens"] == 0
    busy = batch.add(Request(D, max_new_tokens=30))
    batch.round()  # `busy` decodes: the joiners below are prefilled beside it
    again, b = Request(A, FeatureReader(), max_new_tokens=12), Request(B, FeatureReader(), max_new_tokens=12)
    got = {id(again): [], id(b): [], id(busy): []}
    for r in (again, b):
        batch.add(r)
    while not (again.done and b.done and busy.done):
        for r, chunk in batch.round():
            got[id(r)] += chunk.tokens
    assert cache.stats()["hit_tokens"] == (3 + 1) * BLOCK
    for r in (again, b):
        assert got[id(r)] == _greedy(model, r.prompt_ids, 12)
        fresh = model(torch.tensor([r.prompt_ids[:-1]]), output_hidden_states=True).hidden_states[-1][0]
        torch.testing.assert_close(r.drafter.prompt_hidden, fresh)
    assert cache.stats()["blocks"] == 3 + 1  # A's, B's own second block (D's plain drafter reads no features)


def test_a_drafter_reading_other_features_neither_uses_nor_fills_the_cache():
    model = _model()
    target = Target(model, fast=False, slots=1)
    cache = PrefixCache(1 << 30, (-1,))
    batch = Batch(target, prefix_cache=cache)
    for _ in range(2):
        r = batch.add(Request(A, max_new_tokens=2))  # plain: reads no features
        while not r.done:
            batch.round()
    assert cache.stats() == {"blocks": 0, "bytes": 0, "lookups": 0, "looked_up_tokens": 0, "hit_tokens": 0}

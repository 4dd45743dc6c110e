"""The suffix pool (runtime/drafters/suffix.py): what a lookup returns, its bounds, threads, and who shares it.
Exactness is the drafter contract's (tests/test_drafter_contract.py runs `suffix` and every `X+suffix`, the pool
filled by the runs before, as in service)."""

from __future__ import annotations

import random
import threading

import pytest

from headstart.runtime.drafters.base import Drafter
from headstart.runtime.drafters.graft import LookupGraft
from headstart.runtime.drafters.options import SuffixOptions
from headstart.runtime.drafters.registry import make_drafter
from headstart.runtime.drafters.suffix import SuffixDrafter, SuffixPool, _top_nodes
from headstart.runtime.generate import Batch, Request
from headstart.runtime.target import Target
from headstart.runtime.tree import DraftTree
from helpers.drafters import PROMPTS
from helpers.exactness import assert_first_three_follow_target
from helpers.models import tiny_llama

OPTIONS = SuffixOptions(min_prob=0.0)  # every node counted kept (the default leaves out the unlikely ones)


def test_a_lookup_counts_what_followed_the_longest_matches():
    """Three finished requests hold `7 8 9` and what followed it: `1 2` twice, `3` once. The trie of continuations
    counts each node by the matches through it; longer matches rank first (here the one that also matched `6`).
    A node's probability is its matches over the matches + 1; `min_prob` leaves out those under it."""
    pool = SuffixPool(1000)
    pool.add([5, 7, 8, 9, 1, 2])
    pool.add([4, 7, 8, 9, 1, 2, 0])
    pool.add([6, 7, 8, 9, 3])
    found = pool.lookup([0, 0, 7, 8, 9], OPTIONS)
    assert found.matches == 3 and found.longest == 3
    assert found.branches == [[1, 2, 0], [3]]  # the likeliest path first
    assert found.probs == pytest.approx([2 / 4, 2 / 4, 1 / 4, 1 / 4])  # `1`, `1 2`: two of the three matches
    assert found.gain == pytest.approx(1.5)
    likely = pool.lookup([0, 0, 7, 8, 9], SuffixOptions(min_prob=0.3))
    assert likely.branches == [[1, 2]] and likely.probs == pytest.approx([0.5, 0.5])
    assert pool.lookup([6, 7, 8, 9], OPTIONS).longest == 4  # the match extends back over `6`
    assert pool.lookup([6, 7, 8, 9], SuffixOptions(max_matches=1, min_prob=0.0)).branches == [[3]]  # the longest alone
    assert pool.lookup([1, 7, 8], OPTIONS).matches == 0  # `1 7 8` never occurred
    assert pool.lookup([9, 1], OPTIONS).matches == 0  # shorter than a window


def test_a_match_never_runs_across_two_requests():
    pool = SuffixPool(1000)
    pool.add([1, 2, 3])
    pool.add([4, 5, 6, 7])  # `2 3 4`, `3 4 5` span the boundary: not in the pool
    assert pool.lookup([2, 3, 4], OPTIONS).matches == 0
    assert pool.lookup([1, 2, 3], OPTIONS).branches == []  # `1 2 3` ended its request: nothing followed
    assert pool.lookup([9, 4, 5, 6], OPTIONS).branches == [[7]]
    assert pool.lookup([3, 4, 5, 6], OPTIONS).longest == 3  # the 3 before it was another request's


def test_the_drafted_nodes_are_the_likeliest_and_form_a_tree():
    """Against brute force on random continuations: the `budget` nodes chosen have the highest counts (ties
    aside), every chosen node's parent is chosen, and the branches rebuild exactly the chosen nodes."""
    rng = random.Random(0)
    for _ in range(200):
        follows = [[rng.randrange(3) for _ in range(rng.randint(1, 5))] for _ in range(rng.randint(1, 12))]
        budget = rng.randint(1, 10)
        found = _top_nodes(follows, SuffixOptions(pool_nodes=budget, min_prob=0.0), 3, (1.0,))
        counts = {}
        for f in follows:
            for d in range(1, len(f) + 1):
                counts[tuple(f[:d])] = counts.get(tuple(f[:d]), 0) + 1
        chosen = {tuple(b[:d]) for b in found.branches for d in range(1, len(b) + 1)}
        assert len(chosen) == len(found.probs) == min(budget, len(counts))
        assert all(path[:-1] in chosen or len(path) == 1 for path in chosen)
        left_out = max((c for p, c in counts.items() if p not in chosen), default=0)
        assert min(counts[p] for p in chosen) >= left_out
        assert sorted(found.probs, reverse=True) == pytest.approx(
            sorted(counts[p] / (len(follows) + 1) for p in chosen)[::-1]
        )


def test_the_pool_holds_at_most_its_tokens_and_forgets_the_oldest():
    pool = SuffixPool(100)
    for k in range(200):
        pool.add([k % 50 + 100, 1, 2, 3, k])  # `1 2 3` then the request's own number
    assert len(pool) <= 100
    found = pool.lookup([1, 2, 3], SuffixOptions(max_matches=64, scan=64, pool_nodes=64, min_prob=0.0))
    assert {b[0] for b in found.branches} == set(range(180, 200))  # the last 20 requests only
    assert pool.entries <= 2 * 100 and pool.entries == sum(map(len, pool.index.values()))
    assert pool.lookup([0, 199, 1, 2], OPTIONS).matches == 0  # gone
    big = SuffixPool(10)
    big.add(list(range(50)))  # a request longer than the pool: its last tokens are kept
    assert len(big) == 10 and big.lookup([41, 42, 43], OPTIONS).branches == [[44, 45, 46, 47, 48, 49]]


def test_the_pool_is_safe_under_the_servers_threads():
    pool = SuffixPool(5000)
    errors = []

    def writer(k: int) -> None:
        try:
            for i in range(200):
                pool.add([k, i % 7, 1, 2, 3, i % 5, k])
        except Exception as e:
            errors.append(e)

    def reader() -> None:
        try:
            for i in range(400):
                pool.lookup([9, i % 7, 1, 2, 3], OPTIONS)
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(3)] + [threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and pool.requests == 600 and len(pool) <= 5000
    found = pool.lookup([0, 1, 2, 3], SuffixOptions(pool_nodes=64, min_prob=0.0))
    assert {b[0] for b in found.branches} <= set(range(5)) and found.matches == OPTIONS.max_matches


def test_forks_share_one_pool_and_drafters_built_apart_do_not():
    """A server's requests are forks of its drafter: one pool, the grafted form's too. Two drafters built apart
    (two servers, two methods of a bench) learn apart."""
    one, two = make_drafter("suffix"), make_drafter("suffix")
    assert one.fork().pool is one.pool and one.pool is not two.pool
    grafted = make_drafter("layerskip+suffix:1", tiny_llama())
    assert grafted.name == "layerskip+suffix" and isinstance(grafted.lookup, SuffixDrafter)
    fork = grafted.fork()
    fork.finish([1, 2, 3, 4])
    assert grafted.lookup.pool.requests == 1 and fork.lookup.pool is grafted.lookup.pool
    with pytest.raises(ValueError, match="unknown drafter"):
        make_drafter("eagle+nothing")


def decoded(model, prompt: list[int], drafter: Drafter, max_new_tokens: int) -> Request:
    """`prompt` decoded alone to its end with `drafter` (its request: context, stats)."""
    batch = Batch(Target(model))
    request = batch.add(Request(list(prompt), drafter, max_new_tokens=max_new_tokens))
    while len(batch):
        batch.round()
    return request


def test_a_finished_request_teaches_the_next_one():
    """Decoded one after another, the second request drafts from the first's output (the target's greedy tokens):
    greedy identity holds and the second accepts more than the first, which had an empty pool."""
    model = tiny_llama()
    drafter = SuffixDrafter(SuffixOptions(min_ngram=3, max_ngram=3))
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    accepted = []
    for _ in range(2):
        request = decoded(model, prompt, drafter.fork(), 24)
        accepted.append(sum(request.stats.accepted_per_depth))
        outputs = request.context
    assert drafter.pool.requests == 2 and len(drafter.pool) == 2 * len(outputs)
    assert accepted[1] > accepted[0]


def test_the_pool_counts_its_lookups_hits_and_their_cost():
    """`stats` (what /metrics shows): the requests and tokens held, every lookup, a hit where the longest match
    reaches `min_match` (the pool's branches are drafted), lookup seconds in all and their p95."""
    pool = SuffixPool(1000)
    pool.add([1, 2, 3, 4, 5, 6, 7])
    pool.add([9, 9, 9])
    options = SuffixOptions(min_match=5)
    pool.lookup([1, 2, 3, 4, 5], options)  # a 5-token match: a hit
    pool.lookup([0, 3, 4, 5], options)  # a 3-token match: too short
    pool.lookup([8, 8, 8], options)  # nothing
    pool.lookup([5], options)  # shorter than a window
    stats = pool.stats()
    assert (stats["requests"], stats["tokens"], stats["lookups"], stats["hits"]) == (2, 10, 4, 1)
    assert stats["index_entries"] == 5 + 1
    assert 0 < stats["lookup_seconds_p95"] <= stats["lookup_seconds"]
    pool.clear()
    assert pool.stats()["lookups"] == 0


def test_no_pool_is_the_requests_own_lookup_and_pool_of_finds_it_through_wrappers():
    """`pool_tokens` 0 (`--no-suffix-pool`): no pool, nothing kept, the request's own lookup branches alone.
    `pool_of` finds a drafter's pool through a graft, a budget and forks; a drafter without one has None."""
    from headstart.runtime.drafters.lookup import LookupDrafter
    from headstart.runtime.drafters.suffix import pool_of
    from headstart.runtime.sizing.budgeted import Budgeted

    alone = SuffixDrafter(SuffixOptions(pool_tokens=0))
    context = [4, 5, 6, 7, 4, 5, 6]
    alone.finish(context)
    assert alone.pool is None and pool_of(alone) is None
    assert alone.find_branches(context) == LookupDrafter(SuffixOptions()).find_branches(context) == [[7, 4, 5, 6]]
    grafted = make_drafter("layerskip+suffix:1", tiny_llama())
    budgeted = Budgeted(grafted).fork()
    assert pool_of(budgeted) is grafted.lookup.pool is not None
    assert pool_of(make_drafter("layerskip+lookup:1", tiny_llama())) is None
    with pytest.raises(ValueError, match="pool_tokens"):
        SuffixOptions(pool_tokens=-1)


class _Counting(Drafter):
    """An inner drafter that proposes one fixed node and counts its draftings and rests."""

    def __init__(self) -> None:
        self.drafted, self.rested = 0, 0

    def propose(self, context: list[int]) -> DraftTree:
        self.drafted += 1
        return DraftTree([0], [-1])

    def rest(self) -> None:
        self.rested += 1


def test_a_confident_pool_drafts_alone_and_learns_its_calibration():
    """Where the pool's continuations expect `alone_gain` accepted nodes or more, the graft's tree is the pool's
    (its nodes first) with the request's own lookup branches, and the inner drafter rests; the pool records what it
    expected and how many of ITS nodes the target accepted, and that calibration scales its next estimates."""
    pool = SuffixPool(1000)
    for _ in range(3):
        pool.add([7, 8, 9, 1, 2, 3, 4])
    inner = _Counting()
    graft = LookupGraft(inner, SuffixDrafter(SuffixOptions(alone_gain=2.0), pool))
    context = [5, 1, 2, 3, 5, 6, 7, 8, 9]  # `7 8 9` was followed by `1 2 3 4` three times; `1 2 3` by `5` here
    tree = graft.propose(context)
    assert (inner.drafted, inner.rested) == (0, 1)
    assert tree.tokens[:4] == [1, 2, 3, 4] and tree.parents[:4] == [-1, 0, 1, 2]  # 3/4 each: gain 3
    graft.observe(tree, [0, 1], None, 9)  # two of the pool's nodes accepted, those at depths 1 and 2
    assert pool.expected[:5] == pytest.approx([0.75] * 4 + [0.0]) and pool.accepted[:5] == [1, 1, 0, 0, 0]
    assert pool.calibration == pytest.approx((8 + 2) / (8 + 3))
    first = pool.lookup(context, SuffixOptions()).probs[0]
    assert first == pytest.approx(0.75 * (8 * pool.calibration + 1) / (8 + 0.75))  # depth 1's own factor
    assert len(graft.propose([4, 4, 4, 6, 6])) == 1 and inner.drafted == 1  # no match: the inner tree alone
    graft.observe(DraftTree([0], [-1]), [0], None, 9)
    assert sum(pool.accepted) == 2  # a grafted round is not the pool's to record
    for _ in range(10):  # the pool misled: its estimates fall under alone_gain, the inner drafter drafts again
        pool.record([(d, 0.75, False) for d in (1, 2, 3, 4)])
    graft.propose(context)
    assert inner.drafted == 2


def _drafted_alone(pool: SuffixPool, accepts, rounds: int, **options) -> LookupGraft:
    """`rounds` rounds of a graft drafting the pool's tree alone at the context below, the k-th accepting the path
    `accepts(k)` (node indices), observed as a server would."""
    graft = LookupGraft(_Counting(), SuffixDrafter(SuffixOptions(**options), pool))
    for k in range(rounds):
        context = [10] * k + [6, 7, 8, 9]  # one token longer each round (`found` is searched once a length)
        tree = graft.propose(context)
        assert graft.alone is not None, k
        graft.observe(tree, [n for n in accepts(k) if n < len(tree)], None, 9)
    return graft


def test_the_pools_calibration_is_what_its_trees_accept_over_what_it_estimated():
    """The calibration learns the ratio of accepted nodes to the estimates before it: a pool whose trees (4 nodes
    estimated at 3/4 each) are accepted whole in half the rounds and not at all in the others learns 2/3 at every
    depth, its estimates become 1/2. (Recording the calibrated estimates instead, it learnt the ratio's square
    root, 0.82, and went on overrating its trees by 1.22x.)"""
    pool = SuffixPool(1000)
    for _ in range(3):
        pool.add([7, 8, 9, 1, 2, 3, 4])
    _drafted_alone(pool, lambda k: [0, 1, 2, 3] if k % 2 else [], 400, alone_gain=0.5)
    found = pool.lookup([0, 7, 8, 9], SuffixOptions())
    assert pool.calibration == pytest.approx(2 / 3, abs=0.01)
    assert found.probs == pytest.approx([0.5] * 4, abs=0.01)


def test_deep_nodes_the_target_never_takes_are_no_longer_drafted():
    """Matches that all agree rate every node of their branch alike (3/4 here), while the target takes the first
    two and never the third: each depth's factor is learnt apart, the first two nodes are then all but certain and
    the deeper ones fall under `min_prob` (one factor for every depth rated all four alike)."""
    pool = SuffixPool(1000)
    for _ in range(3):
        pool.add([7, 8, 9, 1, 2, 3, 4])
    _drafted_alone(pool, lambda k: [0, 1], 100, alone_gain=0.5)
    found = pool.lookup([0, 7, 8, 9], SuffixOptions())
    assert found.paths == [(1,), (1, 2)] and min(found.probs) > 0.9


def test_drafting_alone_keeps_greedy_identity():
    """A request repeating an earlier one drafts alone from the pool in most rounds (a layerskip drafter resting),
    and its tokens are the target's greedy ones."""
    model = tiny_llama()
    drafter = make_drafter("layerskip+suffix:1", model)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    runs = [decoded(model, prompt, drafter.fork(), 32).context for _ in range(2)]
    assert runs[0] == runs[1] == decoded(model, prompt, Drafter(), 32).context
    assert sum(drafter.lookup.pool.expected) > 0  # the second request drafted alone


def test_drafting_alone_keeps_the_targets_distribution(tiny_drafters):
    """The 3,000-run chi-square of the drafter contract with the pool's trees drafted alone in most rounds
    (`alone_gain` low): the pool fills with the runs before, as in service, and the heads rest those rounds."""
    model, tokenizer, options = tiny_drafters
    drafter = make_drafter("eagle+suffix", model, tokenizer, **options["eagle"], alone_gain=0.3, min_prob=0.1)
    rounds = {"alone": 0, "all": 0}
    observe = LookupGraft.observe

    def counting(self, tree, path, hidden, next_token):
        rounds["alone"] += self.alone is not None
        rounds["all"] += 1
        observe(self, tree, path, hidden, next_token)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LookupGraft, "observe", counting)
        assert_first_three_follow_target(model, PROMPTS[0], drafter, runs=3000)
    assert rounds["alone"] > rounds["all"] / 2, rounds


def test_under_the_load_budget_a_confident_pool_offers_its_tree_alone():
    """Served with the load budget (`Budgeted`), a suffix graft whose pool found continuations offers their tree alone
    (the pool's nodes, likeliest first, then the request's own lookup branches), cut, each cut worth what the pool
    expects of it, besides the inner drafter's tree with the pool's branches grafted on; the plan chooses. Taken,
    the pool's tree alone is cut to the plan and the heads rest, and the pool records which of the nodes drafted
    were accepted."""
    from headstart.runtime.drafters.base import Offer
    from headstart.runtime.drafters.together import drive
    from headstart.runtime.sizing.budgeted import Budgeted

    pool = SuffixPool(1000)
    for _ in range(3):
        pool.add([7, 8, 9, 1, 2, 3, 4])
    inner = _Counting()
    drafter = Budgeted(LookupGraft(inner, SuffixDrafter(SuffixOptions(alone_gain=2.0), pool)))
    context = [5, 1, 2, 3, 5, 6, 7, 8, 9]
    every = drafter.offers(context)
    offers = [o for o in every if o.pool]
    assert offers == [Offer(n, pytest.approx(0.75 * n), 0.0, graft=True, pool=True) for n in (1, 2, 4)]  # 3/4 each
    grafted = next(o for o in every if o.graft and o.heads and not o.pool)  # or the pool's branches on the inner's
    assert drive(drafter.drafting(context, grafted)).tokens[:2] == [0, 1] and (inner.drafted, inner.rested) == (1, 0)
    tree = drive(drafter.drafting([*context, 1, 2, 7, 8, 9], offers[1]))
    assert tree.tokens == [1, 2] and (inner.drafted, inner.rested) == (1, 1)
    drafter.observe(tree, [0, 1], None, 9)
    assert pool.expected[:3] == pytest.approx([0.75, 0.75, 0.0]) and pool.accepted[:3] == [1, 1, 0]  # as drafted
    assert not drafter.graft_seen.any()  # the pool's round is not the graft's hit rate

"""Prompt lookup: the branches it finds and the tree it builds, on hand-made contexts."""

import torch

from headstart.runtime.drafters.base import Drafter
from headstart.runtime.drafters.graft import LookupGraft
from headstart.runtime.drafters.lookup import LookupDrafter, build_trie
from headstart.runtime.drafters.options import LookupOptions
from headstart.runtime.sampling import SamplingParams
from headstart.runtime.tree import DraftTree


def test_longest_ngram_wins_and_recent_first():
    #            0  1  2  3  4  5  6  7  8  9 10 11
    context = [1, 2, 3, 9, 1, 2, 3, 8, 5, 2, 3]  # suffix (2, 3) ... and (1, 2, 3) does not end the context
    drafter = LookupDrafter(LookupOptions(max_ngram=3, min_ngram=2, branch_len=3, max_branches=4))
    # 3-gram (5, 2, 3) never occurred before; 2-gram (2, 3) occurred at 1 and 5: most recent first
    assert drafter.find_branches(context) == [[8, 5, 2], [9, 1, 2]]


def test_shorter_ngrams_fill_up_and_duplicates_merge():
    context = [4, 7, 1, 7, 1, 6, 7, 1]
    drafter = LookupDrafter(LookupOptions(max_ngram=2, min_ngram=1, branch_len=2, max_branches=3))
    # 2-gram (7, 1) at 1 and 3 -> [6, 7] (recent), [7, 1]; then 1-gram (1) at 2, 4 -> [6, 7] dup, [7, 1] dup
    assert drafter.find_branches(context) == [[6, 7], [7, 1]]


def test_no_match_gives_empty_tree():
    assert len(LookupDrafter().propose([1, 2, 3, 4])) == 0
    assert len(LookupDrafter().propose([5])) == 0


def test_trie_merges_shared_prefixes_under_budget():
    #   root -> 8 -> 5 -> 2
    #             \-> 6
    #   root -> 9
    tree = build_trie([[8, 5, 2], [8, 6], [9, 1]], budget=5)
    assert tree.tokens == [8, 5, 2, 6, 9]
    assert tree.parents == [-1, 0, 1, 0, -1]
    assert tree.draft_probs is None  # deterministic guesses: point masses


def test_propose_uses_trie():
    context = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2]
    tree = LookupDrafter(LookupOptions(max_ngram=2, min_ngram=2, branch_len=2)).propose(context)
    # (1, 2) occurred at 4 -> [3, 5] and at 0 -> [3, 4]: shared first token
    assert tree.tokens == [3, 5, 4] and tree.parents == [-1, 0, 0]


def test_graft_adds_only_what_the_tree_lacks():
    #   heads' tree:  root -> 8 -> 5          lookup branches [8, 5, 2], [9, 1, 4]
    #                     \-> 6
    #   grafted:      root -> 8 -> 5 -> 2      (8, 5 reused; 2 added under 5)
    #                     \-> 6
    #                     \-> 9 -> 1          (budget 3: the third new node, 4, is left out)
    heads_tree = DraftTree([8, 6, 5], [-1, -1, 0])
    tree = build_trie([[8, 5, 2], [9, 1, 4]], budget=3, onto=heads_tree)
    assert tree.tokens == [8, 6, 5, 2, 9, 1]
    assert tree.parents == [-1, -1, 0, 2, -1, 4]
    assert heads_tree.tokens == [8, 6, 5]  # the drafter's own tree is not changed


def test_graft_onto_a_sampled_tree_adds_point_masses():
    #   sampled tree: root -> 8 (q0) -> 5 (q1)     lookup branch [8, 2]
    #   grafted:      root -> 8 (q0) -> 5 (q1)     2 added under 8, after its sampled child 5:
    #                               \-> 2 (one-hot q at 2)
    q = torch.softmax(torch.randn(2, 10), -1)
    tree = build_trie([[8, 2]], budget=4, onto=DraftTree([8, 5], [-1, 0], q))
    assert tree.tokens == [8, 5, 2] and tree.parents == [-1, 0, 0]
    assert torch.equal(tree.draft_probs[:2], q)
    assert tree.draft_probs[2].tolist() == [0.0] * 2 + [1.0] + [0.0] * 7


class FixedTree(Drafter):
    """A mock drafter: always the same tree; remembers what it observed."""

    def __init__(self, tree: DraftTree) -> None:
        self.tree, self.seen = tree, []

    def propose(self, context):
        return self.tree

    def observe(self, tree, path, hidden, next_token):
        self.seen.append((tree, path, next_token))


def test_lookup_graft_at_every_temperature():
    context = [1, 2, 3, 4, 1, 2, 3]  # (2, 3) occurred at 1: lookup proposes [4, 1, 2, 3]
    inner = FixedTree(DraftTree([4, 7], [-1, 0]))
    drafter = LookupGraft(inner, budget=2)
    assert drafter.name == "none+lookup"
    drafter.start(context[:-1], None, SamplingParams(0.0))
    grafted = drafter.propose(context)
    assert grafted.tokens == [4, 7, 1, 2] and grafted.parents == [-1, 0, 0, 2]
    drafter.observe(grafted, [0, 2], torch.zeros(3, 4), 9)
    assert inner.seen == [(grafted, [0, 2], 9)]  # the inner drafter sees the tree the target verified
    inner.tree = DraftTree([4, 7], [-1, 0], torch.full((2, 10), 0.1))  # sampled: q per node
    drafter.start(context[:-1], None, SamplingParams(1.0))
    grafted = drafter.propose(context)
    assert grafted.tokens == [4, 7, 1, 2] and grafted.draft_probs[2:].argmax(1).tolist() == [1, 2]


def test_the_lookup_drafter_is_its_branches_grafted_onto_nothing():
    """`lookup` as built (`registry.make_drafter`: a graft onto the none drafter, so the load budget values what it
    finds now) drafts `LookupDrafter.propose`'s tree, its budget and n-grams as given."""
    from headstart.runtime.drafters.registry import make_drafter

    contexts = [[3, 5, 7, 1, 2, 9, 9, 4, 6, 8, 3, 5], [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2], [4, 4, 4, 4], [8, 9]]
    for options in ({}, {"budget": 3}, {"max_ngram": 4, "min_ngram": 1, "max_branches": 3}):
        drafter, alone = make_drafter("lookup", **options), LookupDrafter(LookupOptions(**options))
        assert drafter.name == "lookup"
        for context in contexts:
            tree, want = drafter.propose(context), alone.propose(context)
            assert (tree.tokens, tree.parents) == (want.tokens, want.parents), (options, context)

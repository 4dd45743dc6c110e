"""Tree attention masks and position ids against masks drawn out by hand."""

import math

import pytest
import torch
from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig

from headstart.heads.masks import additive_mask
from headstart.runtime.attention import AttentionLayout
from headstart.runtime.sampling import SamplingParams
from headstart.runtime.tree import DraftTree, ShapeSampler, TreeGrower, tree_visibility


def allowed(mask: torch.Tensor) -> torch.Tensor:
    """A float 4D mask as a 0/1 int matrix (1 = may attend)."""
    return (mask[0, 0] == 0).int()


def test_chain_tree_mask_is_causal():
    # root r, then a chain a -> b -> c; 2 committed tokens P0 P1.
    tree = DraftTree(tokens=[10, 11, 12], parents=[-1, 0, 1])
    visible, pos = tree_visibility(tree, past_len=2)
    drawn = torch.tensor(
        [
            # P0 P1  r  a  b  c
            [1, 1, 1, 0, 0, 0],  # r
            [1, 1, 1, 1, 0, 0],  # a
            [1, 1, 1, 1, 1, 0],  # b
            [1, 1, 1, 1, 1, 1],  # c
        ]
    )
    assert torch.equal(visible.int(), drawn)
    assert pos.tolist() == [2, 3, 4, 5]


def test_branching_tree_mask():
    # root r has children a, b; a has children c, d; b has child e; c has child f.
    #
    #          r
    #        /   \
    #       a     b
    #      / \     \
    #     c   d     e
    #     |
    #     f
    tree = DraftTree(tokens=[5, 6, 7, 8, 9, 4], parents=[-1, -1, 0, 0, 1, 2])
    visible, pos = tree_visibility(tree, past_len=3)
    drawn = torch.tensor(
        [
            # P0 P1 P2 r  a  b  c  d  e  f
            [1, 1, 1, 1, 0, 0, 0, 0, 0, 0],  # r
            [1, 1, 1, 1, 1, 0, 0, 0, 0, 0],  # a
            [1, 1, 1, 1, 0, 1, 0, 0, 0, 0],  # b
            [1, 1, 1, 1, 1, 0, 1, 0, 0, 0],  # c
            [1, 1, 1, 1, 1, 0, 0, 1, 0, 0],  # d
            [1, 1, 1, 1, 0, 1, 0, 0, 1, 0],  # e
            [1, 1, 1, 1, 1, 0, 1, 0, 0, 1],  # f
        ]
    )
    assert torch.equal(visible.int(), drawn)
    #                    r  a  b  c  d  e  f
    assert pos.tolist() == [3, 4, 4, 5, 5, 5, 6]
    # masked entries are the dtype's most negative value, never a bool
    mask = additive_mask(visible, torch.float32)
    assert mask.shape == (1, 1, 7, 10) and torch.equal(allowed(mask), drawn)
    assert mask.dtype == torch.float32 and mask.min() == torch.finfo(torch.float32).min
    assert tree.children() == [[0, 1], [2, 3], [4], [5], [], [], []]
    assert tree.path_to(5) == [0, 2, 5]


def test_bf16_mask_and_empty_tree():
    visible, pos = tree_visibility(DraftTree(), past_len=4)
    mask = additive_mask(visible, torch.bfloat16)
    assert mask.dtype == torch.bfloat16 and mask.shape == (1, 1, 1, 5) and (mask == 0).all()
    assert pos.tolist() == [4]


def test_sliding_window_tree_mask():
    """Window 3: a query at position i sees keys at positions > i - 3 (itself and the two before), as
    transformers' sliding layers do; the tree's branches are positioned by depth, not by index."""
    #          r          past P0..P3 (positions 0-3), root r at 4,
    #        /   \         a, b at 5, c at 6 (child of a)
    #       a     b
    #       |
    #       c
    tree = DraftTree(tokens=[5, 6, 7], parents=[-1, -1, 0])
    visible, pos = tree_visibility(tree, past_len=4)
    layout = AttentionLayout(MistralConfig(sliding_window=3))
    drawn = torch.tensor(
        [
            # P0 P1 P2 P3 r  a  b  c
            [0, 0, 1, 1, 1, 0, 0, 0],  # r (4): sees 2, 3, 4
            [0, 0, 0, 1, 1, 1, 0, 0],  # a (5): sees 3, 4 and itself
            [0, 0, 0, 1, 1, 0, 1, 0],  # b (5)
            [0, 0, 0, 0, 1, 1, 0, 1],  # c (6): sees r, a, itself
        ]
    )
    assert torch.equal(allowed(layout.masks(visible, pos, 4, torch.float32, "cpu")), drawn)
    types = ["sliding_attention", "full_attention"]
    mixed = AttentionLayout(Gemma3TextConfig(sliding_window=3, num_hidden_layers=2, layer_types=types))
    masks = mixed.masks(visible, pos, 4, torch.float32, "cpu")
    assert torch.equal(allowed(masks["sliding_attention"]), drawn)
    assert torch.equal(allowed(masks["full_attention"]), visible.int())
    assert AttentionLayout(LlamaConfig()).window is None


@pytest.mark.parametrize(
    "tokens,parents",
    [([1, 2], [-1, 1]), ([1, 2], [0, -1]), ([1], [-2]), ([1, 2], [-1])],
)
def test_malformed_trees_are_refused(tokens, parents):
    with pytest.raises(ValueError):
        DraftTree(tokens, parents)


def test_shape_sampler_draws_siblings_without_replacement_and_records_q():
    from headstart.runtime.sampling import SamplingParams, target_probs
    from headstart.runtime.tree import ShapeSampler

    #        root
    #      /      \
    #     a        b          shape (0,) (1,) (0,0) (0,1) (1,0): a gets 2 children, b 1
    #    / \       |
    #  a0   a1     b0
    shape = [(0,), (1,), (0, 0), (0, 1), (1, 0)]
    params = SamplingParams(temperature=0.7, top_p=0.95)
    draft_ids = torch.tensor([5, 2, 7, 0])  # a reduced draft vocabulary of 4 of V = 9 tokens
    to_target = draft_ids.__getitem__
    logits = torch.tensor([[2.0, 1.5, 0.5, -1.0], [0.3, 0.2, 0.1, 0.0], [1.0, 3.0, 0.0, 0.5]])
    for seed in range(20):
        grow = ShapeSampler(shape, params, vocab_size=9, generator=torch.Generator().manual_seed(seed))
        first = grow.add_children([-1], logits[:1], to_target)
        assert first == [0, 1] and grow.choose(first) == [0, 1]
        second = grow.add_children(first, logits[1:], to_target)
        assert second == [2, 3, 4] and grow.choose(second) == []  # leaves of the shape
        tree = grow.tree()
        assert tree.parents == [-1, -1, 0, 0, 1]
        q = torch.zeros(3, 9)
        q[:, draft_ids] = target_probs(logits, params)  # zero outside the draft vocabulary
        for siblings, row in (([0, 1], q[0]), ([2, 3], q[1]), ([4], q[2])):
            assert len({tree.tokens[i] for i in siblings}) == len(siblings)  # without replacement
            expected = row.clone()
            for node in siblings:  # each drew from q minus the earlier siblings, renormalised
                torch.testing.assert_close(tree.draft_probs[node], expected / expected.sum())
                assert expected[tree.tokens[node]] > 0
                expected[tree.tokens[node]] = 0


def test_shape_sampler_draws_follow_the_q_it_records():
    # 30,000 nodes with two children each, drawn in one call: the first child's token follows q, the pair
    # (first, second) follows q(a) q(b) / (1 - q(a)); each child's recorded row is what it was drawn from
    from headstart.runtime.sampling import SamplingParams, target_probs
    from headstart.runtime.tree import ShapeSampler
    from helpers.stats import chi_square_pvalue

    params, n = SamplingParams(temperature=0.9, top_p=0.9), 30_000
    logits = torch.tensor([[1.5, 1.0, 0.5, 0.0, -0.5, -3.0]])
    q = target_probs(logits, params)[0].double()  # top-p 0.9 leaves the last tokens at 0
    assert (q == 0).any()
    grow = ShapeSampler([(0,), (1,)], params, vocab_size=6, generator=torch.Generator().manual_seed(7))
    grow.add_children([-1] * n, logits.expand(n, -1))  # n independent roots' children in one batched draw
    tree = grow.tree()
    first, second = torch.tensor(tree.tokens[0::2]), torch.tensor(tree.tokens[1::2])
    assert len(first) == len(second) == n and not (first == second).any()
    assert q[first].min() > 0 and q[second].min() > 0  # never a token q gives 0
    pair = torch.zeros(6, 6, dtype=torch.float64).index_put_(
        (first, second), torch.ones(n, dtype=torch.float64), accumulate=True
    )
    joint = q[:, None] * q[None, :] / (1 - q[:, None])
    joint.fill_diagonal_(0)
    assert chi_square_pvalue(pair.sum(1), q) > 1e-3
    assert chi_square_pvalue(pair, joint) > 1e-3
    for i in (0, 1):  # the rows recorded for node pair i: q, then q without the first draw
        torch.testing.assert_close(tree.draft_probs[2 * i].double(), q)
        without = q.clone()
        without[first[i]] = 0
        torch.testing.assert_close(tree.draft_probs[2 * i + 1].double(), without / without.sum())


def test_shape_sampler_stops_when_q_runs_out():
    from headstart.runtime.sampling import SamplingParams
    from headstart.runtime.tree import ShapeSampler

    grow = ShapeSampler([(0,), (1,), (2,)], SamplingParams(temperature=1.0, top_k=2), 5, torch.Generator())
    grow.add_children([-1], torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0]]))
    tree = grow.tree()
    assert sorted(tree.tokens) == [3, 4] and tree.parents == [-1, -1]  # top-k 2 leaves two tokens


def test_shape_sampler_gives_children_only_to_paths_likely_enough():
    """Every node of the shape has two children (three deep). q over 3 tokens: (0.6, 0.4, 0) at the root,
    (0.5, 0.5, 0) below it, so whatever the order of the draws, the path probabilities are

        root ├─ x (tok 0) 0.6  ├─ 0.6 x 0.5 = 0.30  → children (>= 0.25)
             │                 └─ 0.6 x 0.5 = 0.30  → children
             └─ y (tok 1) 0.4  ├─ 0.4 x 0.5 = 0.20  → none (< 0.25)
                               └─ 0.4 x 0.5 = 0.20  → none

    With min_prob 0.25 both depth-1 nodes are expanded and only x's children at depth 2; with 0.5 only x."""
    from headstart.runtime.tree import ShapeSampler

    shape = [(0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1), (0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
    root, below = torch.tensor([[0.6, 0.4, 0.0]]).log(), torch.tensor([[0.5, 0.5, 0.0]]).log()
    at_root = [0.6, 0.4]  # q of each token at the root
    for seed in range(5):
        grow = ShapeSampler(shape, SamplingParams(1.0), 3, torch.Generator().manual_seed(seed), min_prob=0.25)
        first = grow.add_children([-1], root)
        assert [math.exp(grow.scores[n]) for n in first] == pytest.approx([at_root[grow.tokens[n]] for n in first])
        assert grow.choose(first) == first
        second = grow.add_children(first, below.expand(2, -1))
        assert [math.exp(grow.scores[n]) for n in second] == pytest.approx(
            [at_root[grow.tokens[grow.parents[n]]] * 0.5 for n in second]
        )
        assert grow.choose(second) == [n for n in second if grow.tokens[grow.parents[n]] == 0]
        strict = ShapeSampler(shape, SamplingParams(1.0), 3, torch.Generator().manual_seed(seed), min_prob=0.5)
        first = strict.add_children([-1], root)
        assert [strict.tokens[n] for n in strict.choose(first)] == [0]


def test_tree_growth_stops_once_no_child_can_enter_the_budget():
    """top_k 2. Path probabilities (tokens 0, 1, 2 at every node):

        root ├─ a (tok 0) 0.5  ├─ c (tok 0) 0.5 x 0.5 = 0.25
             │                 └─ d (tok 1) 0.5 x 0.3 = 0.15
             └─ b (tok 1) 0.4  ├─ e (tok 0) 0.4 x 0.9 = 0.36
                               └─ f (tok 1) 0.4 x 0.06 = 0.024

    Budget 3 keeps a, b, e. The best frontier node, e, is itself the 3rd best: its children score at
    most 0.36 and come later, so none can enter; growth stops (one head forward saved). With budget 4
    the 4th best is c (0.25) < e: e and c are expanded."""

    def grown(budget: int):
        grow = TreeGrower(top_k=2, budget=budget)
        frontier = grow.add_children([-1], torch.tensor([[0.5, 0.4, 0.1]]).log())
        children = torch.tensor([[0.5, 0.3, 0.2], [0.9, 0.06, 0.04]]).log()
        return grow, grow.add_children(grow.choose(frontier), children)

    grow, frontier = grown(budget=3)
    assert [grow.scores[n] for n in frontier] == pytest.approx(torch.tensor([0.25, 0.15, 0.36, 0.024]).log().tolist())
    assert grow.choose(frontier) == []
    tree = grow.tree()
    assert (tree.tokens, tree.parents) == ([0, 1, 0], [-1, -1, 1])  # a, b, then e under b
    grow, frontier = grown(budget=4)
    assert grow.choose(frontier) == [frontier[2], frontier[0]]  # e, c


def test_tree_growth_stops_below_min_prob():
    """The tree of the test above, budget 4, min_prob 0.4: a (0.5) is likely enough to expand; at the next
    depth the best frontier path, e, has 0.36 < 0.4: its children would add at most 0.36 tokens."""
    grow = TreeGrower(top_k=2, budget=4, min_prob=0.4)
    frontier = grow.add_children([-1], torch.tensor([[0.5, 0.4, 0.1]]).log())
    assert grow.choose(frontier) == frontier  # a, b
    frontier = grow.add_children(frontier, torch.tensor([[0.5, 0.3, 0.2], [0.9, 0.06, 0.04]]).log())
    assert grow.choose(frontier) == []


def test_sampled_siblings_are_drawn_without_replacement_from_what_they_record():
    """A root with 3 sampled children over q = (0.5, 0.3, 0.15, 0.05, 0) (T = 1): 12,000 draws. Child 1 follows q,
    child 2 q without child 1 (renormalised), child 3 q without both; each child records exactly that row; the
    token of probability 0 never comes out, nor a repeated sibling; with top_k = 2 only two children exist."""
    q = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    logits = q.log()[None].expand(2, 5)  # two parents with the same q: rows drawn independently
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(3, 5)
    for _ in range(12_000 // 2):
        sampler = ShapeSampler([(0,), (1,), (2,), (0, 0)], SamplingParams(1.0), 5, gen)
        sampler.paths = [(0,)]  # node 0 stands for a second parent with the root's shape below it
        sampler.kids[(0,)] = sampler.kids[()]
        new = sampler.add_children([-1, 0], logits)
        assert len(new) == 6
        for i, node in enumerate(new):
            j, token = i % 3, sampler.tokens[node]
            drawn_before = [sampler.tokens[n] for n in new[i - j : i]]
            assert token not in drawn_before and q[token] > 0
            want = q.clone()
            want[drawn_before] = 0
            torch.testing.assert_close(sampler.rows[node], want / want.sum())
            counts[j, token] += 1
    freq = counts / counts.sum(-1, keepdim=True)
    second = sum(q[a] * torch.where(torch.arange(5) == a, 0.0, q / (1 - q[a])) for a in range(4))
    third = sum(
        q[a]
        * q[b]
        / (1 - q[a])
        * torch.where((torch.arange(5) == a) | (torch.arange(5) == b), 0.0, q / (1 - q[a] - q[b]))
        for a in range(4)
        for b in range(4)
        if a != b
    )
    for got, want in zip(freq, (q, second, third), strict=True):
        torch.testing.assert_close(got, want, atol=0.02, rtol=0)  # 4 standard errors
    sampler = ShapeSampler([(0,), (1,), (2,)], SamplingParams(1.0, top_k=2), 5, gen)
    assert len(sampler.add_children([-1], q.log()[None])) == 2  # q has two tokens left after top-k

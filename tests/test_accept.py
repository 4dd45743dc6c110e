"""accept_path is exact: the output distribution equals the target's, by exact enumeration and by sampling.

The world: a vocabulary of V = 8 tokens; the target's next-token logits and the draft's are fixed
pseudo-random functions of the prefix, in float64. The tree (several siblings per node, depth 2):

        root
       /    \\
     n0      n1
    /  \\
  n2    n3

A round outputs the accepted path plus one more token, 1 to 3 tokens. Extending every outcome to
3 tokens with the target's own conditionals (what the next rounds would do) must give exactly the
target's joint distribution over V^3.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from functools import cache

import pytest
import torch

from headstart.runtime.accept import accept_path
from headstart.runtime.sampling import Rng, SamplingParams, target_probs
from headstart.runtime.tree import DraftTree
from helpers.stats import chi_square_pvalue

V = 8
PARENTS = [-1, -1, 0, 0]
LENGTH = 3  # max depth + 1


@cache
def world_logits(prefix: tuple[int, ...], salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash((salt, *prefix)) % (1 << 62))
    return 2.0 * torch.randn(V, generator=g, dtype=torch.float64)


@cache
def p_target(prefix, params):
    return target_probs(world_logits(prefix, 0), params)


@cache
def q_draft(prefix):
    return torch.softmax(0.6 * world_logits(prefix, 1) + world_logits(prefix, 0), -1)  # related to p, not equal


def node_prefix(tokens, node, parents=PARENTS):
    path = []
    while node >= 0:
        path.append(tokens[node])
        node = parents[node]
    return tuple(path[::-1])


def target_rows(tokens, parents=PARENTS):
    """(n+1, V) float64 target logits at the root and at each node."""
    rows = [world_logits((), 0)] + [world_logits(node_prefix(tokens, i, parents), 0) for i in range(len(tokens))]
    return torch.stack(rows)


# ---- enumeration of every random outcome -------------------------------------------------------


class NeedChoice(Exception):
    def __init__(self, options):
        self.options = options  # [(value, probability)]


class ScriptedRandom:
    """Replays a script of earlier choices; at the first unscripted draw, reports its options."""

    def __init__(self, script):
        self.script = script
        self.i = 0

    def _next(self, options):
        if self.i < len(self.script):
            self.i += 1
            return self.script[self.i - 1]
        raise NeedChoice(options)

    def bernoulli(self, prob):
        prob = min(1.0, prob)
        return self._next([(True, prob), (False, 1 - prob)])

    def categorical(self, probs):
        probs = probs / probs.sum()
        return self._next([(k, float(pk)) for k, pk in enumerate(probs) if pk > 0])


def enumerate_outcomes(run) -> dict:
    """{outcome: exact probability} over every sequence of random choices `run(rng)` can make."""
    outcomes = defaultdict(float)
    stack = [([], 1.0)]
    while stack:
        script, prob = stack.pop()
        try:
            outcome = run(ScriptedRandom(script))
        except NeedChoice as choice:
            stack.extend(([*script, value], prob * pr) for value, pr in choice.options if pr > 0)
            continue
        outcomes[outcome] += prob
    return outcomes


def extend_to_length(outcomes: dict, params, length=LENGTH) -> torch.Tensor:
    """Joint over V^length: each round outcome continued with the target's conditionals."""
    joint = torch.zeros((V,) * length, dtype=torch.float64)
    for seq, prob in outcomes.items():
        for tail in itertools.product(range(V), repeat=length - len(seq)):
            full = seq + tail
            pr = prob
            for t in range(len(seq), length):
                pr *= float(p_target(full[:t], params)[full[t]])
            joint[full] += pr
    return joint


def target_joint(params, length=LENGTH) -> torch.Tensor:
    joint = torch.zeros((V,) * length, dtype=torch.float64)
    for seq in itertools.product(range(V), repeat=length):
        joint[seq] = float(torch.prod(torch.stack([p_target(seq[:t], params)[seq[t]] for t in range(length)])))
    return joint


def round_outcome(tree, params, rng):
    acc = accept_path(tree, target_rows(tree.tokens, tree.parents), params, rng)
    return (*tuple(tree.tokens[i] for i in acc.path), acc.next_token)


# ---- trees the drafters can produce, with their probability ------------------------------------


def point_mass_tree():
    """Deterministic drafts, siblings being a draft's top-2: ranked by p's logits, so that they lie in
    the support of p even after top-k / top-p and paths to depth 2 can be accepted."""
    tokens = []
    for node, parent in enumerate(PARENTS):
        ranking = world_logits(node_prefix(tokens, parent), 0).argsort(descending=True)
        rank = [c for c in range(len(PARENTS)) if PARENTS[c] == parent].index(node)
        tokens.append(int(ranking[rank]))
    return DraftTree(tokens, PARENTS)


def sampled_trees(replacement: bool):
    """Every tree the sampling drafter can draw, with its probability; rows of q as really drawn from."""
    for tokens in itertools.product(range(V), repeat=len(PARENTS)):
        prob, rows = 1.0, []
        for node, parent in enumerate(PARENTS):
            q = q_draft(node_prefix(tokens, parent)).clone()
            if not replacement:
                for sibling in range(node):
                    if PARENTS[sibling] == parent:
                        q[tokens[sibling]] = 0
                q = q / q.sum()
            prob *= float(q[tokens[node]])
            rows.append(q)
        if prob > 0:
            yield prob, DraftTree(list(tokens), PARENTS, torch.stack(rows))


PARAMS = [SamplingParams(1.0), SamplingParams(0.7, top_k=6, top_p=0.9)]


@pytest.mark.parametrize("params", PARAMS, ids=["T1", "T0.7-k6-p0.9"])
def test_exact_point_mass_proposals(params):
    tree = point_mass_tree()
    outcomes = enumerate_outcomes(lambda rng: round_outcome(tree, params, rng))
    assert abs(sum(outcomes.values()) - 1) < 1e-12
    assert max(len(seq) for seq in outcomes) == LENGTH  # paths to depth 2 are accepted sometimes
    assert (extend_to_length(outcomes, params) - target_joint(params)).abs().max() < 1e-9


@pytest.mark.parametrize("replacement", [True, False], ids=["with-replacement", "without-replacement"])
def test_exact_sampled_proposals(replacement):
    """All V^4 = 4096 draft trees, each enumerated."""
    params = SamplingParams(1.0)
    outcomes = defaultdict(float)
    for tree_prob, tree in sampled_trees(replacement):
        for seq, prob in enumerate_outcomes(lambda rng, tree=tree: round_outcome(tree, params, rng)).items():
            outcomes[seq] += tree_prob * prob
    assert abs(sum(outcomes.values()) - 1) < 1e-9
    assert (extend_to_length(outcomes, params) - target_joint(params)).abs().max() < 1e-9


def test_exact_sampled_proposals_with_grafted_point_masses():
    """Prompt-lookup branches grafted onto every sampled tree (`eagle+lookup` at T > 0): the branches
    [a, b] (the target's likeliest root token, then its likeliest next) and [z] (the root's least
    likely token, outside top-k 6: never accepted) reuse a sampled node when one has the token, else
    add a point mass after the sampled siblings. All V^4 trees, each enumerated."""
    from headstart.runtime.drafters.lookup import build_trie

    params = PARAMS[1]
    root = world_logits((), 0).argsort(descending=True).tolist()
    a, z = root[0], root[-1]
    b = int(world_logits((a,), 0).argmax())
    outcomes = defaultdict(float)
    reused = added = 0
    for tree_prob, sampled in sampled_trees(replacement=False):
        tree = build_trie([[a, b], [z]], budget=3, onto=sampled)
        assert tree.tokens[:4] == sampled.tokens and torch.equal(tree.draft_probs[:4], sampled.draft_probs)
        assert (tree.draft_probs[4:].max(1).values == 1).all()  # the added nodes: point masses
        reused += a in sampled.tokens[:2]
        added += len(tree) - len(sampled)
        for seq, prob in enumerate_outcomes(lambda rng, tree=tree: round_outcome(tree, params, rng)).items():
            outcomes[seq] += tree_prob * prob
    assert reused and added  # both cases occur
    assert abs(sum(outcomes.values()) - 1) < 1e-9
    assert (extend_to_length(outcomes, params) - target_joint(params)).abs().max() < 1e-9


def test_greedy_accepts_the_argmax_path():
    params = SamplingParams(0.0)
    tree = point_mass_tree()
    rows = target_rows(tree.tokens)
    acc = accept_path(tree, rows, params, Rng(0))
    # walk by hand: at each node take the child equal to the target's argmax
    row, expected = 0, []
    while True:
        best = int(rows[row].argmax())
        kids = [c for c in range(len(PARENTS)) if PARENTS[c] == row - 1 and tree.tokens[c] == best]
        if not kids:
            break
        expected.append(kids[0])
        row = kids[0] + 1
    assert acc.path == expected and acc.next_token == int(rows[row].argmax())


def test_chi_square_sampled_rounds():
    """20,000 rounds with the real Rng, drafts sampled from q: first two output tokens vs the target.

    Fails when the chi-square p-value is below 1e-3: a correct implementation fails with probability
    0.1 % per seed (the seed is fixed, so the outcome is reproducible).
    """
    params = SamplingParams(1.0)
    rng = Rng(seed=1234)
    counts = torch.zeros(V, V + 1)  # second index V: the round ended after one token
    for _ in range(20_000):
        tokens, rows = [], []
        for parent in PARENTS:
            q = q_draft(node_prefix(tokens, parent))
            tokens.append(rng.categorical(q))
            rows.append(q)
        seq = round_outcome(DraftTree(tokens, PARENTS, torch.stack(rows)), params, rng)
        counts[seq[0], seq[1] if len(seq) > 1 else V] += 1
    # the first token is exactly p(.|root); a second token, when the round made one, follows p(.|first)
    first = counts.sum(1)
    assert chi_square_pvalue(first, p_target((), params)) > 1e-3
    two = counts[:, :V]
    two_probs = torch.stack([p_target((a,), params) * two[a].sum() for a in range(V)]) / two.sum()
    assert chi_square_pvalue(two, two_probs) > 1e-3


@pytest.mark.parametrize("params", PARAMS, ids=["T1", "T0.7-k6-p0.9"])
def test_exact_on_a_medusa_shaped_tree(params):
    """The tree the Medusa drafter builds: shape chosen from per-rank accuracies (3 deep, 7 nodes),
    node (i_1, ..., i_d) holding the i_d-th guess of head d whatever its parent, as Medusa heads do."""
    from headstart.runtime.tree import choose_tree_shape

    shape = choose_tree_shape([[0.6, 0.3, 0.1], [0.5, 0.3], [0.5, 0.2]], budget=7)
    assert max(map(len, shape)) == 3 and len({p[:1] for p in shape}) >= 2  # siblings, depth 3
    index = {path: i for i, path in enumerate(shape)}
    parents = [index[p[:-1]] if len(p) > 1 else -1 for p in shape]
    guesses = [world_logits((depth,), 2).argsort(descending=True).tolist() for depth in range(3)]
    tree = DraftTree([guesses[len(p) - 1][p[-1]] for p in shape], parents)
    outcomes = enumerate_outcomes(lambda rng: round_outcome(tree, params, rng))
    assert abs(sum(outcomes.values()) - 1) < 1e-12
    if params.top_p == 1:
        assert max(len(seq) for seq in outcomes) == 4  # the whole depth-3 path can be accepted
    assert (extend_to_length(outcomes, params, 4) - target_joint(params, 4)).abs().max() < 1e-9


@pytest.mark.parametrize("params", PARAMS, ids=["T1", "T0.7-k6-p0.9"])
def test_exact_on_an_eagle_shaped_tree(params):
    """A tree as the EAGLE drafter builds it: drafted by expanding the best paths depth by depth with
    the draft's own (parent-dependent) top-k, then reranked by cumulative log-probability to 6 nodes."""
    from headstart.runtime.tree import rerank

    tokens, parents, scores = [], [], []
    frontier = [-1]
    for _ in range(3):  # depth 3, top-k 2: expand the 2 best frontier nodes, 2 children each
        new = []
        for parent in sorted(frontier, key=lambda i: -scores[i] if i >= 0 else 0)[:2]:
            logq = q_draft(node_prefix(tokens, parent, parents)).log()
            for tok in logq.argsort(descending=True)[:2].tolist():
                new.append(len(tokens))
                tokens.append(tok)
                parents.append(parent)
                scores.append((scores[parent] if parent >= 0 else 0.0) + float(logq[tok]))
        frontier = new
    tree = rerank(tokens, parents, scores, budget=6)
    assert max(tree.depths) >= 2 and len(tree) == 6
    length = max(tree.depths) + 1
    outcomes = enumerate_outcomes(lambda rng: round_outcome(tree, params, rng))
    assert abs(sum(outcomes.values()) - 1) < 1e-12
    assert (extend_to_length(outcomes, params, length) - target_joint(params, length)).abs().max() < 1e-9


@pytest.mark.parametrize("params", PARAMS, ids=["T1", "T0.7-k6-p0.9"])
def test_exact_on_a_sampled_chain(params):
    """The chain the model and layerskip drafters sample at temperature > 0: each token drawn from the
    draft's logits under the same temperature / top-k / top-p (q), q recorded per node. All V^2 chains."""
    parents = [-1, 0]
    outcomes = defaultdict(float)
    for tokens in itertools.product(range(V), repeat=2):
        rows = [target_probs(world_logits(tokens[:i], 1), params) for i in range(2)]
        chain_prob = float(rows[0][tokens[0]] * rows[1][tokens[1]])
        if chain_prob == 0:
            continue
        tree = DraftTree(list(tokens), parents, torch.stack(rows))
        for seq, prob in enumerate_outcomes(lambda rng, tree=tree: round_outcome(tree, params, rng)).items():
            outcomes[seq] += chain_prob * prob
    assert abs(sum(outcomes.values()) - 1) < 1e-9
    assert (extend_to_length(outcomes, params) - target_joint(params)).abs().max() < 1e-9

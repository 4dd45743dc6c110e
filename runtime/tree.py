"""DraftTree: what every drafter proposes and the one verifier checks.

Node indices 0..n-1 are draft tokens. `parents[i]` is the index of node i's parent, or -1 for a
child of the root, the last token of the sequence that is not yet in the KV cache. Parents always
come before their children, and siblings appear in proposal order (the order `accept_path` tries
them).

Per node the tree keeps what exact verification needs: the draft distribution q the node was
sampled from (`draft_probs[i]`, a row over the vocabulary), or nothing when the drafter chose the
node deterministically (top-k, n-gram lookup), in which case its proposal is a point mass. When a
drafter samples siblings without replacement, row i is the distribution it really drew node i
from: q with the earlier siblings removed and renormalised.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import torch

from headstart.runtime.sampling import SamplingParams, draw, target_probs


@dataclass
class DraftTree:
    tokens: list[int] = field(default_factory=list)  # (n,) draft token ids
    parents: list[int] = field(default_factory=list)  # (n,) parent index, -1 = root
    draft_probs: torch.Tensor | None = None  # (n, V) q per node; None = every node is a point mass

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"{len(self.tokens)} tokens but {len(self.parents)} parents")
        for i, parent in enumerate(self.parents):
            if not -1 <= parent < i:
                raise ValueError(f"node {i} has parent {parent}; parents must precede their children")
        if self.draft_probs is not None and self.draft_probs.shape[0] != len(self.tokens):
            raise ValueError(f"draft_probs has {self.draft_probs.shape[0]} rows for {len(self.tokens)} nodes")

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depths(self) -> list[int]:
        """Depth of each node; the root's children are at depth 1."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return depths

    def children(self) -> list[list[int]]:
        """children()[0] holds the root's children, children()[i + 1] those of node i, in proposal order."""
        kids: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, parent in enumerate(self.parents):
            kids[parent + 1].append(i)
        return kids

    def ancestor_mask(self) -> torch.Tensor:
        """(n+1, n+1) bool: row r may attend column c. Row/column 0 is the root, r = i + 1 is node i."""
        n = len(self)
        mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        mask[:, 0] = True
        for i, parent in enumerate(self.parents):
            if parent >= 0:
                mask[i + 1] = mask[parent + 1]
            mask[i + 1, i + 1] = True
        mask[0, 0] = True
        return mask

    def prefix(self, n: int) -> DraftTree:
        """The first `n` nodes: a tree (parents come first), each node keeping its q; siblings past the cut are
        dropped from the end of their list, which a tree drawn without replacement allows (the ones kept were
        drawn first)."""
        if n >= len(self):
            return self
        q = None if self.draft_probs is None else self.draft_probs[:n]
        return DraftTree(self.tokens[:n], self.parents[:n], q)

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to `node`."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]


def tree_visibility(tree: DraftTree, past_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What each of the n+1 new positions (the root, then the nodes) may see, bool (n+1, past_len+n+1), and
    their position ids (n+1,): the whole committed prefix, its ancestors and itself; position = past_len + depth."""
    n = len(tree)
    allowed = torch.ones(n + 1, past_len + n + 1, dtype=torch.bool)
    allowed[:, past_len:] = tree.ancestor_mask()
    positions = torch.tensor([past_len, *(past_len + d for d in tree.depths)])
    return allowed, positions


def rerank(tokens: list[int], parents: list[int], scores: list[float], budget: int) -> DraftTree:
    """The `budget` nodes of highest cumulative log-prob as a DraftTree: by depth, siblings best first."""
    keep = sorted(range(len(tokens)), key=lambda i: -scores[i])[:budget]
    kept = set(keep)
    for i in keep:  # ties aside, a child never outranks its parent; keep ancestors all the same
        while parents[i] >= 0 and parents[i] not in kept:
            i = parents[i]
            kept.add(i)
    depth = {}
    for i in sorted(kept):  # parents have smaller indices than their children
        depth[i] = 1 if parents[i] < 0 else depth[parents[i]] + 1
    order = sorted(kept, key=lambda i: (depth[i], -scores[i]))
    new_index = {old: new for new, old in enumerate(order)}
    return DraftTree([tokens[i] for i in order], [new_index.get(parents[i], -1) for i in order])


class TreeGrower:
    """Bookkeeping of the EAGLE-2 dynamic tree, shared by the drafters that grow one (EAGLE, draft model).

    Depth by depth: `expand(frontier, past)` picks the `top_k` frontier nodes of highest cumulative
    log-probability and says what each may attend to; the drafter runs them in one forward and gives
    them their children with `add_children`. `tree()` reranks and keeps the `budget` best.
    Growth stops early, with the same tree, once no child of the frontier can enter the best `budget`
    (a child's cumulative log-probability never exceeds its parent's): a forward saved. It also stops
    once the best frontier path's draft probability is below `min_prob`: the children of a path
    with probability P add at most P accepted tokens in expectation (as far as the draft's q is
    calibrated), less than the drafter's forward costs when P is small.
    """

    def __init__(self, top_k: int, budget: int, min_prob: float = 0.0) -> None:
        self.top_k, self.budget = top_k, budget
        self.min_logp = math.log(min_prob) if min_prob > 0 else -math.inf
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.scores: list[float] = []  # cumulative log-probability of each node's path
        self.slot: dict[int, int] = {}  # expanded node -> index of its entry among the drafted entries

    def add_children(self, parents: list[int], logits: torch.Tensor, to_target=None) -> list[int]:
        """The `top_k` likeliest children of each of `parents` (-1 = root) from their logits (m, V);
        `to_target` maps indices of a reduced vocabulary to token ids. Returns the new nodes."""
        top = logits.float().log_softmax(-1).topk(self.top_k)  # (m, k): one top-k, one copy to the host
        ids = (top.indices if to_target is None else to_target(top.indices)).tolist()
        new = []
        for parent, row_ids, row_logp in zip(parents, ids, top.values.tolist(), strict=True):
            base = self.scores[parent] if parent >= 0 else 0.0
            new += range(len(self.tokens), len(self.tokens) + self.top_k)
            self.tokens += row_ids
            self.parents += [parent] * self.top_k
            self.scores += [base + lp for lp in row_logp]
        return new

    def expand(self, frontier: list[int], past: int) -> tuple[list[int], torch.Tensor]:
        """(the nodes to expand, bool (m, past + drafted + m): what each attends to — the `past` committed
        entries, its ancestors and itself). The chosen nodes become the next m drafted entries."""
        chosen = self.choose(frontier)
        return chosen, self.attend(chosen, past)

    def choose(self, frontier: list[int]) -> list[int]:
        """The frontier nodes to expand: the `top_k` of highest cumulative log-probability; none when
        the `budget`-th best drafted node already scores at least as high as the best of them (children
        come later in the drafted order, so they lose ties in `rerank`), or when the best of them is less
        likely than `min_prob`."""
        chosen = sorted(frontier, key=lambda i: -self.scores[i])[: self.top_k]
        if chosen and self.scores[chosen[0]] < self.min_logp:
            return []
        full = chosen and len(self.scores) >= self.budget
        if full and heapq.nlargest(self.budget, self.scores)[-1] >= self.scores[chosen[0]]:
            return []
        return chosen

    def attend(self, chosen: list[int], past: int) -> torch.Tensor:
        drafted = len(self.slot)
        allowed = torch.zeros(len(chosen), past + drafted + len(chosen), dtype=torch.bool)
        allowed[:, :past] = True
        for row, node in enumerate(chosen):
            self.slot[node] = drafted + row
            ancestor = node
            while ancestor >= 0:  # itself and its ancestors, all expanded at earlier depths
                allowed[row, past + self.slot[ancestor]] = True
                ancestor = self.parents[ancestor]
        return allowed

    @property
    def n_drafted(self) -> int:
        """Entries the drafter's cache gained while growing (to crop afterwards)."""
        return len(self.slot)

    def tree(self) -> DraftTree:
        return rerank(self.tokens, self.parents, self.scores, self.budget)


class ShapeSampler(TreeGrower):
    """A static tree shape filled with SAMPLED tokens, grown depth by depth like TreeGrower.

    `shape` lists nodes as paths of ranks, parents first (`choose_tree_shape`); it fixes
    how many children each node gets. A node's children are drawn from its draft distribution q (the
    decode's temperature / top-k / top-p applied to the draft logits) without replacement, and each
    child records the distribution it was really drawn from: q with the earlier siblings removed,
    renormalised. Whether a sibling is proposed never depends on its own token (only on the shape and
    on the earlier draws: fewer siblings when q has fewer tokens), which keeps `accept_path` exact.
    Ranks only order siblings: the j-th child drawn takes the j-th smallest rank among its node's
    children in the shape. A node gets its children only when its path is at least `min_prob` likely under
    q (the product of q over its tokens): a function of the path alone, as any proposal below an accepted
    node may be, so exactness holds; the children of an unlikely path rarely repay a draft forward.
    """

    def __init__(
        self,
        shape: list[tuple[int, ...]],
        sampling: SamplingParams,
        vocab_size: int,
        generator: torch.Generator,
        min_prob: float = 0.0,
    ) -> None:
        super().__init__(top_k=0, budget=len(shape), min_prob=min_prob)
        self.kids: dict[tuple[int, ...], list[tuple[int, ...]]] = {}  # path -> child paths, by rank
        for path in shape:
            self.kids.setdefault(path[:-1], []).append(path)
        for paths in self.kids.values():
            paths.sort()
        self.sampling, self.vocab_size, self.generator = sampling, vocab_size, generator
        self.paths: list[tuple[int, ...]] = []  # node -> its path in the shape
        self.rows: list[torch.Tensor] = []  # node -> (N,) the q it was drawn from
        self.to_target = None

    def _path(self, node: int) -> tuple[int, ...]:
        return self.paths[node] if node >= 0 else ()

    def choose(self, frontier: list[int]) -> list[int]:
        """Every frontier node that has children in the shape and a path at least `min_prob` likely under q."""
        return [n for n in frontier if self.kids.get(self._path(n)) and self.scores[n] >= self.min_logp]

    def add_children(self, parents: list[int], logits: torch.Tensor, to_target=None) -> list[int]:
        """Draw the shape's children of each of `parents` (-1 = root) from its logits (m, N); N < V when
        `to_target` maps a reduced vocabulary's indices to token ids. Returns the new nodes.

        Draw j of a row comes from q without draws 1..j-1, renormalised (that row is what the child records):
        one inverse-CDF draw (`sampling.draw`) per sibling rank for all rows at once (not Gumbel top-c: its one op
        for every rank draws N exponential variates per row, ~1 ms a depth on a CPU)."""
        counts = [len(self.kids.get(self._path(parent), [])) for parent in parents]
        q = target_probs(logits, self.sampling)  # (m, N)
        c = max(counts)
        remaining = q.clone()  # (m, N) q without the draws so far
        drawn = torch.empty(len(q), c, dtype=torch.long, device=q.device)  # (m, c)
        rows = q.new_empty(len(q), c, q.shape[1])  # (m, c, N) the distribution draw j came from
        drawn_weight = q.new_empty(len(q), c)  # (m, c) draw j's weight in its row (its q); 0 once q has none left
        for j in range(c):
            cdf = remaining.cumsum(-1)  # (m, N)
            rows[:, j] = remaining / cdf[:, -1:].clamp_min(torch.finfo(q.dtype).tiny)
            drawn[:, j] = draw(remaining, self.generator, cdf)
            drawn_weight[:, j] = remaining.gather(-1, drawn[:, j : j + 1])[:, 0]
            remaining.scatter_(-1, drawn[:, j : j + 1], 0.0)
        ids = drawn if to_target is None else to_target(drawn)
        # one copy to the host: (2, m, c) token ids and draw weights, i.e. q of the draw (0: q had no tokens left)
        host = torch.stack([ids.double(), drawn_weight.double()]).tolist()
        new = []
        for i, parent in enumerate(parents):
            base = self.scores[parent] if parent >= 0 else 0.0
            for j, path in enumerate(self.kids.get(self._path(parent), [])):
                if not host[1][i][j] > 0:
                    break  # q has fewer tokens than the shape has siblings here
                new.append(len(self.tokens))
                self.tokens.append(int(host[0][i][j]))
                self.parents.append(parent)
                self.scores.append(base + math.log(host[1][i][j]))
                self.paths.append(path)
                self.rows.append(rows[i, j])
        self.to_target = to_target
        return new

    def tree(self) -> DraftTree:
        """Every drawn node (the shape already has the budget's size), siblings in the order drawn."""
        if not self.rows:
            return DraftTree(list(self.tokens), list(self.parents))
        rows = torch.stack(self.rows)  # (n, N)
        if self.to_target is not None:  # to the target's vocabulary: zero outside the draft vocabulary
            index = self.to_target(torch.arange(rows.shape[1], device=rows.device))
            rows = rows.new_zeros(len(rows), self.vocab_size).index_copy_(1, index, rows)
        return DraftTree(list(self.tokens), list(self.parents), rows)


# A prior for heads that carry no measured accuracies (published ones): depth d's top-1 guess right with
# probability 0.6 x 0.7^d (the order of the Medusa paper's first heads), rank r's guess 1/(r+1)^2 as often.
PRIOR_TOP1, PRIOR_DECAY, PRIOR_RANKS = 0.6, 0.7, 5


def prior_rank_accuracy(depths: int) -> list[list[float]]:
    """`rank_accuracy` (as `choose_tree_shape` takes it) from the prior above, for `depths` heads."""
    return [[PRIOR_TOP1 * PRIOR_DECAY**d / (r + 1) ** 2 for r in range(PRIOR_RANKS)] for d in range(depths)]


def choose_tree_shape(rank_accuracy: list[list[float]], budget: int) -> list[tuple[int, ...]]:
    """The static tree (Medusa's; EAGLE's when sampled) of at most `budget` nodes with the largest expected
    acceptance length.

    `rank_accuracy[d][i]` is the measured probability that head d+1's i-th ranked token is the
    right one. A node is a path of ranks (i_1, ..., i_d) under the root; it is accepted with
    probability prod_j rank_accuracy[j][i_j], and the expected acceptance length of a tree is
    1 + the sum of that over its nodes. A child is never likelier than its parent, so taking the
    likeliest node on the frontier, `budget` times, gives the optimal tree (parents come first).
    """
    frontier = [(-acc, (i,)) for i, acc in enumerate(rank_accuracy[0]) if acc > 0] if rank_accuracy else []
    heapq.heapify(frontier)
    chosen: list[tuple[int, ...]] = []
    while frontier and len(chosen) < budget:
        neg_value, path = heapq.heappop(frontier)
        chosen.append(path)
        if len(path) < len(rank_accuracy):
            for i, acc in enumerate(rank_accuracy[len(path)]):
                if acc > 0:
                    heapq.heappush(frontier, (neg_value * acc, (*path, i)))
    return chosen


def expected_acceptance_length(rank_accuracy: list[list[float]], shape: list[tuple[int, ...]]) -> float:
    """1 + sum over the tree's nodes of the probability that the node is accepted."""
    total = 1.0
    for path in shape:
        p = 1.0
        for depth, rank in enumerate(path):
            p *= rank_accuracy[depth][rank]
        total += p
    return total


Shape = tuple[tuple[int, ...], ...]  # a static tree: paths of ranks, parents first (`choose_tree_shape`)


@dataclass(frozen=True)
class TreeChoice:
    budget: int  # draft nodes
    depth: int  # the deepest path of the best tree of that budget
    expected_tokens: float  # per round (expected acceptance length)
    round_ms: float  # forward over budget + 1 rows + drafting
    plain_ms: float  # a forward over one row
    shape: Shape = ()  # the best static tree of `budget` nodes (what a sampled tree draws)

    @property
    def expected_speedup(self) -> float:
        return self.expected_tokens / self.round_ms * self.plain_ms


def scale_accuracy(rank_accuracy: list[list[float]], factor: float) -> list[list[float]]:
    """Every probability times `factor`, a depth's ranks together never above 1 (scaled back to sum 1)."""
    rows = [[a * factor for a in row] for row in rank_accuracy]
    return [[a / max(sum(row), 1.0) for a in row] for row in rows]

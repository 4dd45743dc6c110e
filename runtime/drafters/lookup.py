"""Prompt lookup: guess that the text goes on as it did after an earlier occurrence of its last n-gram.

No model: the longest n-gram (max_ngram down to min_ngram) ending at the root is searched in the
context; what followed each match, most recent first, becomes a branch, and branches sharing a
prefix are merged into one tree. Every node is a deterministic guess (a point-mass proposal).
"""

from __future__ import annotations

import torch

from headstart.runtime.drafters.base import Drafter
from headstart.runtime.drafters.options import LookupOptions
from headstart.runtime.tree import DraftTree


class LookupDrafter(Drafter):
    name = "lookup"

    def __init__(self, options: LookupOptions | None = None) -> None:
        self.options = options or LookupOptions()

    def propose(self, context: list[int]) -> DraftTree:
        return build_trie(self.find_branches(context), self.options.budget)

    def graft_branches(self, context: list[int]) -> tuple[None, list[list[int]], list[list[int]]]:
        """What a graft drafts (`graft.LookupGraft`): a tree of its own instead of the inner drafter's and the
        branches drafted with it (never: None, []; `suffix.SuffixDrafter`'s may be), and the branches grafted onto
        the inner drafter's tree."""
        return None, [], self.find_branches(context)

    def alone_worth(self, context: list[int]) -> tuple[float, int]:
        """What a tree of its own (`graft_branches`' first) may be worth at this context, known without searching:
        less than this many accepted nodes a node, at most this many nodes of such worth (0.0, 0: none)."""
        return 0.0, 0

    def find_branches(self, context: list[int]) -> list[list[int]]:
        """Continuations of earlier occurrences of the context's last n-gram, longest n-gram first.

        Plain Python over the list: every earlier occurrence of the last token is found by `list.index` (a C
        loop), then each n-gram is compared where it ends there. A batch of 16 sequences looks up every round;
        a tensor made from each context cost ~50 us a sequence."""
        o = self.options
        last, ends, j = context[-1], [], -1
        while True:  # earlier occurrences of the last token: where a matching n-gram ends (never the root itself)
            try:
                j = context.index(last, j + 1, len(context) - 1)
            except ValueError:
                break
            ends.append(j)
        branches: list[list[int]] = []
        for n in range(o.max_ngram, o.min_ngram - 1, -1):
            if len(context) <= n:
                continue
            suffix = context[-n:]
            for e in reversed(ends):  # most recent first
                if e + 1 >= n and context[e + 1 - n : e + 1] == suffix:
                    branch = context[e + 1 : e + 1 + o.branch_len]
                    if branch not in branches:
                        branches.append(branch)
                        if len(branches) == o.max_branches:
                            return branches
        return branches


def build_trie(branches: list[list[int]], budget: int, onto: DraftTree | None = None) -> DraftTree:
    """Merge token sequences into a prefix tree (first branch first), at most `budget` new nodes.

    With `onto` the branches are grafted onto a copy of that tree: a token already proposed under the
    same parent is reused, so only what the tree lacks is added, after the tree's own siblings. When
    `onto` was sampled (q per node), each added node records a one-hot q at its token: a point mass,
    which `accept_path` accepts with probability p(x) and removes from the residual on rejection.
    Exact because the branches depend on the context alone, never on the target's draws this round.
    """
    if onto is not None and not branches:
        return onto  # nothing to graft: most rounds of a text that does not repeat itself
    tokens = list(onto.tokens) if onto is not None else []
    parents = list(onto.parents) if onto is not None else []
    index = {(parent, token): node for node, (parent, token) in enumerate(zip(parents, tokens, strict=True))}
    old = len(tokens)
    budget += old
    for branch in branches:
        parent = -1
        for token in branch:
            node = index.get((parent, token))
            if node is None:
                if len(tokens) == budget:
                    break
                node = index[(parent, token)] = len(tokens)
                tokens.append(token)
                parents.append(parent)
            parent = node
    probs = onto.draft_probs if onto is not None else None
    if probs is not None and len(tokens) > old:  # (n, V): point masses for the added nodes
        added = probs.new_zeros(len(tokens) - old, probs.shape[1])
        added[torch.arange(len(added), device=added.device), torch.tensor(tokens[old:], device=added.device)] = 1.0
        probs = torch.cat([probs, added])
    return DraftTree(tokens, parents, probs)

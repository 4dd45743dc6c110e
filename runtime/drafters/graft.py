"""A trained drafter's tree with prompt-lookup branches grafted on: `--drafter eagle+lookup`.

Trained heads guess what the model tends to write; prompt lookup guesses that it copies what it
read (a document it summarises, a sentence it translates). One tree can hold both guesses, and
the verifier checks every branch in the same single forward pass: where the lookup branch agrees
with the heads' tree no node is added, where it goes its own way at most `budget` nodes are.

At temperature > 0 the trained drafters sample their trees (siblings drawn from q without
replacement, q recorded per node); a grafted node comes after its sampled siblings and records a
point mass (`build_trie`). `accept_path` stays exact whatever q each sibling was proposed from, as
long as the proposals do not depend on the target's draws: lookup reads only the context
(tests/test_accept.py enumerates every outcome of such grafted trees).

`X+suffix` may draft without X: when the suffix pool's continuations expect `alone_gain` accepted nodes or more
(`suffix.SuffixDrafter.graft_branches`), the round's tree is theirs with the request's own lookup branches, and X
rests (a head's pairs wait, as after a plain round), as llama.cpp lets a draftless source go first. Still exact:
that choice, like the branches, depends on the context and on requests that finished before, never on this
round's draws.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from headstart.runtime.drafters.base import Drafter
from headstart.runtime.drafters.lookup import LookupDrafter, build_trie
from headstart.runtime.drafters.options import GraftOptions
from headstart.runtime.drafters.together import Drafting, drive
from headstart.runtime.sampling import SamplingParams
from headstart.runtime.tree import DraftTree

if TYPE_CHECKING:
    from headstart.runtime.drafters.suffix import Continuations


class LookupGraft(Drafter):
    def __init__(self, inner: Drafter, lookup: LookupDrafter | None = None, budget: int | None = None) -> None:
        """`budget`: the most nodes the lookup branches add to `inner`'s tree (None: `GraftOptions`' default)."""
        self.budget = GraftOptions(*([] if budget is None else [budget])).graft_budget  # validated there
        self.inner, self.lookup = inner, lookup or LookupDrafter()
        self.name = f"{inner.name}+{self.lookup.name}"  # +lookup, +suffix
        self.feature_layers = inner.feature_layers
        self.alone: tuple[float, int] | None = None  # this round's pool tree drafted alone: expected gain, nodes

    def clear(self) -> None:
        self.inner = self.inner.fork()
        self.alone = None

    def start(self, prompt_ids, prompt_hidden, sampling: SamplingParams | None = None, seed: int | None = None):
        self.inner.start(prompt_ids, prompt_hidden, sampling, seed)

    def propose(self, context: list[int]) -> DraftTree:
        return drive(self.drafting(context))

    def drafting(self, context: list[int]) -> Drafting:
        alone, branches = self.lookup.graft_branches(context)
        self.alone = None if alone is None else (alone.gain, len(alone.probs))
        if alone is not None:  # the suffix pool expects more than the inner tree would: it rests this round
            self.inner.rest()
            return self.alone_tree(alone, branches)
        inner = yield from self.inner.drafting(context)
        return build_trie(branches, self.budget, onto=inner)

    def alone_tree(self, alone: Continuations, own: list[list[int]]) -> DraftTree:
        """The suffix pool's nodes first, then the request's own lookup branches (at most `budget` nodes more)."""
        return build_trie(own, self.budget, onto=build_trie(alone.branches, len(alone.probs)))

    def record_alone(self, drafted: tuple[float, int], path: list[int]) -> None:
        """A round drafted alone from the pool (its nodes' expected gain, how many) accepted `path`: the pool
        records how many of its nodes (the tree's first) were accepted."""
        gain, nodes = drafted
        self.lookup.pool.record(gain, sum(node < nodes for node in path))  # only a suffix pool drafts alone

    def observe(self, tree: DraftTree, path: list[int], hidden: torch.Tensor, next_token: int) -> None:
        if self.alone is not None:
            self.record_alone(self.alone, path)
        self.inner.observe(tree, path, hidden, next_token)  # the inner drafter reads tokens and features only

    def finish(self, context: list[int]) -> None:
        self.inner.finish(context)
        self.lookup.finish(context)

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

`X+suffix` may draft without X: the round's tree is then the suffix pool's continuations with the request's own
lookup branches (`suffix.SuffixDrafter.graft_branches`), and X rests (a head's pairs wait, as after a plain round),
as llama.cpp lets a draftless source go first: under the load budget where the plan takes that offer (`Offer.pool`),
in a fixed tree where the pool's nodes expect `alone_gain` accepted nodes or more. Still exact: that choice, like
the branches, depends on the context, on requests that finished before and on rounds before, never on this
round's draws.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from headstart.runtime.drafters.base import Drafter, Offer
from headstart.runtime.drafters.lookup import LookupDrafter, build_trie
from headstart.runtime.drafters.options import GraftOptions
from headstart.runtime.drafters.together import Drafting, drive
from headstart.runtime.sampling import SamplingParams
from headstart.runtime.tree import DraftTree

if TYPE_CHECKING:
    from headstart.runtime.drafters.suffix import Continuations


class LookupGraft(Drafter):
    def __init__(
        self, inner: Drafter, lookup: LookupDrafter | None = None, budget: int | None = None, name: str | None = None
    ) -> None:
        """`budget`: the most nodes the lookup branches add to `inner`'s tree (None: `GraftOptions`' default);
        `name`: the drafter's (None: `inner`'s +lookup or +suffix)."""
        self.budget = GraftOptions(*([] if budget is None else [budget])).graft_budget  # validated there
        self.inner, self.lookup = inner, lookup or LookupDrafter()
        self.name = name or f"{inner.name}+{self.lookup.name}"
        self.feature_layers = inner.feature_layers
        self.alone: tuple[Continuations, int] | None = None  # this round's pool tree drafted alone, its pool nodes
        self.own = 0  # nodes of the inner drafter's in the last tree drafted (they come first)
        self._found: tuple[int, DraftTree | None, Continuations | None, list[list[int]]] = (-1, None, None, [])

    def clear(self) -> None:
        self.inner = self.inner.fork()
        self.alone, self.own, self._found = None, 0, (-1, None, None, [])

    @property
    def graft(self) -> LookupGraft:
        return self

    def start(self, prompt_ids, prompt_hidden, sampling: SamplingParams | None = None, seed: int | None = None):
        self.inner.start(prompt_ids, prompt_hidden, sampling, seed)
        self._found = (-1, None, None, [])

    def propose(self, context: list[int]) -> DraftTree:
        return drive(self.drafting(context))

    def found(self, context: list[int]) -> tuple[DraftTree | None, Continuations | None, list[list[int]]]:
        """The lookup at this context, searched once a round (runtime/sizing values it, then it is drafted): the
        suffix pool's tree to draft alone (its nodes first, likeliest first, then the request's own lookup
        branches; None: none) and the pool's continuations it holds, and the branches to graft."""
        if self._found[0] != len(context):
            pooled, own, branches = self.lookup.graft_branches(context)
            alone = self.alone_tree(pooled, own) if pooled is not None and pooled.paths else None
            self._found = (len(context), alone, pooled if alone is not None else None, branches)
        return self._found[1:]

    def alone_worth(self, context: list[int]) -> tuple[float, int]:
        """The lookup's `alone_worth`: what the pool's tree drafted alone may be worth (runtime/sizing bounds the
        offers it could make before it searches)."""
        return self.lookup.alone_worth(context)

    def drafting(self, context: list[int], size: Offer | None = None) -> Drafting:
        """The inner tree with the lookup branches grafted on, or the suffix pool's tree alone where it expects
        `alone_gain` accepted nodes or more. Sized (runtime/sizing): the inner tree of `size.heads` nodes, the
        branches up to `size.nodes` where `size.graft`; the pool's tree alone, cut to `size.nodes`, if `size.pool`."""
        self.alone, self.own = None, 0
        if size is not None and not size.nodes:  # a plain step: nothing searched, the inner drafter told
            return (yield from self.inner.drafting(context, size))
        alone, pooled, branches = self.found(context)
        if alone is not None and (size.pool if size is not None else pooled.gain >= self.lookup.options.alone_gain):
            self.inner.rest()  # the pool's tree alone this round: the inner drafter's pairs wait
            nodes = len(alone) if size is None else min(size.nodes, len(alone))
            self.alone = (pooled, min(nodes, len(pooled.paths)))
            return alone.prefix(nodes)
        inner = yield from self.inner.drafting(context, None if size is None else size._replace(nodes=size.heads))
        self.own = len(inner)
        room = self.budget if size is None else min(self.budget, size.nodes - self.own) if size.graft else 0
        tree = build_trie(branches, room, onto=inner) if room > 0 else inner
        return tree if size is None else tree.prefix(size.nodes)

    def alone_tree(self, alone: Continuations, own: list[list[int]]) -> DraftTree:
        """The suffix pool's nodes first (likeliest first), then the request's own lookup branches (at most `budget`
        nodes more)."""
        return build_trie(own, self.budget, onto=alone.tree())

    def record_alone(self, drafted: tuple[Continuations, int], path: list[int]) -> None:
        """A round drafted alone from the pool (its continuations, how many of their nodes: the tree's first)
        accepted `path`: the pool records each drafted node's depth, estimate and whether it was accepted."""
        pooled, nodes = drafted
        taken = set(path)
        drafted_nodes = zip(pooled.paths[:nodes], pooled.raw[:nodes], strict=True)
        self.lookup.pool.record([(len(p), raw, k in taken) for k, (p, raw) in enumerate(drafted_nodes)])

    def observe(self, tree: DraftTree, path: list[int], hidden: torch.Tensor, next_token: int) -> None:
        if self.alone is not None:
            self.record_alone(self.alone, path)
        self.inner.observe(tree, path, hidden, next_token)  # the inner drafter reads tokens and features only

    def finish(self, context: list[int]) -> None:
        self.inner.finish(context)
        self.lookup.finish(context)

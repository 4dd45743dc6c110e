"""A sequence's drafter under the server's budget: it offers trees of several sizes, then drafts the one the
round's plan gave it (`runtime/budget.py` chooses; a plan of None is a plain step).

What each offer is worth comes from the drafter's own evidence:
- heads with calibrated accuracies (EAGLE's, `EagleDrafter.offers`): the curve of the best static tree, node by
  node, times this request's own correction: (PRIOR + nodes its rounds accepted) / (PRIOR + the curve's
  expectation for them), so a request that accepts less than the heads promise soon gets smaller trees;
- grafted lookup branches (`X+lookup`): the trie found in the context now (its nodes exact), worth what this
  request's grafted nodes were accepted per round (GRAFT_PRIOR before any);
- any other drafter: its whole tree, of the size and acceptance its rounds so far had (OTHER_PRIOR before any).
The tree is cut to the plan's nodes (`DraftTree.prefix`), so the width the budget paid for is never exceeded.
"""

from __future__ import annotations

import time

import torch

from headstart.runtime.budget import Offer
from headstart.runtime.drafters.base import Drafter
from headstart.runtime.drafters.eagle import EagleDrafter
from headstart.runtime.drafters.graft import LookupGraft
from headstart.runtime.drafters.lookup import build_trie
from headstart.runtime.drafters.together import Drafting, drive
from headstart.runtime.sampling import SamplingParams
from headstart.runtime.tree import DraftTree

MAX_NODES = 32  # the largest heads' tree offered
PRIOR = 2.0  # the curve's expected nodes a request's correction starts from (as if that many were seen)
GRAFT_PRIOR = 0.5  # accepted lookup nodes per grafted round, before a request's first
OTHER_PRIOR = (8.0, 1.0)  # an uncalibrated drafter's (nodes, accepted nodes) per round, before its first


class Budgeted(Drafter):
    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.name, self.feature_layers = inner.name, inner.feature_layers
        self.plan: Offer | None = None  # the coming round's tree (`take`); None: plain
        self.clear_record()

    def clear(self) -> None:
        self.inner = self.inner.fork()
        self.clear_record()

    def clear_record(self) -> None:
        self.curve_seen = [0.0, 0.0]  # heads' nodes accepted, and what the curve expected of those rounds
        self.graft_seen = [0, 0]  # grafted rounds, grafted nodes accepted
        self.other_seen = [0, 0, 0, 0.0]  # rounds, nodes, accepted nodes, drafting seconds
        self._branches: tuple[int, list[list[int]]] = (-1, [])  # (context length, lookup branches found there)
        self._own: tuple[list[Offer] | None, float, list[Offer]] = (None, 0.0, [])  # (curve, correction, offers)
        # this round: the heads' nodes drafted, the curve's expectation of them, lookup grafted, drafting seconds
        self._round: tuple[int, float, bool, float] | None = None

    def take(self, plan: Offer | None) -> None:
        """The coming round's tree (one of `offers`), None: a plain step."""
        self.plan = plan

    @property
    def graft(self) -> LookupGraft | None:
        return self.inner if isinstance(self.inner, LookupGraft) else None

    @property
    def heads(self) -> Drafter:
        return self.graft.inner if self.graft is not None else self.inner

    def start(self, prompt_ids, prompt_hidden, sampling: SamplingParams | None = None, seed: int | None = None):
        self.inner.start(prompt_ids, prompt_hidden, sampling, seed)

    def _curve(self) -> list[Offer]:
        heads = self.heads
        return heads.offers(MAX_NODES) if isinstance(heads, EagleDrafter) else []

    def offers(self, context: list[int]) -> list[Offer]:
        """The trees this sequence can draft this round, each with its nodes, expected accepted nodes and drafting
        ms (module docstring)."""
        curve = self._curve()
        if curve:
            accepted, expected = self.curve_seen
            rho = (PRIOR + accepted) / (PRIOR + expected)
            cached, cached_rho, own = self._own  # the same until the curve or this request's record changes
            if cached is not curve or cached_rho != rho:  # the curve object itself, not its id (ids are reused)
                own = [o._replace(gain=min(o.gain * rho, o.nodes)) for o in curve]
                self._own = (curve, rho, own)
        else:
            rounds, nodes, accepted, seconds = self.other_seen
            n = max(round((OTHER_PRIOR[0] + nodes) / (1 + rounds)), 1)
            own = [Offer(n, (OTHER_PRIOR[1] + accepted) / (1 + rounds), 1e3 * seconds / max(rounds, 1), heads=n)]
        graft = self.graft
        if graft is None:
            return own
        if self._branches[0] != len(context):
            self._branches = (len(context), graft.lookup.find_branches(context))
        found = len(build_trie(self._branches[1], graft.budget))
        if not found:
            return own
        rounds, accepted = self.graft_seen
        hit = (GRAFT_PRIOR + accepted) / (1 + rounds)
        grafted = [Offer(found, min(hit, found), 0.0, graft=True)]
        grafted += [o._replace(nodes=o.nodes + found, gain=o.gain + hit, graft=True) for o in own]
        return own + grafted

    @torch.inference_mode()
    def propose(self, context: list[int]) -> DraftTree:
        return drive(self.drafting(context))

    def drafting(self, context: list[int]) -> Drafting:
        plan, self._round = self.plan, None
        if plan is None:
            return DraftTree()
        heads, curve = self.heads, self._curve()
        t0 = time.perf_counter()  # an uncalibrated drafter's own time (a head's steps, drafted together, are not)
        if curve:
            heads.size(plan.heads)  # 0: nothing of its own, its queued pairs wait
            tree = yield from heads.drafting(context)
        else:
            tree = (yield from heads.drafting(context)).prefix(plan.heads) if plan.heads else DraftTree()
        seconds, own = time.perf_counter() - t0, len(tree)
        graft = self.graft
        if plan.graft and graft is not None:
            if self._branches[0] != len(context):
                self._branches = (len(context), graft.lookup.find_branches(context))
            tree = build_trie(self._branches[1], min(graft.budget, plan.nodes - own), onto=tree)
        tree = tree.prefix(plan.nodes)
        expected = next((o.gain for o in curve if o.nodes == plan.heads), 0.0)  # the curve offers sizes 1-6, 8, 10 ...
        self._round = (own, expected, len(tree) > own, seconds)
        return tree

    def observe(self, tree: DraftTree, path: list[int], hidden: torch.Tensor, next_token: int) -> None:
        if self._round is not None and len(tree):
            own, expected, grafted, seconds = self._round
            ours = next((k for k, node in enumerate(path) if node >= own), len(path))  # the heads' nodes come first
            if self._curve():
                self.curve_seen[0] += ours
                self.curve_seen[1] += expected
            elif own:
                seen = self.other_seen
                seen[0], seen[1], seen[2], seen[3] = seen[0] + 1, seen[1] + own, seen[2] + ours, seen[3] + seconds
            if grafted:
                self.graft_seen[0] += 1
                self.graft_seen[1] += len(path) - ours
        self.inner.observe(tree, path, hidden, next_token)

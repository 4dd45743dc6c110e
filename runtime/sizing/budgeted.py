"""A sequence's drafter under the server's budget: it offers trees of several sizes, then drafts the one the
round's plan gave it (`runtime/sizing/planner.py` chooses; a plan of None is a plain step).

What each offer is worth comes from the drafter's own evidence:
- heads with calibrated accuracies (EAGLE's, `EagleDrafter.offers`): the curve of the best static tree, node by
  node, with the accuracies times this request's own factor: of the factors in GRID, the one at which the
  trees its rounds drafted (with PRIOR nodes' worth of rounds of a REFERENCE-node tree at the traffic's own
  accuracies) were expected to accept what they did. A request that accepts less than the heads promise soon
  gets smaller trees, one that accepts more, deeper ones: the factor scales each depth's accuracy, so a long
  path gains more than a short one (scaling the curve's gains instead promised a 2-node tree up to 2 nodes and
  the budget chose such trees for requests whose deep paths were the ones accepted). Drafting costs its depth's
  measured ms plus the head's backlog (the pairs of its plain rounds, entered before it drafts; the prompt's,
  entered with them at its first drafting, are not charged: `EagleDrafter.backlog`) at the measured ms a pair:
  uncharged, under load a few requests drafted now and then, each paying its whole backlog (bfloat16, 16
  clients: 8 % of sequence-rounds speculated, 0.87x plain);
- grafted lookup branches (`X+lookup`): the trie found in the context now (its nodes exact), whole and cut to its
  first 1, 2 and 4 nodes (GRAFT_SIZES), each worth what grafts were accepted that deep: of the grafted rounds that
  drafted a k-th node with the k - 1 before it accepted, the share that accepted it, this request's starting from
  every request's (the traffic's: the forks of one Budgeted share it; GRAFT_PRIOR before any). Each request
  starting from GRAFT_PRIOR alone, at two requests the budget never tried a graft worth 3 nodes a round on
  held-out chat; offered only whole, at 4 requests in float32 on a 2-core AMD EPYC (Zen 4), where a row costs
  ~2 ms, it drafted 8-node grafts or none, where 2-node ones make 1.3x plain in-process against 1.2x for 8;
- a suffix graft whose pool drafts alone (`graft.LookupGraft`): that tree alone, worth the sum of the pool's node
  probabilities (its counts times its measured hit rate: `suffix.py`); taken, the heads rest, as the fixed trees do;
- any other drafter: its whole tree, of the size and acceptance its rounds so far had (OTHER_PRIOR before any).
The tree is cut to the plan's nodes (`DraftTree.prefix`), so the width the budget paid for is never exceeded.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from headstart.runtime.drafters.base import Drafter, Offer
from headstart.runtime.drafters.eagle import EagleDrafter
from headstart.runtime.drafters.graft import LookupGraft
from headstart.runtime.drafters.lookup import build_trie
from headstart.runtime.drafters.together import Drafting, drive
from headstart.runtime.sampling import SamplingParams
from headstart.runtime.sizing.planner import Price
from headstart.runtime.tree import DraftTree

MAX_NODES = 32  # the largest heads' tree offered
PRIOR = 2.0  # the curve's expected nodes a request's correction starts from (as if that many were seen)
GRID = tuple(2.0 ** (k / 4) for k in range(-12, 9))  # a request's own factor on the heads' accuracies: 1/8 .. 4
REFERENCE = 6  # nodes of the tree whose rounds the prior counts
GRAFT_PRIOR = 0.5  # a grafted node's chance of acceptance once the grafted nodes before it were (1 node a round at 8)
GRAFT_SIZES = (1, 2, 4)  # a graft is offered whole and cut to its first this many nodes
OTHER_PRIOR = (8.0, 1.0)  # an uncalibrated drafter's (nodes, accepted nodes) per round, before its first


class Budgeted(Drafter):
    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.name, self.feature_layers = inner.name, inner.feature_layers
        self.plan: Offer | None = None  # the coming round's tree (`take`); None: plain
        # grafted rounds by depth k: [drafted a (k+1)-th grafted node with the k before it accepted, accepted it]; every
        # request's (the forks share the array)
        self.traffic = np.zeros((2, self.graft.budget if self.graft is not None else 1))
        self.clear_record()

    def clear(self) -> None:
        self.inner = self.inner.fork()
        self.clear_record()

    def clear_record(self) -> None:
        self.curve_seen = [0.0, np.zeros(len(GRID))]  # heads' nodes accepted; each factor's expectation of them
        self.factor = 1.0  # this request's factor on the heads' accuracies (`_refit`)
        self.graft_seen = np.zeros_like(self.traffic)  # as `traffic`, this request's rounds
        self.other_seen = [0, 0, 0, 0.0]  # rounds, nodes, accepted nodes, drafting seconds
        self._found: tuple[int, DraftTree | None, list[float], list[list[int]]] = (-1, None, [], [])  # `_lookup`
        # this round: the heads' nodes drafted, the plan's heads' nodes, lookup nodes grafted, drafting seconds
        self._round: tuple[int, int, int, float] | None = None
        self._alone: tuple[float, int] | None = None  # this round's suffix pool tree drafted alone: its gain, nodes

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
        return heads.offers(MAX_NODES, self.factor) if isinstance(heads, EagleDrafter) else []

    def _refit(self) -> None:
        """This request's factor: the point of GRID at which PRIOR nodes' worth of REFERENCE-node rounds at the
        traffic's accuracies and the trees its rounds drafted were expected to accept what they did (the
        expectation grows with the factor: the nearest point to where it crosses)."""
        gains = self.heads.gains(MAX_NODES, GRID)[:, REFERENCE]  # (G,)
        accepted, expected = self.curve_seen
        have = PRIOR * gains / gains[GRID.index(1.0)] + expected  # (G,) increasing
        want = PRIOR + accepted
        j = min(int(np.searchsorted(have, want)), len(GRID) - 1)
        if j and want - have[j - 1] < have[j] - want:
            j -= 1
        self.factor = GRID[j]

    def offers(self, context: list[int], price: Price | None = None) -> list[Offer]:
        """The trees this sequence can draft this round, each with its nodes, expected accepted nodes and drafting
        ms (module docstring). At a `price`, those that pass it (no plan takes the rest); where no grafted offer
        could, each at its best (the graft's hit rate on one node), the lookup is not searched."""
        own = self._curve()
        heads = self.heads
        if own and heads.backlog:  # the pairs its head must enter before it drafts: paid by the round that drafts
            catch_up = heads.backlog * heads.sizer.pair_ms
            own = [o._replace(draft_ms=o.draft_ms + catch_up) for o in own]
        if not own:
            rounds, nodes, accepted, seconds = self.other_seen
            n = max(round((OTHER_PRIOR[0] + nodes) / (1 + rounds)), 1)
            own = [Offer(n, (OTHER_PRIOR[1] + accepted) / (1 + rounds), 1e3 * seconds / max(rounds, 1), heads=n)]
        graft = self.graft
        if graft is not None:
            gains = self.graft_gains()
            if price is None or _graft_may_pass(own, gains[-1], price):
                own = own + self._grafted(graft, own, gains, context)
        return own if price is None else [o for o in own if price.passes(o)]

    def graft_gains(self) -> np.ndarray:
        """(graft budget,) the expected accepted nodes of a graft cut to its first 1, 2, ... nodes: the sum over its
        depths of the chance that every grafted node down to that depth is accepted (each depth's share, this
        request's rounds after the traffic's as one round's worth)."""
        reached, passed = self.traffic
        traffic = (GRAFT_PRIOR + passed) / (1 + reached)  # (budget,)
        reached, passed = self.graft_seen
        return np.cumsum(np.cumprod((traffic + passed) / (1 + reached)))

    def _lookup(self, graft: LookupGraft, context: list[int]) -> tuple[DraftTree | None, list[float], list[list[int]]]:
        """`graft.lookup.graft_branches` at this context, once a round: the suffix pool's tree to draft alone (its
        nodes first, then the request's own lookup branches; None: none) and its nodes' probabilities, else the
        branches to graft."""
        if self._found[0] != len(context):
            alone, branches = graft.lookup.graft_branches(context)
            if alone is None:
                self._found = (len(context), None, [], branches)
            else:
                self._found = (len(context), graft.alone_tree(alone, branches), alone.probs, [])
        return self._found[1:]

    def _grafted(self, graft: LookupGraft, own: list[Offer], gains: np.ndarray, context: list[int]) -> list[Offer]:
        """`graft`'s lookup branches found now, whole and cut to GRAFT_SIZES nodes: alone, and onto each of `own`,
        a cut to n nodes worth `gains[n - 1]` accepted nodes. Where the suffix pool drafts alone (`LookupGraft`),
        its tree alone, worth what the pool expects of it."""
        alone, probs, branches = self._lookup(graft, context)
        if alone is not None:
            return [Offer(len(alone), sum(probs), 0.0, graft=True)]
        found = len(build_trie(branches, graft.budget))
        sizes = sorted({min(n, found) for n in GRAFT_SIZES} | {found}) if found else []
        worth = {n: float(gains[n - 1]) for n in sizes}
        grafted = [Offer(n, worth[n], 0.0, graft=True) for n in sizes]
        return grafted + [o._replace(nodes=o.nodes + n, gain=o.gain + worth[n], graft=True) for o in own for n in sizes]

    @torch.inference_mode()
    def propose(self, context: list[int]) -> DraftTree:
        return drive(self.drafting(context))

    def drafting(self, context: list[int]) -> Drafting:
        plan, self._round, self._alone = self.plan, None, None
        if plan is None:
            return DraftTree()
        graft = self.graft
        if plan.graft and not plan.heads and graft is not None:
            alone, probs, _ = self._lookup(graft, context)
            if alone is not None:  # the suffix pool's tree, the heads resting (their pairs wait)
                self.heads.rest()
                self._alone = (sum(probs[: plan.nodes]), len(probs))  # the pool's nodes drafted: their gain, count
                return alone.prefix(plan.nodes)
        heads, curve = self.heads, self._curve()
        t0 = time.perf_counter()  # an uncalibrated drafter's own time (a head's steps, drafted together, are not)
        if curve:
            heads.size(plan.heads)  # 0: nothing of its own, its queued pairs wait
            tree = yield from heads.drafting(context)
        else:
            tree = (yield from heads.drafting(context)).prefix(plan.heads) if plan.heads else DraftTree()
        seconds, own = time.perf_counter() - t0, len(tree)
        if plan.graft and graft is not None:
            tree = build_trie(self._lookup(graft, context)[2], min(graft.budget, plan.nodes - own), onto=tree)
        tree = tree.prefix(plan.nodes)
        self._round = (own, plan.heads, max(len(tree) - own, 0), seconds)
        return tree

    def finish(self, context: list[int]) -> None:
        self.inner.finish(context)

    def observe(self, tree: DraftTree, path: list[int], hidden: torch.Tensor, next_token: int) -> None:
        if self._alone is not None:  # the pool's round: its own record, not the graft's hit rate
            self.graft.record_alone(self._alone, path)
        elif self._round is not None and len(tree):
            own, sized, grafted, seconds = self._round
            ours = next((k for k, node in enumerate(path) if node >= own), len(path))  # the heads' nodes come first
            if self._curve() and sized:
                self.curve_seen[0] += ours
                self.curve_seen[1] += self.heads.gains(MAX_NODES, GRID)[:, sized]
                self._refit()
            elif own:
                seen = self.other_seen
                seen[0], seen[1], seen[2], seen[3] = seen[0] + 1, seen[1] + own, seen[2] + ours, seen[3] + seconds
            if grafted:  # its k-th grafted node was tried where the k - 1 before it were accepted
                accepted, depth = len(path) - ours, np.arange(len(self.traffic[0]))
                tried = (depth < grafted) & (depth <= accepted)
                for seen in (self.graft_seen, self.traffic):
                    seen[0] += tried
                    seen[1] += tried & (depth < accepted)
        self.inner.observe(tree, path, hidden, next_token)


def _graft_may_pass(own: list[Offer], hit: float, price: Price) -> bool:
    """Whether a grafted offer could pass `price`: alone or onto one of `own`, at its best (one node, `hit`, the
    whole graft's gain, of it accepted), without building them."""
    return price.beaten(hit, 0.0, 1) or any(
        price.beaten(o.gain + hit, o.draft_ms - o.shared_ms, o.nodes + 1) for o in own
    )

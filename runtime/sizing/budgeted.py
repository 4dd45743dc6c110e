"""A sequence's drafter under the load budget: it offers trees of several sizes, each valued by what this request's
rounds accepted so far, and the round's plan hands one back as its size (`runtime/sizing/planner.py` chooses,
`generate.Batch.round` passes it to `propose_all`; PLAIN: a plain step). The drafter drafts to that size itself
(`Drafter.drafting`); this wrapper keeps the live record that values the offers.

What each offer is worth comes from the drafter's own evidence, through the interface every drafter has
(`Drafter.curve`, `catch_up_ms`, `graft`):
- a drafter with calibrated accuracies (EAGLE's heads, `EagleDrafter.curve`; any drafter that implements `curve`):
  the curve of the best tree, node by node, with the accuracies times this request's own factor: of the factors in
  GRID, the one at which the
  trees its rounds drafted (with PRIOR nodes' worth of rounds of a REFERENCE-node tree at the traffic's own
  accuracies) were expected to accept what they did. A request that accepts less than the heads promise soon
  gets smaller trees, one that accepts more, deeper ones: the factor scales each depth's accuracy, so a long
  path gains more than a short one (scaling the curve's gains instead promised a 2-node tree up to 2 nodes and
  the budget chose such trees for requests whose deep paths were the ones accepted). Drafting costs its depth's
  measured ms plus its catch-up (`Drafter.catch_up_ms`: a head's backlog, the pairs of its plain rounds, entered
  before it drafts; the prompt's, entered with them at its first drafting, are not charged: `EagleDrafter.backlog`):
  uncharged, under load a few requests drafted now and then, each paying its whole backlog (bfloat16, 16
  clients: 8 % of sequence-rounds speculated, 0.87x plain);
- grafted lookup branches (`X+lookup`): the trie found in the context now (its nodes exact), whole and cut to its
  first 1, 2 and 4 nodes (GRAFT_SIZES), each worth what grafts were accepted that deep: of the grafted rounds that
  drafted a k-th node with the k - 1 before it accepted, the share that accepted it, this request's starting from
  every request's (the traffic's: the forks of one Budgeted share it; GRAFT_PRIOR before any). Each request
  starting from GRAFT_PRIOR alone, at two requests the budget never tried a graft worth 3 nodes a round on
  held-out chat; offered only whole, at 4 requests in float32 on a 2-core AMD EPYC (Zen 4), where a row costs
  ~2 ms, it drafted 8-node grafts or none, where 2-node ones make 1.3x plain in-process against 1.2x for 8;
- a suffix graft whose pool drafts alone (`graft.LookupGraft`): the pool's likeliest nodes alone, whole and cut to
  their first 1, 2, 4, 8, 16 ... (the likeliest tree of that many), each cut worth the sum of its nodes'
  probabilities (their counts times the pool's calibration at their depths: `suffix.py`), besides the heads' trees
  with the pool's branches grafted; taken, the heads rest. Offered only whole, and only where the pool expected
  `alone_gain` nodes, on the agent workload its trees verified 43 ms a round for 10 tokens; cut and chosen, 26.6
  ms for 6.8 (eagle+suffix 1.26x eagle+lookup against 1.01x: docs/benchmarks.md);
- lookup alone (`lookup`: its branches grafted onto the none drafter): the graft's offers only;
- any other drafter (`curve` empty): its whole tree, of the size and acceptance its rounds so far had (OTHER_PRIOR
  before any).
The tree is cut to the size's nodes (`DraftTree.prefix`), so the width the budget paid for is never exceeded.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from headstart.runtime.drafters.base import Drafter, Offer
from headstart.runtime.drafters.lookup import build_trie
from headstart.runtime.drafters.together import Drafting, drive
from headstart.runtime.sampling import SamplingParams
from headstart.runtime.sizing.planner import Evidence, Price, graft_surplus
from headstart.runtime.tree import DraftTree

if TYPE_CHECKING:
    from headstart.runtime.drafters.graft import LookupGraft

MAX_NODES = 32  # the largest heads' tree offered
PRIOR = 2.0  # the curve's expected nodes a request's correction starts from (as if that many were seen)
GRID = tuple(2.0 ** (k / 4) for k in range(-12, 9))  # a request's own factor on the heads' accuracies: 1/8 .. 4
REFERENCE = 6  # nodes of the tree whose rounds the prior counts
GRAFT_PRIOR = 0.5  # a grafted node's chance of acceptance once the grafted nodes before it were (1 node a round at 8)
GRAFT_SIZES = (1, 2, 4)  # a graft is offered whole and cut to its first this many nodes
FORGET_ROUNDS = 256  # grafted rounds weigh e^-1 after a request has observed this many rounds more (every fork's)
FORGET_EVERY = 32  # ... applied each time it has observed this many
OTHER_PRIOR = (8.0, 1.0)  # an uncalibrated drafter's (nodes, accepted nodes) per round, before its first


class Budgeted(Drafter):
    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.name, self.feature_layers = inner.name, inner.feature_layers
        # grafted rounds by depth k: [drafted a (k+1)-th grafted node with the k before it accepted, accepted it]; every
        # request's (the forks share the array)
        self.traffic = np.zeros((2, self.graft.budget if self.graft is not None else 1))
        self._by_curve: dict[int, tuple[list[Offer], dict]] = {}  # what `_held` derived from a curve, the forks' too
        self._grafted_rounds = [0]  # every fork's grafted rounds observed: when `graft_gains` last changed (shared)
        self._traffic_gains: list = [(-1, None)]  # `graft_gains` of a request with no grafted round yet (shared)
        self.clear_record()

    def clear(self) -> None:
        self.inner = self.inner.fork()
        self.clear_record()

    def clear_record(self) -> None:
        self.curve_seen = [0.0, np.zeros(len(GRID))]  # heads' nodes accepted; each factor's expectation of them
        self.factor = 1.0  # this request's factor on the heads' accuracies (`_refit`)
        self.graft_seen = np.zeros_like(self.traffic)  # as `traffic`, this request's rounds
        self.other_seen = [0, 0, 0, 0.0]  # rounds, nodes, accepted nodes, drafting seconds
        # this round: the heads' nodes drafted, the size's heads' nodes, lookup nodes grafted, drafting seconds
        self._round: tuple[int, int, int, float] | None = None
        self._graft_gains: tuple[int, np.ndarray | None] = (-1, None)  # (`_grafted_rounds` then, `graft_gains`)
        self._grafts = 0  # this request's grafted rounds observed
        self._observed = 0  # this request's rounds observed

    @property
    def graft(self) -> LookupGraft | None:
        return self.inner.graft

    @property
    def heads(self) -> Drafter:
        return self.graft.inner if self.graft is not None else self.inner

    def start(self, prompt_ids, prompt_hidden, sampling: SamplingParams | None = None, seed: int | None = None):
        self.inner.start(prompt_ids, prompt_hidden, sampling, seed)

    def _curve(self) -> list[Offer]:
        return self.heads.curve(MAX_NODES, self.factor)

    def _held(self, curve: list[Offer]) -> dict:
        """What is derived from `curve` (a drafter's cached offers: every round asks for these, at 16 sequences
        ~2 ms a round computed afresh), kept while `curve` is the same object (the object itself is held, so its id
        is not another's)."""
        held = self._by_curve.get(id(curve))
        if held is None or held[0] is not curve:
            if len(self._by_curve) >= 64:
                self._by_curve.clear()
            held = self._by_curve[id(curve)] = (curve, {})
        return held[1]

    def _columns(self, curve: list[Offer]) -> np.ndarray:
        """`_columns` of a cached `curve`."""
        held = self._held(curve)
        if "columns" not in held:
            held["columns"] = _columns(curve)
        return held["columns"]

    def _gains(self, nodes: int) -> np.ndarray:
        """(G,) the expected accepted nodes of the heads' tree of `nodes` nodes at each factor of GRID (the largest
        offered tree of at most that many: a smaller tree than asked for is the whole tree)."""
        table = self._held(self.heads.curve(MAX_NODES))
        if nodes not in table:
            curves = [self.heads.curve(MAX_NODES, f) for f in GRID]
            table[nodes] = np.array([max((o.gain for o in c if o.nodes <= nodes), default=0.0) for c in curves])
        return table[nodes]

    def _refit(self) -> None:
        """This request's factor: the point of GRID at which PRIOR nodes' worth of REFERENCE-node rounds at the
        traffic's accuracies and the trees its rounds drafted were expected to accept what they did (the
        expectation grows with the factor: the nearest point to where it crosses)."""
        gains = self._gains(REFERENCE)  # (G,)
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
        could, whatever the lookup finds (`planner.graft_surplus`), the lookup is not searched. The offers meet the
        price as arrays and only those that pass are built: a busy batch asks every sequence every round."""
        own, catch_up, columns = self._own()
        nodes, gain, spend = columns
        out = [
            o._replace(draft_ms=o.draft_ms + catch_up)
            for o, k in zip(own, _passing(price, gain, spend, nodes), strict=True)
            if k
        ]
        graft = self.graft
        if graft is not None:
            evidence = self._made_of(own, catch_up, context)
            if price is None or graft_surplus(evidence, price) > -1e-9:  # (rounding)
                out += self._grafted(graft, own, catch_up, columns, evidence.cuts, context, price)
        return out

    def evidence(self, context: list[int]) -> Evidence:
        """What `offers` makes its offers of (`planner.Evidence`), without searching the lookup: the heads' curve
        (or the whole tree's offer) and its catch-up, the graft's cuts, the pool's tree alone (`alone_worth`)."""
        own, catch_up, _ = self._own()
        return self._made_of(own, catch_up, context)

    def _made_of(self, own: list[Offer], catch_up: float, context: list[int]) -> Evidence:
        graft = self.graft
        if graft is None:
            return Evidence(own, catch_up)
        return Evidence(own, catch_up, self.graft_gains(), graft.alone_worth(context))

    def _own(self) -> tuple[list[Offer], float, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """The drafter's own offers (`curve`, or one of its whole tree as its rounds so far had it), the catch-up
        ms to add to each one's drafting, and their nodes, gains and own ms (catch-up in, shared part out) as
        arrays (kept for a cached curve)."""
        own = self._curve()
        if own:
            catch_up = self.heads.catch_up_ms  # what its head enters first: paid by the round that drafts
            nodes, gain, draft_ms, shared_ms = self._columns(own)
            return own, catch_up, (nodes, gain, (draft_ms + catch_up) - shared_ms)
        if not self.heads.drafts:  # lookup branches grafted onto nothing (`lookup`): only the graft's offers
            return [], 0.0, (np.zeros(0), np.zeros(0), np.zeros(0))
        rounds, nodes, accepted, seconds = self.other_seen
        n = max(round((OTHER_PRIOR[0] + nodes) / (1 + rounds)), 1)
        own = [Offer(n, (OTHER_PRIOR[1] + accepted) / (1 + rounds), 1e3 * seconds / max(rounds, 1), heads=n)]
        nodes, gain, draft_ms, shared_ms = _columns(own)
        return own, 0.0, (nodes, gain, draft_ms - shared_ms)

    def graft_gains(self) -> np.ndarray:
        """(graft budget,) the expected accepted nodes of a graft cut to its first 1, 2, ... nodes: the sum over its
        depths of the chance that every grafted node down to that depth is accepted (each depth's share, this
        request's rounds after the other requests' as one round's worth). Counting its own rounds twice (in the
        traffic, then as its own) and forgetting none, a request alone valued lookup's depth 1 at 0.06 after two
        grafts missed (Spec-Bench, where it is accepted in half of the rounds it finds a branch), and it never
        grafted again; grafted rounds now fade (FORGET_ROUNDS), so a rate learnt low is tried again."""
        held = self._graft_gains if self._grafts else self._traffic_gains[0]  # alike for every request yet to graft
        now, gains = held
        if gains is None or now != self._grafted_rounds[0]:  # kept until a fork observes a grafted round
            reached, passed = np.maximum(self.traffic - self.graft_seen, 0.0)  # the other requests' rounds
            traffic = (GRAFT_PRIOR + passed) / (1 + reached)  # (budget,)
            reached, passed = self.graft_seen
            gains = np.cumsum(np.cumprod((traffic + passed) / (1 + reached)))
            if self._grafts:
                self._graft_gains = (self._grafted_rounds[0], gains)
            else:
                self._traffic_gains[0] = (self._grafted_rounds[0], gains)
        return gains

    def _grafted(
        self,
        graft: LookupGraft,
        own: list[Offer],
        catch_up: float,
        columns: tuple[np.ndarray, np.ndarray, np.ndarray],
        gains: np.ndarray,
        context: list[int],
        price: Price | None,
    ) -> list[Offer]:
        """`graft`'s lookup branches found now, whole and cut to GRAFT_SIZES nodes: alone, and onto each of `own`
        (`columns`: their nodes, gains and own ms, `catch_up` in), a cut to n nodes worth `gains[n - 1]` accepted
        nodes; where the suffix pool found continuations (`LookupGraft.found`), its tree alone, cut (`_cuts`), worth
        what the pool expects of it; at `price`, those that pass."""
        alone, pooled, branches = graft.found(context)
        out = []
        if alone is not None:  # the pool's likeliest nodes, cut as grafts are (the own branches after: worth nothing)
            worth = np.cumsum(pooled.probs)
            offers = [Offer(n, float(worth[n - 1]), 0.0, graft=True, pool=True) for n in _cuts(len(worth))]
            out = [o for o in offers if price is None or price.passes(o)]
        found = len(build_trie(branches, graft.budget)) if branches else 0
        if not found:
            return out
        sizes = np.array(sorted({min(n, found) for n in GRAFT_SIZES} | {found}))
        worth = gains[sizes - 1]
        cuts = zip(sizes.tolist(), worth.tolist(), _passing(price, worth, np.zeros(len(sizes)), sizes), strict=True)
        out += [Offer(n, w, 0.0, graft=True) for n, w, k in cuts if k]
        nodes, gain, spend = columns
        onto = _passing(price, gain[:, None] + worth, spend[:, None], nodes[:, None] + sizes)  # (own, sizes)
        for i, j in zip(*np.nonzero(onto), strict=True):
            o, n = own[i], int(sizes[j])
            out.append(
                o._replace(nodes=o.nodes + n, gain=o.gain + float(worth[j]), draft_ms=o.draft_ms + catch_up, graft=True)
            )
        return out

    @torch.inference_mode()
    def propose(self, context: list[int]) -> DraftTree:
        return drive(self.drafting(context))

    def drafting(self, context: list[int], size: Offer | None = None) -> Drafting:
        """The inner drafter's tree at `size` (one of `offers`; None: its own tree), what it drafted noted for
        `observe`."""
        self._round = None
        t0 = time.perf_counter()  # an uncalibrated drafter's own time (a head's steps, drafted together, are not)
        tree = yield from self.inner.drafting(context, size)
        if size is None:
            return tree
        graft = self.graft
        if graft is None or graft.alone is None:  # a round of the pool's tree alone: the graft records it
            own = graft.own if graft is not None else len(tree)
            self._round = (own, size.heads, max(len(tree) - own, 0), time.perf_counter() - t0)
        return tree.prefix(size.nodes)

    def finish(self, context: list[int]) -> None:
        self.inner.finish(context)

    def observe(self, tree: DraftTree, path: list[int], hidden: torch.Tensor, next_token: int) -> None:
        if self._round is not None and len(tree):
            own, sized, grafted, seconds = self._round
            ours = next((k for k, node in enumerate(path) if node >= own), len(path))  # the heads' nodes come first
            if self._curve() and sized:
                self.curve_seen[0] += ours
                self.curve_seen[1] += self._gains(sized)
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
                self._grafted_rounds[0] += 1
                self._grafts += 1
        self._observed += 1
        if self._observed % FORGET_EVERY == 0:  # grafted rounds fade, the request's and (at every fork's) the traffic's
            for seen in (self.graft_seen, self.traffic):
                seen *= (1 - 1 / FORGET_ROUNDS) ** FORGET_EVERY
            self._grafted_rounds[0] += 1
        self.inner.observe(tree, path, hidden, next_token)


def _cuts(nodes: int) -> list[int]:
    """A tree of `nodes` nodes offered whole and cut to its first GRAFT_SIZES, 8, 16 ... nodes."""
    sizes, n = set(GRAFT_SIZES), 2 * max(GRAFT_SIZES)
    while n < nodes:
        sizes.add(n)
        n *= 2
    return sorted({min(k, nodes) for k in sizes} | {nodes})


def _columns(offers: list[Offer]) -> np.ndarray:
    """(4, n): the nodes, gains, drafting ms and shared ms of `offers`."""
    return np.array([[o.nodes, o.gain, o.draft_ms, o.shared_ms] for o in offers], dtype=np.float64).T


def _passing(price: Price | None, gain: np.ndarray, own_ms: np.ndarray, nodes: np.ndarray) -> np.ndarray:
    """Which offers (as arrays: their gains, own ms and nodes) pass `price` (None: every one)."""
    return np.ones(np.shape(gain), dtype=bool) if price is None else price.beaten(gain, own_ms, nodes)

"""Speculation sized by load: each round, the tree nodes every live sequence verifies (0: a plain step for it).

Speculation and batching spend the same idle compute. A round of B sequences at width w (the widest tree) costs
the batched forward (`runtime/sizing/batch_cost.py`: a base at that width, as attention reads every sequence's rows
padded to it, plus each draft node's own row where the rows are packed; padded rows cost every sequence w + 1
rows and a node nothing more) plus the drafting of the sequences that draft; it commits B tokens plus the draft
nodes that survive. Each sequence's drafter
makes its *offers* (`Offer`: nodes, the expected surviving nodes, the drafting ms) from what it knows: the heads'
calibrated per-depth accuracies corrected by the acceptance this request got so far, lookup branches by their
measured hit rate (runtime/sizing/budgeted.py). `allocate` picks the width and each sequence's offer that
maximise the round's expected committed tokens per ms:

    max over w, and offers o_i with o_i.nodes <= w (or none):
        (B + sum_i o_i.gain) / (base_ms(B, w, longest) + sum_i (o_i.draft_ms + node_ms(B, w) o_i.nodes + tree_ms)
                                + overhead_ms)

(overhead_ms: what a round costs beyond the forward and the drafting, tree_ms: what a sequence that speculates costs
beyond that and the plain sequence's share of overhead_ms; both measured by the `Planner` as it runs).

For a fixed w the base is paid whatever the sequences draft, so the best offers solve a ratio of separable sums:
Dinkelbach's iteration (each sequence takes the offer maximising gain - lambda * (draft_ms + node_ms * nodes),
lambda = the ratio so far) reaches the optimum in a few steps; w runs over the widths offered. At batch 1 on a
steep CPU curve this gives the batch-1 trees; as B grows the forward's cost of a node's row (and of the width's
padded attention) outgrows the survival of a node, and the plan falls to plain batched decoding by itself
(tests/test_budget.py: the brute-force optimum on small cases, packed and padded, a steep and a flat curve). The
plan depends only on past rounds, never on this round's draws, so every sequence keeps the target's distribution.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import numpy as np

from headstart.runtime.drafters.base import PLAIN, Offer
from headstart.runtime.sizing.batch_cost import BatchCost

WIDTHS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48)  # the widths a round may pad to


class Price(NamedTuple):
    """What no offer a plan takes can fail (`allocate`): its gain above `rate` (tokens per ms: the plain rate, the
    least any plan's rate is) times the least it costs, drafting beyond the shared part, `tree_ms`, and `node_ms` (no
    width's price of a node is lower) a node. A drafter asked at a price offers only what passes (`Sized.offers`)."""

    rate: float
    node_ms: float
    tree_ms: float

    def passes(self, o: Offer) -> bool:
        return self.beaten(o.gain, o.draft_ms - o.shared_ms, o.nodes)

    def beaten(self, gain: float, own_ms: float, nodes: int) -> bool:
        """Whether `gain` accepted nodes for `own_ms` of drafting (beyond the shared part) and `nodes` pass."""
        return gain > self.rate * (own_ms + self.tree_ms + self.node_ms * nodes)


def plain_rate(b: int, longest: int, cost: BatchCost, margin: float = 0.0, overhead_ms: float = 0.0) -> float:
    """Tokens per ms of a plain round of `b` sequences, times (1 + margin): what a plan must beat."""
    return b / (cost.forward_ms(b, 0, longest) + overhead_ms) * (1 + margin)


def allocate(
    offers: Sequence[Sequence[Offer]],
    longest: int,
    cost: BatchCost,
    margin: float = 0.0,
    overhead_ms: float = 0.0,
    tree_ms: float = 0.0,
) -> tuple[int, list[Offer | None]]:
    """The width and each sequence's offer (None: plain) with the most expected tokens per ms (module docstring),
    the width one of WIDTHS or the widest offer. `longest`: the most tokens a sequence of the batch holds in the
    cache; `margin`: a plan that speculates must promise (1 + margin) times the plain rate (the cost model's own
    error: a gain it cannot tell from that error is not taken); `overhead_ms`: what a round costs beyond the forward
    and the drafting, whatever its plan (the loop's own work per sequence: accepting, committing, streaming);
    `tree_ms`: what each sequence that speculates costs beyond that (its tree's accepting, committing, packing).

    Sequences that draft with one head draft together (runtime/drafters/together.py): a plan pays the largest
    `shared_ms` of its offers once and the rest of each offer's drafting, so every level of shared drafting is a case
    beside every width (offers above it do not fit).

    Every case's Dinkelbach iteration runs at once, as arrays over (case, sequence, offer): the server plans every
    round, and one Python loop per case and sequence cost ~1 ms a round at 16 sequences. One sequence's plan is one
    offer at its best width, without it (the iteration's ~20 array operations a step cost ~0.5 ms of a ~17 ms
    bfloat16 round alone, in-process)."""
    b = len(offers)
    plain = plain_rate(b, longest, cost, margin, overhead_ms)
    offered = {o.nodes for own in offers for o in own if o.nodes > 0}
    if not offered:
        return 0, [None] * b
    widths = sorted(offered & set(WIDTHS) | {max(offered)})
    if b == 1:  # one offer at its best width (its shared drafting paid once: all of its drafting)
        own = [o for o in offers[0] if o.nodes > 0]
        nodes, gain, ms = np.array([[o.nodes, o.gain, o.draft_ms] for o in own], dtype=np.float64).T  # (M,) each
        width = np.array(widths, dtype=np.float64)[:, None]  # (W, 1)
        base = np.array([[cost.base_ms(1, w, longest) + overhead_ms + tree_ms] for w in widths])  # (W, 1)
        per_node = np.array([[cost.node_ms(1, w)] for w in widths])  # (W, 1)
        rate = np.where(nodes <= width, (1 + gain) / (base + ms + per_node * nodes), -np.inf)  # (W, M)
        best = int(np.argmax(rate))  # width-major: the narrowest of the best
        if not rate.flat[best] > plain * (1 + 1e-12):
            return 0, [None]
        return own[best % len(own)].nodes, [own[best % len(own)]]
    return _allocate_batch(offers, widths, longest, cost, plain, overhead_ms, tree_ms)


def _allocate_batch(
    offers: Sequence[Sequence[Offer]],
    widths: list[int],
    longest: int,
    cost: BatchCost,
    plain: float,
    overhead_ms: float,
    tree_ms: float,
) -> tuple[int, list[Offer | None]]:
    """`allocate` for any batch: every (width, shared drafting) case's Dinkelbach iteration at once."""
    b = len(offers)
    levels = sorted({0.0} | {o.shared_ms for own in offers for o in own})
    width = np.repeat(np.array(widths, dtype=np.float64), len(levels))  # (C,) each case's width ...
    level = np.tile(np.array(levels), len(widths))  # (C,) ... and shared drafting
    m = max(len(own) for own in offers)
    table = np.zeros((4, b, m))  # nodes, gain, draft ms, shared ms of each sequence's offers, padded with unfit ones
    table[0] = np.inf
    for i, own in enumerate(offers):
        if own:
            table[:, i, : len(own)] = np.array([[o.nodes, o.gain, o.draft_ms, o.shared_ms] for o in own]).T
    nodes, gain, ms, shared = table
    fits = (nodes > 0) & (nodes[None] <= width[:, None, None]) & (shared[None] <= level[:, None, None])  # (C, B, M)
    base = np.repeat([cost.base_ms(b, w, longest) for w in widths], len(levels))  # (C,) the forward, by width
    forward = base + level + overhead_ms  # (C,)
    per_node = np.repeat([cost.node_ms(b, w) for w in widths], len(levels))[:, None, None]  # (C, 1, 1)
    spend = ms - shared + tree_ms + per_node * np.where(np.isfinite(nodes), nodes, 0)  # (C, B, M): an offer's own ms
    rate = np.maximum(plain, b / forward)  # a case that cannot beat plain keeps no plan
    chosen = np.full((len(width), b), -1)  # (C, B): each sequence's offer at each case's best rate, -1: plain
    rows = np.arange(b)
    while True:  # Dinkelbach in every case: the offers that beat its rate, until none does
        value = np.where(fits, gain - rate[:, None, None] * spend, -np.inf)  # (C, B, M)
        best = value.argmax(axis=2)  # (C, B)
        take = np.take_along_axis(value, best[..., None], axis=2)[..., 0] > 0
        tokens = b + np.where(take, gain[rows, best], 0.0).sum(axis=1)
        paid = np.where(take, np.take_along_axis(spend, best[..., None], axis=2)[..., 0], 0.0)  # (C, B)
        new = tokens / (forward + paid.sum(axis=1))
        better = new > rate * (1 + 1e-12)
        if not better.any():
            break
        rate = np.where(better, new, rate)
        chosen = np.where(better[:, None], np.where(take, best, -1), chosen)
    planned = (chosen >= 0).any(axis=1) & (rate > plain)
    if not planned.any():
        return 0, [None] * b
    c = int(np.flatnonzero(planned)[np.argmax(rate[planned])])  # the first of the best: the narrowest, cheapest
    plan = [offers[i][k] if k >= 0 else None for i, k in enumerate(chosen[c].tolist())]
    return max(o.nodes for o in plan if o is not None), plan


def forward_ms(picks: Sequence[Offer | None], longest: int, cost: BatchCost) -> float:
    """What the model says a plan's forward costs: at its width, over its nodes."""
    chosen = [o for o in picks if o is not None]
    width = max((o.nodes for o in chosen), default=0)
    return cost.forward_ms(len(picks), width, longest, sum(o.nodes for o in chosen))


def plan_ms(picks: Sequence[Offer | None], longest: int, cost: BatchCost) -> float:
    """What the model says a plan's round costs: the forward, and the drafting (the largest shared part once)."""
    chosen = [o for o in picks if o is not None]
    drafting = sum(o.draft_ms - o.shared_ms for o in chosen) + max((o.shared_ms for o in chosen), default=0.0)
    return forward_ms(picks, longest, cost) + drafting


def expected_rate(picks: Sequence[Offer | None], longest: int, cost: BatchCost, overhead_ms: float = 0.0) -> float:
    """Expected tokens per ms of a plan: what `allocate` maximises (tests compare plans by it)."""
    gain = sum(o.gain for o in picks if o is not None)
    return (len(picks) + gain) / (plan_ms(picks, longest, cost) + overhead_ms)


class Evidence(NamedTuple):
    """What a sized drafter's offers are made of, known without making them (`Sized.evidence`): its own offers
    (`own`; a drafter's cached curve, the same object for the sequences that share it), each drafted for
    `extra_ms` more (a head's catch-up); lookup branches cut to n = 1, 2 ... nodes worth `cuts[n - 1]` each (any a
    search may find), alone or onto an own offer; a tree of its own drafted alone (`alone`: each node worth less
    than the first, at most the second of them)."""

    own: Sequence[Offer]
    extra_ms: float = 0.0
    cuts: Sequence[float] = ()
    alone: tuple[float, int] = (0.0, 0)


class Tier(NamedTuple):
    """The offers of at most `nodes` nodes (None: any), each node at `node_ms`: what plans at some widths pay."""

    nodes: int | None
    node_ms: float


BOUNDED_WIDTHS = ((1, 1), (2, 2), (3, 7), (8, None))  # the ranges of widths `who_could_pay` checks apart


def who_could_pay(evidence: Sequence[Evidence], price: Price, cost: BatchCost, longest: int, n: int) -> list[bool]:
    """Which of the sequences with `evidence` (of `n`, the rest offering nothing) could have an offer taken by a plan
    that beats plain decoding: `allocate` plans no tree for the others, so they need not make their offers (a busy
    batch plans every round: 16 sequences' offers cost ~1 ms of a 40 ms bfloat16 round in-process, where none was
    taken, and served the drafting was 3.6-5.8 % of the rounds' time); all False where no plan could beat plain.

    A plan at width w beats the plain rate P only if its trees' surpluses at P (their nodes at the width's node
    price) sum above P times what the width adds to the forward (`allocate`'s rate: (n + sum gain) / (base_w +
    sum cost) > P, and n <= P base_0). Checked over the ranges of BOUNDED_WIDTHS: each sequence's best offer of at
    most the range's widest nodes at the least node price of its widths (`Tier`), summed where positive, against
    what the range's narrowest width adds (the base grows with the width); a sequence could be in a plan only at a
    range that passes, and only where its surplus there is positive (no offer of less takes part: `allocate`'s rate
    is never below P). At 16 sequences a node costs ~1.4 ms at width 1 and ~1.1 at the widest (float32), which a
    1-node graft worth 0.5 pays only at wider widths, whose attention costs more than 16 such nodes bring. Each
    distinct curve and cuts object is valued once."""
    tiers, need = [], []
    for low, high in BOUNDED_WIDTHS:
        tiers.append(Tier(high, min(cost.node_ms(n, w) for w in range(low, high + 1)) if high else price.node_ms))
        need.append(price.rate * (cost.base_ms(n, low, longest) - cost.base_ms(n, 0, longest)))
    valued: dict[int, tuple[object, list[tuple[float, float]]]] = {}  # id -> (object, `_bests`)

    def held(obj, items) -> list[tuple[float, float]]:
        got = valued.get(id(obj))
        if got is None or got[0] is not obj:
            got = valued[id(obj)] = (obj, _bests(items(), price, tiers))
        return got[1]

    surplus = []  # (sequence, tier)
    for e in evidence:
        own, cuts = held(e.own, lambda e=e: _own_items(e)), held(e.cuts, lambda e=e: _cut_items(e))
        surplus.append([max(_tier_surplus(e, own[t], cuts[t], price, tier), 0.0) for t, tier in enumerate(tiers)])
    found = [sum(column) for column in zip(*surplus, strict=True)] if surplus else [0.0] * len(tiers)
    passing = [t for t, (f, m) in enumerate(zip(found, need, strict=True)) if f > m * (1 - 1e-9)]  # a tie passes
    return [any(own[t] > 0 for t in passing) for own in surplus]


def graft_surplus(e: Evidence, price: Price) -> float:
    """The largest surplus at `price` of any grafted offer `e` allows, whatever a lookup finds (a drafter searches
    its lookup only above 0: a bound looser than this, the whole graft's gain for one node, had a busy batch
    search in 97 % of its sequence-rounds, where none passed)."""
    tier = Tier(None, price.node_ms)
    [own], [cuts] = _bests(_own_items(e), price, [tier]), _bests(_cut_items(e), price, [tier])
    return _tier_surplus(e, own, cuts, price, tier, grafts_only=True)


def _own_items(e: Evidence) -> list[tuple[int, float, float]]:
    return [(o.nodes, o.gain, o.draft_ms - o.shared_ms) for o in e.own]  # (nodes, gain, own ms), catch-up apart


def _cut_items(e: Evidence) -> list[tuple[int, float, float]]:
    return [(k, g, 0.0) for k, g in enumerate(e.cuts, 1)]


def _bests(items: Sequence[tuple[int, float, float]], price: Price, tiers: Sequence[Tier]) -> list[tuple[float, float]]:
    """For each tier, the largest surplus at `price` of the (nodes, gain, own ms) `items` of at most the tier's nodes
    (each node at its node_ms), and of those of one node fewer (-inf: none)."""
    out = []
    for tier in tiers:
        cap, top, below = tier.nodes if tier.nodes is not None else math.inf, -math.inf, -math.inf
        for k, gain, own_ms in items:
            if k <= cap:
                value = gain - price.rate * (own_ms + price.tree_ms + tier.node_ms * k)
                top = max(top, value)
                below = max(below, value) if k <= cap - 1 else below
        out.append((top, below))
    return out


def _tier_surplus(
    e: Evidence,
    own: tuple[float, float],
    cuts: tuple[float, float],
    price: Price,
    tier: Tier,
    grafts_only: bool = False,
) -> float:
    """The largest surplus at `price` of an offer of at most the tier's nodes that `e` allows (`own`, `cuts`: the
    `_bests` of its own offers and of its cuts at this tier): an own offer (its catch-up added), a cut alone, a cut
    onto an own offer (both of one node fewer, the tree paid once), the pool's tree alone (a surplus linear in its
    nodes: largest at one or at all of them); `grafts_only`: of the grafted offers alone."""
    rate, tree = price.rate, price.tree_ms
    (top, below), (cut, cut_below) = own, cuts
    value = max(cut, below - rate * e.extra_ms + cut_below + rate * tree)
    if not grafts_only:
        value = max(value, top - rate * e.extra_ms)
    worth, most = e.alone
    if most:
        k = min(most, tier.nodes or most)
        value = max(value, worth - rate * (tree + tier.node_ms), worth * k - rate * (tree + tier.node_ms * k))
    return value


def _about_range(n: int) -> tuple[int, int]:
    """The batch sizes about as large as `n` (3/4 n to 3/2 n): the least and the most."""
    return -(-3 * n // 4), 3 * n // 2


class Sized(Protocol):
    """A drafter the budget sizes (runtime/sizing/budgeted.py): the trees it offers now; the plan hands one back to
    its `drafting` as the round's size."""

    def offers(self, context: list[int], price: Price | None = None) -> list[Offer]: ...

    def evidence(self, context: list[int]) -> Evidence:
        """What its offers now are made of: each offer `offers` would make is one `Evidence` values (or below)."""
        ...


class Planner:
    """Sizes every live sequence's tree before a round (`generate.Batch(planner=...)`): their drafters' offers,
    allocated under `cost`, speculating only where the gain it promises exceeds the model's worst error at that
    batch size (measured: bfloat16 at 4 requests lost 16 % to plain on gains within that error; the error of the
    whole grid, 10 % at 8-16 sequences here, held 2 requests to 1.15x plain where a fixed tree made 1.31x, while
    the model is within 3 % at 1-4 sequences).

    A round costs more than its forward and drafting: accepting, committing, and a server's streaming of each
    sequence's tokens. That share is measured as it runs: the time from one plan to the next less what the model
    says the first plan's forward costs and less what the loop says it spent on other work (`observe`'s: the last
    round's drafting, as measured, and the joiners' prefill before this plan). Rounds where no sequence speculated
    give a plain sequence's share (per sequence, the median of the last OVERHEAD_ROUNDS such rounds at about the
    batch size planned for, `overhead_ms`; an idle wait between two plans is an outlier the median ignores), paid
    by every plan; the others give what each sequence
    that speculated cost beyond it (its tree's accepting, committing, the packing of uneven trees), paid by each
    sequence a plan gives a tree; until a plain round is seen the whole is every sequence's share (a request
    alone speculates every round: charged to its trees, plain looked cheap and its trees shrank, 1.51x plain at
    one client against 1.61x). One share for both made plain rounds look dear wherever most rounds speculated
    (bfloat16, 16 sequences in-process: 1.7 ms a sequence charged, 0.6 measured on plain rounds) and the budget
    speculated in 94 % of the sequence-rounds at 16 clients for 0.86x plain. Drafting is measured, not modelled,
    here: a sequence's first drafting enters its prompt's pairs into the head's cache (and after a plain stretch,
    that stretch's), a cost paid once that, counted as what a tree costs each round, kept the first trees from ever
    paying. Under churn (32 clients) most rounds prefill a joiner's chunk: counted as overhead, that made
    speculation look cheap (83 % of sequence-rounds speculated, 0.84x plain, float32). `clock`: seconds, as
    `time.perf_counter` (tests).

    What the model promises is checked by what the rounds measure (`trees_lose`): the rounds' tokens (their drafting
    in, a joiner's prefill out) over what the model says plain decoding makes in their time at their batch size;
    where the rounds with trees made less of it than the plain rounds at about that batch size, no tree is offered
    there until those tree rounds have left the record (MEASURED_ROUNDS rounds on: then MEASURED_LEAST are tried again);
    where nearly every round speculates, some are made plain to keep plain measured (`plain_unmeasured`).

    A busy batch rarely speculates, and asking each sequence every round what its tree would be worth cost ~0.8 ms
    of a 55 ms round at 16 sequences (float32, in-process), where 1 % of the sequence-rounds got a tree: where the
    plans at about the batch size (the last OVERHEAD_ROUNDS, MEASURED_LEAST at least) promised fewer tokens beyond
    plain's, on average, than their own time cost at the plain rate (`plans_pay`), the next plan is made a round on,
    after two such plans in a row two rounds on, then 4, then every RESTS_MOST rounds, the rounds between planned
    plain without asking, whether a plan gave a tree or not (one tree is no sign that plans pay: where a plan's tree
    reset the rests, 6 of 16 plans at 10 sequences gave one, and all of them promised 0.2 tokens for 18 of their own
    time, float32 in-process); where they pay, or at a batch size out of 3/4 to 3/2 of the last plan's, the next
    round plans again. A request alone whose lookup finds a branch now and then plans every
    round: a plan costs ~0.1 ms, a branch found is worth a token or more (rested whenever a plan took 1 % of the
    forward, `lookup` on Spec-Bench was planned in 152 of 1,171 rounds, bfloat16, and drafted in one)."""

    OVERHEAD_ROUNDS = 64
    RESTS_MOST = 8  # after plans that gave no tree, the next is made 1, 2, 4, then at most this many rounds on
    MEASURED_ROUNDS = 256  # the rounds `trees_lose` looks back over
    MEASURED_LEAST = 8  # ... of which it needs this many plain and this many with trees at about the batch size
    STALLED = 4.0  # ... a round's time counted at most this many times its kind's median
    LOSE_Z = 2.0  # ... and the trees lose where plain's rate is above theirs by more than this many standard errors

    def __init__(self, cost: BatchCost, clock: Callable[[], float] = time.perf_counter) -> None:
        self.cost, self.clock = cost, clock
        self.overheads: deque[tuple[int, float]] = deque(maxlen=self.OVERHEAD_ROUNDS)  # plain rounds: (sequences, ms)
        # rounds with trees: (ms beyond the model, sequences, sequences given a tree)
        self.tree_rounds: deque[tuple[float, int, int]] = deque(maxlen=self.OVERHEAD_ROUNDS)
        # every round: (sequences, with trees, its tokens, the tokens the model's plain rate at its batch size makes
        # in its time)
        self.yields: deque[tuple[int, bool, int, float]] = deque(maxlen=self.MEASURED_ROUNDS)
        # (when the last plan was made, the model's ms of its forward, sequences, sequences given a tree, the model's
        # ms of a plain forward of its sequences)
        self._last: tuple[float, float, int, int, float] | None = None
        self._observed: tuple[int, float] = (0, 0.0)  # the last round's (tokens, drafting seconds)
        self._idle = 0  # plans in a row that gave no sequence a tree
        # plans made: (sequences, the tokens they promised beyond plain's in their round, their own time's tokens)
        self.plans: deque[tuple[int, float, float]] = deque(maxlen=self.OVERHEAD_ROUNDS)
        self._resting = (0, 0)  # (rounds still planned plain unasked, the batch size then)

    def observe(self, tokens: int, drafted_s: float) -> None:
        """After a round: the tokens it committed (every decoding sequence's accepted nodes and its next token) and
        the seconds its drafting took, as measured (the time since the plan less them is the rest of the round)."""
        self._observed = (tokens, drafted_s)

    def _choose(
        self, drafters: Sequence[Sized], contexts: Sequence[list[int]], longest: int, n: int, near: tuple[list, list]
    ) -> tuple[list, float, float]:
        """The plan of the decoding sequences (`drafters`) among `n`: each one's offer, None for a plain step; the
        tokens it promises beyond what plain decoding makes in the time its trees add, and the plain rate (tokens
        per ms). `near`: `_yields_near(n)`."""
        b = len(drafters)
        margin, overhead, tree_ms = self.cost.error(n), self.overhead_ms(n) * n, self.tree_ms()
        rate = plain_rate(n, longest, self.cost, margin, overhead)
        if self.trees_lose(near):
            return [None] * b, 0.0, rate
        price = Price(rate, self.cost.least_node_ms(n), tree_ms)
        asked = who_could_pay(
            [d.evidence(c) for d, c in zip(drafters, contexts, strict=True)], price, self.cost, longest, n
        )
        if not any(asked):
            return [None] * b, 0.0, rate
        offers = [d.offers(c, price) if a else [] for d, c, a in zip(drafters, contexts, asked, strict=True)]
        picks = allocate(offers + [[]] * (n - b), longest, self.cost, margin, overhead, tree_ms)[1]
        trees = [o for o in picks if o is not None]
        added = plan_ms(picks, longest, self.cost) - self.cost.forward_ms(n, 0, longest) + tree_ms * len(trees)
        return picks[:b], sum(o.gain for o in trees) - rate * added, rate

    def _yields_near(self, n: int) -> tuple[list, list]:
        """The recorded rounds at about `n` sequences (3/4 n to 3/2 n), plain and with trees: (tokens, plain's tokens
        in their time) each (read once a plan: `plain_unmeasured` and `trees_lose` judge them)."""
        low, high = _about_range(n)
        near: tuple[list, list] = ([], [])
        for s, speculated, tokens, at_plain in self.yields:
            if low <= s <= high:
                near[speculated].append((tokens, at_plain))
        return near

    def plain_unmeasured(self, near: tuple[list, list]) -> bool:
        """Whether this round is made plain to measure plain decoding, `near` the rounds at about its batch size
        (`_yields_near`): where they hold a quarter of MEASURED_ROUNDS rounds with trees and fewer than
        MEASURED_LEAST plain ones, `trees_lose` has nothing to compare them with (a request alone speculated in 98 %
        of its rounds with 1.9-node trees at 0.95x plain, bfloat16, served). About MEASURED_LEAST rounds of
        MEASURED_ROUNDS go plain so."""
        plain, trees = near
        return len(trees) >= self.MEASURED_ROUNDS // 4 and len(plain) < self.MEASURED_LEAST

    def plans_pay(self, n: int) -> bool:
        """Whether the plans made at about `n` sequences (3/4 n to 3/2 n) promised more tokens beyond plain's, on
        average, than their own time cost at the plain rate (True until MEASURED_LEAST are seen)."""
        low, high = _about_range(n)
        near = [(promised, spent) for s, promised, spent in self.plans if low <= s <= high]
        if len(near) < self.MEASURED_LEAST:
            return True
        return sum(promised for promised, _ in near) > sum(spent for _, spent in near)

    def trees_lose(self, near: tuple[list, list]) -> bool:
        """Whether, of `near` (`_yields_near`: the rounds at about a batch size), the rounds with trees made fewer
        tokens, over what the model's plain rate makes in their time, than the plain rounds: each kind's tokens over
        its time, a round's time at most STALLED times its kind's median (a stall between two rounds is no round's
        cost; a median of the rounds' own rates read lookup's grafts, lost in half of the rounds for 0 tokens and won
        in the others for 3, as losing, where they made 1.1x plain). False until MEASURED_LEAST of each kind, and
        where plain's rate beats theirs by no more than LOSE_Z standard errors of the difference (each rate's as a
        ratio of sums over its rounds): at a batch of one, whose plain rounds are the few `plain_unmeasured` keeps,
        one noisy reading of a loss locks trees out until the record's tree rounds age out (MEASURED_ROUNDS rounds: a
        whole served level at one client, where 12-15 % of the rounds speculated in two runs against 83-97 % in two,
        bfloat16; docs/serving.md)."""
        if min(len(kind) for kind in near) < self.MEASURED_LEAST:
            return False
        rates, variances = [], []
        for kind in near:
            most = self.STALLED * statistics.median(at_plain for _, at_plain in kind)
            tokens, spent = zip(*((t, min(at_plain, most)) for t, at_plain in kind), strict=True)
            rate = sum(tokens) / sum(spent)
            rates.append(rate)
            spread = sum((t - rate * w) ** 2 for t, w in zip(tokens, spent, strict=True))  # the ratio's, per round
            variances.append(spread / sum(spent) ** 2 * len(kind) / (len(kind) - 1))
        return rates[0] - rates[1] > self.LOSE_Z * math.sqrt(sum(variances))

    def overhead_ms(self, n: int) -> float:
        """A sequence's share of a round beyond the model (ms) at `n` sequences: the median of the plain rounds seen
        at about n (3/4 n to 3/2 n); with none there, the plain rounds' of the nearest batch size, their round's
        ms over the larger of the two sizes (a share that errs low, so plain rounds come and teach the share at n:
        a round's fixed part weighs most alone, and a share learnt at 1-4 sequences charged per sequence at 8 made
        plain look dear there; the budget, speculating in 92 % of the request-rounds, met too few plain rounds to
        learn better: served, float32, 8 clients after 1, 2 and 4; 4 % when 8 came first). Before any plain round,
        of every round's, speculating or not (alone, a request speculates every round: its whole overhead is then
        the share a plain step would pay too, or plain would look cheaper than it is); 0 before any round."""
        if self.overheads:
            low, high = _about_range(n)
            near = [ms / s for s, ms in self.overheads if low <= s <= high]
            if near:
                return max(statistics.median(near), 0.0)
            nearest = min(self.overheads, key=lambda o: abs(o[0] - n))[0]
            return max(statistics.median(ms for s, ms in self.overheads if s == nearest) / max(nearest, n), 0.0)
        if self.tree_rounds:
            return max(statistics.median(beyond / s for beyond, s, _ in self.tree_rounds), 0.0)
        return 0.0

    def tree_ms(self) -> float:
        """What a sequence that speculates costs a round beyond a plain one's share (ms) at that round's batch size:
        0 until plain rounds have told that share apart and MEASURED_LEAST rounds with trees are seen (from a batch
        of one's first graft round or two, 2.7 ms a tree was charged to every tree after, and none was drafted
        again: Spec-Bench, bfloat16)."""
        if not self.overheads or len(self.tree_rounds) < self.MEASURED_LEAST:
            return 0.0
        share = {s: self.overhead_ms(s) for s in {s for _, s, _ in self.tree_rounds}}
        return max(statistics.median((beyond - share[s] * s) / trees for beyond, s, trees in self.tree_rounds), 0.0)

    def plan(
        self,
        drafters: Sequence[Sized],
        contexts: Sequence[list[int]],
        prefill_s: float = 0.0,
        waiting: int = 0,
        sample: bool = True,
    ) -> list[Offer]:
        """Each drafter's size for the coming round: one of its offers, PLAIN for a plain step (the round hands them
        to `propose_all`). `prefill_s`: seconds since the last plan the loop spent prefilling joiners (work aside, as
        the last round's drafting, which `observe` told); `waiting`: joiners that would decode beside them but wait for
        their prefill (one a round while others decode). A round's ms delays them too, so the plan is made as for the
        batch with them in it, decoding plainly: a tree must beat the larger batch's plain rate. Planned for the
        decoding sequences alone, the first rounds of a burst of arrivals gave the few decoding ones big trees while the
        rest waited (bf16, 16 clients: 0.93x plain over the level, its steady state 1.01x, the p95 time to first token
        2.37 s against 2.01). `sample`: False where the time since the last plan is no sample of a round's cost (its
        forward carried a joiner's prompt chunk, `generate.Batch` mixing)."""
        now, b = self.clock(), len(drafters)
        (tokens, drafted_s), self._observed = self._observed, (0, 0.0)
        if self._last is not None and sample:
            then, modelled, sequences, trees, plain_ms = self._last
            beyond = 1e3 * (now - then - prefill_s - drafted_s) - modelled
            if trees:
                self.tree_rounds.append((beyond, sequences, trees))
            else:
                self.overheads.append((sequences, beyond))
            if tokens:
                at_plain = sequences * 1e3 * (now - then - prefill_s) / plain_ms  # plain's tokens in that time
                self.yields.append((sequences, trees > 0, tokens, at_plain))
        longest = max(len(c) for c in contexts) - 1
        n = b + waiting
        rest, then = self._resting
        low, high = _about_range(then)
        if rest and low <= n <= high:
            self._resting = (rest - 1, then)
            picks: list[Offer | None] = [None] * b
        elif self.plain_unmeasured(near := self._yields_near(n)):
            picks = [None] * b
        else:
            t0 = self.clock()
            picks, promised, rate = self._choose(drafters, contexts, longest, n, near)
            self.plans.append((n, promised, rate * 1e3 * (self.clock() - t0)))
            self._idle = 0 if self.plans_pay(n) else self._idle + 1
            self._resting = (min(2 ** (self._idle - 1), self.RESTS_MOST) - 1 if self._idle else 0, n)
        plain_ms = self.cost.forward_ms(b, 0, longest)
        self._last = (now, forward_ms(picks, longest, self.cost), b, sum(o is not None for o in picks), plain_ms)
        return [PLAIN if o is None else o for o in picks]

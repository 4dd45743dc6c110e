"""Speculation sized by load: each round, the tree nodes every live sequence verifies (0: a plain step for it).

Speculation and batching spend the same idle compute. A round of B sequences at width w costs the batched forward
(`runtime/batch_cost.py`: rows padded to the widest tree, so every sequence pays w + 1 rows) plus the drafting
of the sequences that draft; it commits B tokens plus the draft nodes that survive. Each sequence's drafter
makes its *offers* (`Offer`: nodes, the expected surviving nodes, the drafting ms) from what it knows: the heads'
calibrated per-depth accuracies corrected by the acceptance this request got so far, lookup branches by their
measured hit rate (runtime/drafters/budgeted.py). `allocate` picks the width and each sequence's offer that
maximise the round's expected committed tokens per ms:

    max over w, and offers o_i with o_i.nodes <= w (or none):
        (B + sum_i o_i.gain) / (forward_ms(B, w, longest) + sum_i o_i.draft_ms)

For a fixed w the forward is paid whatever the sequences draft, so the best offers solve a ratio of separable sums:
Dinkelbach's iteration (each sequence takes the offer maximising gain - lambda * draft_ms, lambda = the ratio so
far) reaches the optimum in a few steps; w runs over the widths offered. At batch 1 on a steep CPU curve this
gives the batch-1 trees; as B grows the forward's cost of one more row of width times B outgrows the survival of
a node, and the plan falls to plain batched decoding by itself (tests/test_budget.py: the brute-force optimum on
small cases, a steep and a flat curve). The plan depends only on past rounds, never on this round's draws, so
every sequence keeps the target's distribution.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from headstart.runtime.batch_cost import BatchCost

WIDTHS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48)  # the widths a round may pad to


@dataclass(frozen=True)
class Offer:
    """A tree a sequence's drafter can draft this round."""

    nodes: int  # rows it adds beyond the root (an upper bound: the tree is cut to the width it is given)
    gain: float  # expected draft nodes accepted (tokens beyond the target's own one)
    draft_ms: float  # what drafting it costs
    heads: int = 0  # nodes the drafter's own model drafts (the rest: grafted lookup branches)
    graft: bool = False  # lookup branches grafted on


def allocate(
    offers: Sequence[Sequence[Offer]], longest: int, cost: BatchCost, margin: float = 0.0
) -> tuple[int, list[Offer | None]]:
    """The width and each sequence's offer (None: plain) with the most expected tokens per ms (module docstring),
    the width one of WIDTHS or the widest offer. `longest`: the most tokens a sequence of the batch holds in the
    cache; `margin`: a plan that speculates must promise (1 + margin) times the plain rate (the cost model's own
    error: a gain it cannot tell from that error is not taken)."""
    b = len(offers)
    best_rate, best = b / cost.forward_ms(b, 0, longest) * (1 + margin), (0, [None] * b)
    offered = {o.nodes for own in offers for o in own if o.nodes > 0}
    for width in sorted(offered & set(WIDTHS) | ({max(offered)} if offered else set())):
        forward = cost.forward_ms(b, width, longest)
        fits = [[o for o in own if 0 < o.nodes <= width] for own in offers]
        # from the best rate so far: a width that cannot beat it stops at the first step
        rate, plan = max(best_rate, b / forward), [None] * b
        while True:  # Dinkelbach: the offers that beat `rate`, until none does
            picks = [max(own, key=lambda o: o.gain - rate * o.draft_ms, default=None) for own in fits]
            picks = [o if o is not None and o.gain - rate * o.draft_ms > 0 else None for o in picks]
            tokens = b + sum(o.gain for o in picks if o is not None)
            new = tokens / (forward + sum(o.draft_ms for o in picks if o is not None))
            if new <= rate * (1 + 1e-12):
                break
            rate, plan = new, picks
        if any(plan) and rate > best_rate:
            best_rate, best = rate, (max(o.nodes for o in plan if o is not None), plan)
    return best


def expected_rate(picks: Sequence[Offer | None], longest: int, cost: BatchCost) -> float:
    """Expected tokens per ms of a plan: what `allocate` maximises (tests compare plans by it)."""
    chosen = [o for o in picks if o is not None]
    width = max((o.nodes for o in chosen), default=0)
    ms = cost.forward_ms(len(picks), width, longest) + sum(o.draft_ms for o in chosen)
    return (len(picks) + sum(o.gain for o in chosen)) / ms


class Sized(Protocol):
    """A drafter the budget sizes (runtime/drafters/budgeted.py)."""

    def offers(self, context: list[int]) -> list[Offer]: ...

    def take(self, plan: Offer | None) -> None: ...


class Planner:
    """Sizes every live sequence's tree before a round (`generate.Batch(planner=...)`): their drafters' offers,
    allocated under `cost`, speculating only where the gain it promises exceeds the model's worst error over its
    grid (measured: bfloat16 at 4 requests lost 16 % to plain on gains within that error)."""

    def __init__(self, cost: BatchCost) -> None:
        self.cost = cost

    def __call__(self, drafters: Sequence[Sized], contexts: Sequence[list[int]]) -> list[Offer | None]:
        offers = [d.offers(c) for d, c in zip(drafters, contexts, strict=True)]
        _, picks = allocate(offers, max(len(c) for c in contexts) - 1, self.cost, self.cost.worst_error)
        for d, plan in zip(drafters, picks, strict=True):
            d.take(plan)
        return picks

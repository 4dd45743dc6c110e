"""Speculation that steps aside: a drafter wrapper that proposes nothing while speculation does not pay.

`GatedDrafter(inner, speculate)` asks `speculate()` before every round; when it says no, the round
is plain (an empty tree). The inner drafter still observes every round, so drafters with state
(EAGLE's features, a draft model's cache) stay in sync and can resume at once.

`AcceptanceGate` is the second reason to step aside: when the mean acceptance length of the last
`window` speculative rounds falls below `min_acceptance` (the drafter's break-even: the cost of a
speculative round over a plain one), it decodes plainly for `backoff` rounds, then tries again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from headstart.runtime.drafters.base import Drafter, Offer
from headstart.runtime.drafters.together import Drafting, drive
from headstart.runtime.sampling import SamplingParams
from headstart.runtime.tree import DraftTree


class AcceptanceGate:
    def __init__(self, min_acceptance: float, window: int = 16, backoff: int = 32) -> None:
        self.min_acceptance, self.backoff = min_acceptance, backoff
        self.recent: deque[int] = deque(maxlen=window)  # tokens produced by recent speculative rounds
        self.plain_left = 0

    def speculate(self) -> bool:
        if self.plain_left > 0:
            self.plain_left -= 1
            return False
        return True

    def record(self, tokens: int) -> None:
        """A speculative round produced `tokens` (accepted draft tokens + 1)."""
        self.recent.append(tokens)
        if len(self.recent) == self.recent.maxlen and sum(self.recent) / len(self.recent) < self.min_acceptance:
            self.plain_left = self.backoff
            self.recent.clear()


class GatedDrafter(Drafter):
    def __init__(self, inner: Drafter, speculate: Callable[[], bool], gate: AcceptanceGate | None = None) -> None:
        self.inner, self.speculate, self.gate = inner, speculate, gate
        self.name, self.feature_layers = inner.name, inner.feature_layers

    def clear(self) -> None:
        self.inner = self.inner.fork()
        g = self.gate  # its own acceptance record, with the same settings
        self.gate = None if g is None else AcceptanceGate(g.min_acceptance, g.recent.maxlen, g.backoff)

    def start(self, prompt_ids, prompt_hidden, sampling: SamplingParams | None = None, seed: int | None = None):
        self.inner.start(prompt_ids, prompt_hidden, sampling, seed)

    def propose(self, context: list[int]) -> DraftTree:
        return drive(self.drafting(context))

    def drafting(self, context: list[int], size: Offer | None = None) -> Drafting:
        if not self.speculate() or (self.gate is not None and not self.gate.speculate()):
            return DraftTree()
        return (yield from self.inner.drafting(context, size))

    def finish(self, context: list[int]) -> None:
        self.inner.finish(context)

    def observe(self, tree: DraftTree, path: list[int], hidden: torch.Tensor, next_token: int) -> None:
        if tree and self.gate is not None:
            self.gate.record(len(path) + 1)
        self.inner.observe(tree, path, hidden, next_token)

"""accept_path: exact recursive rejection sampling over a verified DraftTree.

Letters: p is the TARGET's distribution at a node (its logits after the same temperature / top-k /
top-p processing plain sampling uses, see `sampling.target_probs`); q is the DRAFT's distribution
a child was proposed from (`DraftTree.draft_probs`), or a point mass at the child's token when the
drafter chose it deterministically.

Walk from the root. At a node, try its children in proposal order: accept child x with probability
min(1, p(x) / q(x)); on rejection replace p by normalize(max(0, p - q)) and try the next sibling.
If every child is rejected, the next token (the correction) is drawn from the final residual and
the walk stops. If an accepted child has no children, the next token (the bonus) is drawn from p at
that leaf. Each step outputs x with probability min(p, q)(x) + P(reject) * residual(x) = p(x), and
this holds whatever q the next sibling was drawn from, so the output sequence has exactly the
target's distribution: with siblings sampled with replacement, without replacement (q renormalised
over the tokens not drawn yet) or chosen deterministically. At temperature 0 the walk is greedy:
accept the child equal to argmax p, and the next token is that argmax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from headstart.runtime.sampling import SamplingParams, target_probs
from headstart.runtime.tree import DraftTree


class RandomSource(Protocol):
    def bernoulli(self, prob: float) -> bool: ...
    def categorical(self, probs: torch.Tensor) -> int: ...


@dataclass
class Acceptance:
    path: list[int]  # accepted node indices, the root's child first
    next_token: int  # the correction (after a rejection) or bonus (at a leaf) token, not in the tree


def accept_path(tree: DraftTree, target_logits: torch.Tensor, params: SamplingParams, rng: RandomSource) -> Acceptance:
    """Choose the accepted path of `tree` given the target's logits (n+1, V) at the root and every node."""
    children = tree.children()
    if params.greedy:
        # (n+1,) one device sync for the whole tree. float first: the same values, so the same argmax, and
        # a float argmax is the faster kernel on CPUs (docs/tuning.md).
        best = target_logits.float().argmax(-1).tolist()
        path: list[int] = []
        row = 0
        while True:
            match = next((c for c in children[row] if tree.tokens[c] == best[row]), None)
            if match is None:
                return Acceptance(path, best[row])
            path.append(match)
            row = match + 1

    probs = target_probs(target_logits, params)  # (n+1, V)
    path = []
    row = 0
    while True:
        p = probs[row]
        for child in children[row]:
            x = tree.tokens[child]
            q = tree.draft_probs[child] if tree.draft_probs is not None else None
            q_x = 1.0 if q is None else float(q[x])
            if rng.bernoulli(float(p[x]) / q_x if q_x > 0 else 1.0):
                path.append(child)
                row = child + 1
                break
            p = _residual(p, x, q)
        else:
            return Acceptance(path, rng.categorical(p))
        if not children[row]:
            return Acceptance(path, rng.categorical(probs[row]))


def _residual(p: torch.Tensor, x: int, q: torch.Tensor | None) -> torch.Tensor:
    """normalize(max(0, p - q)); for a point mass at x, p with x zeroed."""
    if q is None:
        residual = p.clone()
        residual[x] = 0
    else:
        residual = (p - q).clamp_min_(0)
    total = residual.sum()
    # Zero mass means p <= q everywhere, i.e. p == q: rejection had probability 0 (rounding only).
    return residual / total if total > 0 else p

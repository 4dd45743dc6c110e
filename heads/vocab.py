"""A reduced draft vocabulary: the heads read out only the N most frequent target tokens.

For a small target the lm_head dominates every draft step (SmolLM2-135M: 28M of its 135M
parameters); scoring N << V tokens makes drafting and head training cheaper. Draft logits cover the
N kept tokens, mapped back to target ids before they enter a tree. Exactness is untouched: the
verifier always scores the target's full vocabulary, and a draft that can never propose a rare
token only loses the (rare) chance of guessing it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn


def frequent_tokens(sequences: Iterable[list[int]], size: int, vocab_size: int) -> torch.Tensor:
    """(size,) the `size` most frequent ids in `sequences`, most frequent first (ties: lower id first).

    When fewer distinct ids occur, the rest are filled with the lowest unused ids.
    """
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft vocabulary size must be in 1..{vocab_size}, got {size}")
    counts = Counter(tok for seq in sequences for tok in seq)
    ranked = sorted(counts, key=lambda tok: (-counts[tok], tok))[:size]
    seen = set(ranked)
    filler = (tok for tok in range(vocab_size) if tok not in seen)
    ranked += [next(filler) for _ in range(size - len(ranked))]
    return torch.tensor(ranked, dtype=torch.long)


class DraftReadout:
    """A readout over `ids`, the target ids of the draft tokens (all tokens when `ids` is None).

    `weights` is the target's lm_head (its rows of `ids` are used), or a tensor (N, H) that already
    holds one row per draft token (an EAGLE-3 head's own lm_head); `norm`, if given, is applied first.
    `ids` are ordered most frequent first, so `limit` keeps the first `limit` of them: a cheaper
    readout at a small loss of coverage (a full vocabulary, `ids` None, is kept whole). `readout(x)`
    gives logits (..., N) over the kept tokens; `to_target` maps draft indices back to target ids;
    `to_draft` maps target ids to draft indices (-1 where the token was not kept).
    """

    def __init__(
        self, weights: nn.Module | torch.Tensor, ids: torch.Tensor | None, limit: int | None = None, norm=None
    ) -> None:
        if limit is not None and limit < 1:
            raise ValueError(f"the draft vocabulary limit must be at least 1, got {limit}")
        own_rows = isinstance(weights, torch.Tensor)
        weight = (weights if own_rows else weights.weight).detach()  # (V, H) or (N, H), frozen
        self.ids = None if ids is None else ids[:limit].to(weight.device)
        if self.ids is None:
            self.weight = weight
        else:
            self.weight = weight[: len(self.ids)] if own_rows else weight[self.ids]  # (N, H)
        self.norm = norm
        self.project = None  # a module computing x @ weight.T faster (runtime's prepacked kernels), if set
        self._lookup = None  # target id -> draft index (-1: not kept), built once on first use

    @property
    def size(self) -> int:
        return self.weight.shape[0]

    def to(self, dtype: torch.dtype) -> DraftReadout:
        """This readout with its rows in `dtype` (a copy of them where they are in another)."""
        self.weight = self.weight.to(dtype)
        return self

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm is not None:
            x = self.norm(x)
        x = x.to(self.weight.dtype)
        return self.project(x) if self.project is not None else F.linear(x, self.weight)  # (..., H) -> (..., N)

    def to_target(self, index: torch.Tensor) -> torch.Tensor:
        return index if self.ids is None else self.ids[index]

    def to_draft(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.ids is None:
            return token_ids
        if self._lookup is None:
            self._lookup = torch.full((int(self.ids.max()) + 2,), -1, dtype=torch.long, device=self.ids.device)
            self._lookup[self.ids] = torch.arange(len(self.ids), device=self.ids.device)
        return self._lookup[token_ids.clamp(max=len(self._lookup) - 1)]

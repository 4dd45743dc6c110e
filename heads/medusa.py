"""Medusa heads: K residual blocks on the target's final hidden state, read out by an lm_head.

Head k (k = 1..K) at position t predicts token t+k+1: the target's own lm_head already predicts
t+1 from the same state. Each head is `num_layers` blocks `x + SiLU(W x + b)` (one by default; the
Medusa authors' published heads may hold more) with W and b zero-initialised, so an untrained head
starts as the target's own next-token guess. The readout is the target's frozen
lm_head unless `own_lm_head` (then a trainable copy per head, initialised from the target's).
"""

from __future__ import annotations

import torch
from torch import nn

from headstart.heads.vocab import DraftReadout


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        num_heads: int = 4,
        own_lm_head: bool = False,
        draft_vocab: int = 0,
        num_layers: int = 1,
    ) -> None:
        super().__init__()
        if num_heads < 1:
            raise ValueError(f"num_heads must be >= 1, got {num_heads}")
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        if own_lm_head and draft_vocab:
            raise ValueError("own_lm_head and draft_vocab exclude each other")
        self.num_heads = num_heads

        # One module per head: `[ResBlock(h)] * K` would tie them all to one set of weights.
        # One block is kept unwrapped (`blocks.{k}.linear.*`): the names every checkpoint so far was saved under.
        def head() -> nn.Module:
            blocks = [ResBlock(hidden_size) for _ in range(num_layers)]
            return blocks[0] if num_layers == 1 else nn.Sequential(*blocks)

        self.blocks = nn.ModuleList(head() for _ in range(num_heads))
        self.lm_heads = (
            nn.ModuleList(nn.Linear(hidden_size, vocab_size, bias=False) for _ in range(num_heads))
            if own_lm_head
            else None
        )
        # (N,) target ids of the draft vocabulary, set by training; None = the full vocabulary.
        self.register_buffer("draft_vocab", torch.zeros(draft_vocab, dtype=torch.long) if draft_vocab else None)

    def readout(self, target_lm_head: nn.Module, limit: int | None = None) -> DraftReadout:
        """The target's lm_head over this checkpoint's draft vocabulary (its `limit` most frequent tokens)."""
        return DraftReadout(target_lm_head, self.draft_vocab, limit)

    def init_lm_heads(self, target_lm_head: nn.Module) -> None:
        """Copy the target's lm_head into each own lm_head (no-op when the target's is shared)."""
        if self.lm_heads is not None:
            for head in self.lm_heads:
                head.weight.data.copy_(target_lm_head.weight.data)

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) final hidden states -> (K, ..., H) per-head features."""
        return torch.stack([block(hidden) for block in self.blocks])

    def head_logits(self, k: int, feature: torch.Tensor, target_lm_head) -> torch.Tensor:
        """Logits of head k (1-based) from its feature (..., H) -> (..., V), or (..., N) through a DraftReadout."""
        lm_head = self.lm_heads[k - 1] if self.lm_heads is not None else target_lm_head
        return lm_head(feature)

    def forward(self, hidden: torch.Tensor, target_lm_head) -> torch.Tensor:
        """(..., H) -> (K, ..., V) logits; head k's row predicts the token k+1 places ahead."""
        feats = self.features(hidden)
        return torch.stack([self.head_logits(k + 1, feats[k], target_lm_head) for k in range(self.num_heads)])

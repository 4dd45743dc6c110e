"""Attention masks as float tensors: what the heads' training and the runtime's tree forwards pass to attention."""

from __future__ import annotations

import torch


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """(q, k) or (B, q, k) bool -> float 4D mask (1 or B, 1, q, k) on `device`: 0 where allowed, dtype's most
    negative value elsewhere. The bool mask travels, the float one is built where it is used."""
    allowed = allowed.to(device)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None] if mask.dim() == 2 else mask[:, None]


def causal_after(past: int, n: int) -> torch.Tensor:
    """(n, past + n) bool: n new rows after `past` cached keys, each seeing every cached key and the new ones up to
    itself."""
    return torch.ones(n, past + n, dtype=torch.bool).tril(past)


def unroll_mask(T: int, step: int) -> torch.Tensor:
    """(T, step * T) bool: the keys that row s of unroll step `step` (1-based) attends to.

    Keys are the head's entries of steps 1..step, T each, in that order. Row s of step k drafts as
    the k-th autoregressive head call after a root at r = s - k + 1 does at inference: it sees the
    entries of true features at positions <= r (step 1), then the entry its own path wrote at each
    earlier step m (column s - k + m of step m), itself last. Step 1 is plain causal attention.
    Rows with r < 0 have no root; they see only their own earlier-step entries and are not scored.
    """
    s = torch.arange(T)[:, None]
    j = torch.arange(T)[None]
    blocks = [j <= s - step + 1]  # step 1: true features up to the root
    blocks += [j == s - step + m for m in range(2, step + 1)]  # steps 2..k: one entry of its own path each
    return torch.cat(blocks, dim=1)

"""Attention masks for a model's layout: full attention, a sliding window on every layer, or the two mixed.

The verifier hands the model its own 4D masks (a tree mask), so it must also apply what the model's layers
would: a sliding-window layer at position i sees only keys at positions j > i - window. Mistral-style
models (one window for every layer, no per-layer types) take one windowed mask; models whose config lists
`layer_types` with both kinds (Gemma 2/3, Qwen2 with windows on some layers) take a mask per kind, as
transformers' own `{"full_attention": ..., "sliding_attention": ...}` mapping.

Caches stay full on every layer (`DynamicCache()` without a config): a sliding-window cache layer
forgets old keys, so it can neither be cropped back after a rejected draft nor re-indexed to an accepted
branch; the masks keep the attention exact instead.
"""

from __future__ import annotations

import torch

from headstart.heads.masks import additive_mask

MaskArg = torch.Tensor | dict[str, torch.Tensor]


class MaskBuffer:
    """Full-attention tree masks in one preallocated float buffer, so a round allocates nothing that grows with
    the sequence: the committed prefix is visible to every new row (zeros, written once), and only the block of
    the root and the tree's nodes changes each round, after the previous round's block is cleared."""

    def __init__(self, dtype: torch.dtype, device) -> None:
        self.dtype, self.device = dtype, device
        self.buf: torch.Tensor | None = None  # (rows capacity, columns capacity)
        self.dirty: tuple[int, int, int] | None = None  # (rows, first column, end column) written last round

    def mask(self, block: torch.Tensor, past: int) -> torch.Tensor:
        """(1, 1, q, past + q) float mask: every row sees the `past` cached keys; `block` (q, q) bool says which of
        the new keys each new row sees. A view of the buffer, valid until the next call."""
        q = block.shape[0]
        rows, cols = q, past + q
        if self.buf is None or rows > self.buf.shape[0] or cols > self.buf.shape[1]:
            shape = (max(rows, 2 * (self.buf.shape[0] if self.buf is not None else 32)),
                     max(cols, 2 * (self.buf.shape[1] if self.buf is not None else 512)))  # fmt: skip
            self.buf, self.dirty = torch.zeros(shape, dtype=self.dtype, device=self.device), None
        if self.dirty is not None:
            r, c0, c1 = self.dirty
            self.buf[:r, c0:c1] = 0
        self.buf[:rows, past:cols] = additive_mask(block, self.dtype, self.device)[0, 0]
        self.dirty = (rows, past, cols)
        return self.buf[:rows, :cols][None, None]


class AttentionLayout:
    def __init__(self, config) -> None:
        window = getattr(config, "sliding_window", None)
        types = list(getattr(config, "layer_types", None) or [])
        sliding = window is not None and (not types or "sliding_attention" in types)  # Qwen2 without windows: full
        self.window: int | None = window if sliding else None
        self.mixed = sliding and "full_attention" in types
        unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"{type(config).__name__}: attention layer types {unknown} are not supported")

    def masks(self, allowed: torch.Tensor, q_pos: torch.Tensor, past: int, dtype: torch.dtype, device) -> MaskArg:
        """Float 4D mask(s) for new queries at positions `q_pos` (q,), `allowed` (q, past + q) over the `past`
        cached keys (positions 0..past-1) and the new ones (at `q_pos`)."""
        full = additive_mask(allowed, dtype, device)
        if self.window is None:
            return full
        k_pos = torch.cat([torch.arange(past), q_pos])
        windowed = additive_mask(allowed & (k_pos[None, :] > q_pos[:, None] - self.window), dtype, device)
        return {"full_attention": full, "sliding_attention": windowed} if self.mixed else windowed

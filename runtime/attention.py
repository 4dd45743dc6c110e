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

from headstart.runtime.tree import additive_mask

MaskArg = torch.Tensor | dict[str, torch.Tensor]


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

"""Attention for verified trees: masks for a model's layout (full attention, a sliding window on every layer, or
the two mixed), and the fast path's grouped-query SDPA, which reads the cache without copying it (`grouped_sdpa`).

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

import copy
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from headstart.heads.masks import additive_mask, causal_after

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
            shape = (
                max(rows, 2 * (self.buf.shape[0] if self.buf is not None else 32)),
                max(cols, 2 * (self.buf.shape[1] if self.buf is not None else 512)),
            )
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

    def batch_masks(
        self, allowed: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, dtype: torch.dtype, device
    ) -> MaskArg:
        """`masks` for r sequences at once: `allowed` (r, q, k) over each sequence's cache rows, `q_pos` (r, q)
        the new rows' positions, `k_pos` (r, k) the position each cache row holds. Float (r, 1, q, k)."""
        full = additive_mask(allowed, dtype, device)
        if self.window is None:
            return full
        inside = k_pos[:, None, :] > q_pos[:, :, None] - self.window  # (r, q, k)
        windowed = additive_mask(allowed & inside, dtype, device)
        return {"full_attention": full, "sliding_attention": windowed} if self.mixed else windowed


@dataclass(frozen=True)
class Packing:
    """r sequences' rows fed to one forward packed end to end, (1, N) with N = sum of their row counts, instead of
    padded to the widest, (r, q): the linear layers (most of a forward's cost) see only real rows. Attention alone
    reads them padded, each sequence's rows against its own slot of the cache (`grouped_sdpa` unpacks the queries
    and packs its output back); a padding position reads its sequence's first row, and nothing reads its output.
    After them may come prefill chunks (`chunks`, in the slots after the r sequences'): each attends alone, causal
    over its own slot. Passed to the model's forward as the keyword `packing` (transformers hands its keywords to
    the attention function)."""

    gather: torch.Tensor  # (r * q,) the packed row each padded position reads
    scatter: torch.Tensor  # (N,) the padded position (i * q + k) of each packed row
    r: int
    q: int
    chunks: tuple[tuple[int, torch.Tensor], ...] = ()  # per prefill chunk: (its rows n, its mask (1, 1, n, past + n))

    @classmethod
    def of(
        cls, sizes: list[int], device, chunks: list[tuple[int, int]] = (), dtype: torch.dtype = torch.float32
    ) -> Packing:
        """Sequence i feeds `sizes[i]` rows (>= 1), in order; then chunk j its `n` rows after `past` cached ones,
        for `chunks[j] = (past, n)` (a float mask of `dtype` each)."""
        q, starts = max(sizes), list(itertools.accumulate(sizes[:-1], initial=0))
        gather = [start + min(k, n - 1) for start, n in zip(starts, sizes, strict=True) for k in range(q)]
        scatter = [i * q + k for i, n in enumerate(sizes) for k in range(n)]
        causal = tuple((n, additive_mask(causal_after(past, n), dtype, device)) for past, n in chunks)
        return cls(torch.tensor(gather, device=device), torch.tensor(scatter, device=device), len(sizes), q, causal)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """Queries (1, H, N, D) -> (r, H, q, D)."""
        _, h, _, d = x.shape
        return x[0].index_select(1, self.gather).view(h, self.r, self.q, d).transpose(0, 1)

    def pack(self, out: torch.Tensor) -> torch.Tensor:
        """Attention's output (r, q, H, D) -> (1, N, H, D)."""
        _, _, h, d = out.shape
        return out.reshape(self.r * self.q, h, d).index_select(0, self.scatter)[None]


# --- grouped-query attention over a tree without copying the cache (the fast path) ----------------------------
GROUPED_SDPA = "headstart_grouped_sdpa"  # the attention implementation name the fast path gives the target


def grouped_sdpa(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, except under grouped-query attention for several queries under a mask shared
    by every head (a verified tree) or for one query (a plain step): there stock SDPA repeats the cache's keys and
    values for every query head (a copy of the whole cache in every layer, every round; on CPU, masked SDPA takes
    no `enable_gqa`), and one unmasked query goes to `enable_gqa`, which on CPU costs as much as that copy (bf16,
    2,048 cached tokens: 1.32 ms a layer against 0.29 here). Here the query heads that share a key/value head are
    stacked as extra query rows instead, so attention reads the cache as it is; only the mask, (q, past + q), is
    repeated for them. The same products per (query, key), so the same values as stock SDPA
    (tests/test_fast_path.py)."""
    packing: Packing | None = kwargs.pop("packing", None)
    if packing is not None:  # rows of several sequences packed end to end: attend padded, one sequence a row
        r, rows = packing.r, packing.scatter.numel()
        trees = packing.unpack(query[:, :, :rows])
        out, _ = grouped_sdpa(module, trees, key[:r], value[:r], attention_mask, dropout, scaling, is_causal, **kwargs)
        outs = [packing.pack(out)]
        for j, (n, mask) in enumerate(packing.chunks):  # a prefill chunk: its rows over its own slot's keys
            k = mask.shape[-1]
            chunk = query[:, :, rows : rows + n]
            own, _ = grouped_sdpa(
                module,
                chunk,
                key[r + j : r + j + 1, :, :k],
                value[r + j : r + j + 1, :, :k],
                mask,
                dropout,
                scaling,
                is_causal,
                **kwargs,
            )
            outs.append(own)
            rows += n
        return (outs[0] if len(outs) == 1 else torch.cat(outs, 1)), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    B, H, q, D = query.shape  # (B, H, q, D) queries; key, value: (B, G, k, D) with G key/value heads
    G = key.shape[1]
    # a plain step (one query, no mask) or one mask shared by every head (a tree); a causal prefill stays stock
    shared = attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[1] == 1
    groupable = shared or (q == 1 and attention_mask is None)
    if (
        G == H
        or not groupable
        or dropout
        or kwargs.get("position_bias") is not None
        or kwargs.get("softcap") is not None
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    r = H // G  # query heads per key/value head: head g * r + j reads key/value head g
    grouped = query.reshape(B, G, r * q, D)  # row j * q + i: query i of head g * r + j
    mask = None  # one query, no mask: it attends to the whole cache
    if attention_mask is not None:
        Bm, k = attention_mask.shape[0], attention_mask.shape[-1]
        mask = attention_mask[:, :, None].expand(Bm, 1, r, q, k).reshape(Bm, 1, r * q, k)  # (B, 1, r*q, k)
    out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=mask, scale=scaling)  # (B, G, r*q, D)
    return out.reshape(B, H, q, D).transpose(1, 2).contiguous(), None  # (B, q, H, D), as stock SDPA returns


def use_grouped_sdpa(model: nn.Module) -> bool:
    """Switch `model` (a transformers model running SDPA) to `grouped_sdpa` (a model without grouped queries gets
    stock SDPA through it, and packed rows: `Packing`); False, unchanged, for any other attention implementation
    (eager, flash, flex: their own kernels)."""
    config = model.config
    if config._attn_implementation == GROUPED_SDPA:  # switched already (another Target over the same model)
        return True
    if config._attn_implementation != "sdpa" or not getattr(config, "num_attention_heads", None):
        return False
    _register()
    model.set_attn_implementation(GROUPED_SDPA)
    return True


def attend_with_grouped_sdpa(module: nn.Module) -> None:
    """`use_grouped_sdpa` for a module built of transformers layers that is no model (a drafter's head): its layers
    running SDPA run `grouped_sdpa`, each through a copy of its config (an EAGLE head's layers hold the target's own
    config object, which stays as it is)."""
    copies: dict[int, object] = {}
    for m in module.modules():
        config = getattr(m, "config", None)
        if config is not None and getattr(config, "_attn_implementation", None) == "sdpa":
            _register()
            if id(config) not in copies:
                copies[id(config)] = copy.copy(config)
                copies[id(config)]._attn_implementation = GROUPED_SDPA
            m.config = copies[id(config)]


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(GROUPED_SDPA, grouped_sdpa)
    ALL_MASK_ATTENTION_FUNCTIONS.register(GROUPED_SDPA, sdpa_mask)  # masks built as for SDPA

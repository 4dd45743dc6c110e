"""An EAGLE or EAGLE-3 head's draft layers through the native forward (runtime/native.py): a drafting step in one call.

Through transformers' decoder layer a drafting step of the shipped EAGLE-3 head cost ~1.5 ms before its readout
(bfloat16, SmolLM2-135M's sizes): ~150 small operations and a `DynamicCache` that copies the head's whole cache at
every step, for ~10 MB of weights (~0.4 ms of reading). Here the layer runs as the target's layers do: its products
packed, norm, rotary, attention and MLP in one C++ call, keys and values written in place.

What the native call is given (the kernel's one layer kind, fed as each head needs):
- EAGLE: x = fc([embedding; feature]) in Python (one packed product); the layer's input norm is `nn.Identity`, so
  q/k/v read x itself.
- EAGLE-3: u = fc(fused states) (or the head's own previous output), and the first layer's q/k/v read
  [input_layernorm(embedding); hidden_norm(u)] (`x_in`, made in Python) while u (or hidden_norm(u)) is the residual;
  further draft layers are plain Llama layers; `norm_output` is the call's final norm.

The head's cache: every fork of a drafter holds a slot of one pool of preallocated rows (`HeadSlots`, per head
dtype), so sequences drafting together are one call with each row in its own sequence's slot, and a row's values do
not depend on which rows share the call (the kernel's row-count invariance: a fork drafts alone the very tree it
drafts in a batch, in bfloat16 too). A drafting step's entries are rows after the committed ones; `crop` drops
them. A head whose layers the kernel does not run (another architecture's, a sliding window, weights it cannot
pack) keeps transformers' layer and a `DynamicCache` (`NativeHead.build` returns None).
"""

from __future__ import annotations

import weakref

import numpy as np
import torch
from torch import nn

from headstart.heads.eagle3 import Eagle3Head
from headstart.heads.masks import additive_mask
from headstart.runtime import native
from headstart.runtime.fused import FusedLayer, FusedStack, rms_norm, signed_sin
from headstart.runtime.kernels import NATIVE
from headstart.runtime.kvcache import grown_rows


class HeadSlots:
    """Keys and values of one head's layers for every fork: per layer (slots, G, capacity, D), grown by doubling."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        self.layers, self.kv_heads, self.head_dim, self.dtype = layers, kv_heads, head_dim, dtype
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.free: list[int] = []
        self.handed = 0  # slots handed out so far (the free ones among them in `free`)

    def acquire(self) -> int:
        if self.free:
            return self.free.pop()
        self.handed += 1
        return self.handed - 1

    def release(self, slot: int) -> None:
        self.free.append(slot)

    def reserve(self, slots: int, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The buffers, grown to hold `slots` slots of `rows` rows (each dimension doubling past what it had)."""
        have_s, have_c = (self.kv[0][0].shape[0], self.kv[0][0].shape[2]) if self.kv else (0, 0)
        if slots <= have_s and rows <= have_c:
            return self.kv
        s, c = max(slots, 2 * have_s), grown_rows(rows, have_c)
        grown = []
        for layer in range(self.layers):
            pair = []
            for old in self.kv[layer] if self.kv else (None, None):
                new = torch.zeros(s, self.kv_heads, c, self.head_dim, dtype=self.dtype)
                if old is not None:
                    new[:have_s, :, :have_c] = old
                pair.append(new)
            grown.append((pair[0], pair[1]))
        self.kv = grown
        return grown


class HeadCache:
    """One fork's entries in its head's `HeadSlots`: its slot and how many rows it holds (the DynamicCache calls the
    drafter makes: `get_seq_length`, `crop`). The slot goes back to the pool when the cache is dropped."""

    def __init__(self, slots: HeadSlots) -> None:
        self.slots = slots
        self.slot = slots.acquire()
        self.length = 0
        weakref.finalize(self, slots.release, self.slot)

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, max_length: int) -> None:
        """Keep the first `max_length` rows (negative: drop that many from the end), as DynamicCache.crop."""
        self.length = max_length if max_length >= 0 else self.length + max_length


class NativeHead:
    """A head's draft layers as the native forward runs them (see the module docstring); `run` is a drafting step of
    one or more sequences, each `HeadStep` of its own fork."""

    def __init__(self, head: nn.Module, layers: list[FusedLayer], table: native.Layers) -> None:
        self.head, self.layers, self.table = head, layers, table
        fl = layers[0]
        self.dtype = fl.post_norm.weight.dtype
        self.pool = HeadSlots(len(layers), fl.kv_heads, fl.head_dim, self.dtype)
        self.eagle3 = isinstance(head, Eagle3Head)
        self._cos: torch.Tensor | None = None  # (L, D) rotary tables (`_rotary`)
        self._sin: torch.Tensor | None = None

    @classmethod
    def build(cls, head: nn.Module) -> NativeHead | None:
        """The native draft layers of `head` (its linear layers packed as the native kernel reads them, runtime/
        kernels.prepack_like_target), or None where the kernel does not run them."""
        kind = getattr(head.fc, "kind", None)
        if kind != NATIVE or native.library() is None:
            return None
        modules = [head.midlayer, *head.extra_layers] if isinstance(head, Eagle3Head) else [head.layer]
        config = modules[0].self_attn.config
        if FusedStack.config_refusal(config) is not None:
            return None
        layers = [FusedLayer(m, config, kind) for m in modules]
        table = native.layers(layers)
        return None if table is None else cls(head, layers, table)

    def new_cache(self) -> HeadCache:
        return HeadCache(self.pool)

    def run(self, steps: list) -> list[torch.Tensor]:
        """Each step's outputs (n_i, H): its rows appended to its own cache after its committed ones."""
        head, dtype = self.head, self.dtype
        features = torch.cat([s.features for s in steps]).to(dtype)  # (N, F): a copy, the kernel writes in place
        embeds = steps[0].embed(torch.tensor([t for s in steps for t in s.tokens])).to(dtype)  # (N, E)
        sizes = [len(s.tokens) for s in steps]
        rows = np.zeros((4, sum(sizes)), dtype=np.int64)  # per row: slot, row written, keys read, mask row address
        masks, at = [], 0
        for s, n in zip(steps, sizes, strict=True):
            mask = additive_mask(s.allowed, dtype)[0, 0]  # (n, past + n), contiguous
            masks.append(mask)  # held until the call returns
            past = s.cache.length
            block = rows[:, at : at + n]
            block[0], block[1], block[2] = s.cache.slot, np.arange(past, past + n), mask.shape[1]
            block[3] = mask.data_ptr() + mask.stride(0) * mask.element_size() * np.arange(n)
            at += n
        kv = self.pool.reserve(self.pool.handed, int(rows[1].max()) + 1)
        x_in, final_norm = None, None
        if self.eagle3:
            u = head.fuse(features) if features.shape[-1] == head.fc.in_features else features
            normed = rms_norm(u, head.midlayer.hidden_norm)
            x_in = torch.cat([rms_norm(embeds, head.midlayer.input_layernorm), normed], dim=-1)  # (N, 2E)
            h = normed if head.midlayer.norm_before_residual else u
            final_norm = head.norm.weight if head.norm_output else None
        else:
            h = head.fc(torch.cat([embeds, features], dim=-1))  # (N, E): q/k/v read it as it is (no input norm)
        cos, sin = self._rotary(h, torch.cat([s.positions for s in steps]))
        out = native.run(self, self.layers[0], self.table, h.contiguous(), cos, sin, tuple(torch.from_numpy(rows)),
                         kv, final_norm, x_in=x_in)  # fmt: skip
        for s, n in zip(steps, sizes, strict=True):
            s.cache.length += n
        return list(out.split(sizes))

    def _rotary(self, like: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (N, D) at `positions` (N,), sin's first half negated (the kernel's rotate_half): rows of tables
        made once by the head's own rotary embedding (each position's values are computed alone), grown by doubling;
        a dynamic rotary (its frequencies depend on the length) is computed at every call."""
        rotary, kwargs = self.head.rotary, getattr(self.head, "rotary_kwargs", {})
        dynamic = "dynamic" in str(getattr(rotary, "rope_type", ""))
        need, have = int(positions.max()) + 1, 0 if self._cos is None else len(self._cos)
        if dynamic or have < need:
            at = positions if dynamic else torch.arange(grown_rows(need, have))
            cos, sin = rotary(like, at[None], **kwargs)  # (1, L, D)
            if dynamic:
                return cos[0], signed_sin(sin[0])
            self._cos, self._sin = cos[0], signed_sin(sin[0])
        return self._cos[positions], self._sin[positions]

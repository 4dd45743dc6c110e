"""The target's KV cache: preallocated buffers that grow by doubling, cropped and re-indexed in place.

transformers' `DynamicCache` concatenates every new key onto the old ones, copying the whole cache of every
layer each step (the cost grows with the sequence). Here each layer writes the new rows into a buffer with
room to spare and hands attention a view of the filled part: a step copies only its own rows. Dropping a
rejected draft is a change of length; committing an accepted branch that does not lie right after the
root moves only the accepted rows (`keep_rows`), not the whole cache.

Layers stay full on every layer, sliding-window ones included (runtime/attention.py says why).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

MIN_CAPACITY = 256  # rows a layer's first buffer holds beyond its first write


class PreallocatedLayer(DynamicLayer):
    """One layer's keys and values (1, kv_heads, capacity, head_dim); `keys`/`values` view the filled rows."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.length = 0
        self._k = self._v = None

    def _reserve(self, rows: int, like_k: torch.Tensor, like_v: torch.Tensor) -> None:
        capacity = 0 if self._k is None else self._k.shape[-2]
        if rows <= capacity:
            return
        capacity = max(rows + MIN_CAPACITY, 2 * capacity)  # doubling: each row is copied O(1) times in all
        k = like_k.new_empty((*like_k.shape[:-2], capacity, like_k.shape[-1]))
        v = like_v.new_empty((*like_v.shape[:-2], capacity, like_v.shape[-1]))
        if self.length:
            k[..., : self.length, :] = self._k[..., : self.length, :]
            v[..., : self.length, :] = self._v[..., : self.length, :]
        self._k, self._v = k, v

    def _view(self) -> None:
        self.keys = self._k[..., : self.length, :]
        self.values = self._v[..., : self.length, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        self._reserve(self.length + n, key_states, value_states)
        self._k[..., self.length : self.length + n, :] = key_states
        self._v[..., self.length : self.length + n, :] = value_states
        self.length += n
        self._view()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last -tokens_to_remove rows (a negative count, as transformers' own `crop`)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of rows to remove, got {tokens_to_remove}")
        if self.is_initialized and tokens_to_remove:
            self.length = max(self.length + tokens_to_remove, 0)
            self._view()

    def keep_rows(self, start: int, rows: torch.Tensor) -> None:
        """Keep rows [0, start) and then `rows` (ascending, all >= start), moving only those: length start + len."""
        if not self.is_initialized:
            return
        end = start + rows.numel()
        self._k[..., start:end, :] = self._k.index_select(-2, rows)  # a copy of the rows first, then the write
        self._v[..., start:end, :] = self._v.index_select(-2, rows)
        self.length = end
        self._view()


class TargetCache(DynamicCache):
    """A `DynamicCache` whose layers are `PreallocatedLayer`s; `keep_rows` commits a branch in every layer."""

    def __init__(self) -> None:
        super().__init__()
        self.layer_class_to_replicate = PreallocatedLayer

    def keep_rows(self, start: int, rows: torch.Tensor) -> None:
        for layer in self.layers:
            layer.keep_rows(start, rows)

"""The target's KV cache: one row of preallocated buffers per sequence (a slot), grown by doubling, cropped and
re-indexed in place.

Each layer holds (slots, kv_heads, capacity, head_dim) keys and values; position j of a slot's sequence is row j
(a verified tree's nodes take the rows after the root, in node order, until the commit). Before every forward
`feed` says which slots it feeds (a contiguous run: attention reads views of them, never copies) and from which
row each slot's new tokens are written; a forward writes only its own rows and attends to the fed slots' first
`kv_len` rows (a slot's rows past its own length are hidden by the mask the caller gives). transformers'
`DynamicCache` instead concatenates every new key onto the old ones, copying the whole cache of every layer
each step. A slot's length is the caller's bookkeeping (`runtime/target.py`): dropping a rejected draft is a
change of length; committing an accepted branch that does not lie right after the root moves only the accepted
rows (`keep_rows`).

Slots are padded to the widest slot's capacity (one tensor per layer, not pages): the batch's sequences are the
first slots, a leaver's slot is refilled by moving the last live slot into it (`copy`), and `release` frees
everything when the batch empties, handing the freed memory back to the system (`trim_heap`: glibc keeps freed
buffers, and a batched prefill's transient hidden states, resident otherwise; a server's memory then grows to
its busiest moment and stays there). Layers stay full on every layer, sliding-window ones included
(runtime/attention.py says why).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

MIN_CAPACITY = 256  # rows a slot holds at first; doubling past it


def grown_rows(needed: int, have: int) -> int:
    """Rows a buffer holding `have` grows to for `needed`: doubling, past MIN_CAPACITY more than asked (each row is
    copied O(1) times in all); `have` where it holds them already (more slots alone keep the rows there are)."""
    return max(needed + MIN_CAPACITY, 2 * have) if needed > have else have


class SlotLayer(DynamicLayer):
    """One layer's keys and values for every slot: (slots, kv_heads, capacity, head_dim)."""

    def __init__(self, cache: SlotCache) -> None:
        super().__init__()
        self.cache = cache
        self._k = self._v = None

    def _reserve(self, like: torch.Tensor, slots: int, capacity: int) -> None:
        if self._k is not None and slots <= self._k.shape[0] and capacity <= self._k.shape[2]:
            return
        have_s, have_c = (0, 0) if self._k is None else self._k.shape[0:3:2]
        slots = max(slots, min(2 * have_s, self.cache.slots)) if have_s else slots
        capacity = grown_rows(capacity, have_c)
        k = like.new_zeros((slots, like.shape[1], capacity, like.shape[3]))
        v = like.new_zeros((slots, like.shape[1], capacity, like.shape[3]))
        if have_s:
            k[:have_s, :, :have_c] = self._k
            v[:have_s, :, :have_c] = self._v
        self._k, self._v = k, v

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the fed slots' new keys/values (r, kv_heads, q, head_dim) from their start rows on; return those
        slots' keys/values over the first `kv_len` rows (a view)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        c = self.cache
        self._reserve(key_states, c.slots_used, c.kv_len)
        fed = slice(c.first, c.first + len(c.starts))
        if len(c.starts) == 1:
            start, q = c.starts[0], key_states.shape[2]
            self._k[c.first, :, start : start + q] = key_states[0]
            self._v[c.first, :, start : start + q] = value_states[0]
        else:  # (r, kv_heads, q, head_dim) padded, or (1, kv_heads, N, head_dim) packed: one row of keys at a time
            which, rows = c.index(key_states.device)  # (N,), (N,)
            g, d = key_states.shape[1], key_states.shape[3]
            self._k[fed][which, :, rows] = key_states.transpose(1, 2).reshape(-1, g, d)  # indexed as (N, g, d)
            self._v[fed][which, :, rows] = value_states.transpose(1, 2).reshape(-1, g, d)
        self.keys, self.values = self._k[fed, :, : c.kv_len], self._v[fed, :, : c.kv_len]
        return self.keys, self.values

    def keep_rows(self, slot: int, start: int, rows: torch.Tensor) -> None:
        """In `slot`, move `rows` (ascending, all >= start) to start, start + 1, ... (a copy of them first)."""
        if self._k is not None:
            end = start + rows.numel()
            self._k[slot, :, start:end] = self._k[slot].index_select(-2, rows)
            self._v[slot, :, start:end] = self._v[slot].index_select(-2, rows)

    def copy(self, src: int, dst: slice, length: int) -> None:
        """Slot `src`'s first `length` rows to the slots `dst`."""
        if self._k is not None and length:
            self._k[dst, :, :length] = self._k[src, :, :length]
            self._v[dst, :, :length] = self._v[src, :, :length]

    def snapshot(self, slot: int, stop: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        return self._k[slot, :, start:stop].clone(), self._v[slot, :, start:stop].clone()

    def restore(self, slot: int, kv: tuple[torch.Tensor, torch.Tensor]) -> None:
        k, v = kv  # (kv_heads, length, head_dim)
        self._reserve(k[None], max(slot + 1, self.cache.slots_used), k.shape[1])
        self._k[slot, :, : k.shape[1]] = k
        self._v[slot, :, : k.shape[1]] = v

    def get_seq_length(self) -> int:
        return self.cache.starts[0] if self.cache.starts else 0


class SlotCache(DynamicCache):
    """Per-slot KV rows for up to `slots` sequences (None: grown as used); `feed` before every forward."""

    def __init__(self, slots: int = 1) -> None:
        super().__init__()
        self.slots = slots
        self.layer_class_to_replicate = lambda: SlotLayer(self)
        self.first, self.starts, self.kv_len, self.slots_used = 0, [0], 0, 1  # set by `feed`
        self.sizes: list[int] = [0]
        self._index: tuple[torch.Tensor, torch.Tensor] | None = None

    def feed(
        self, first: int, starts: list[int], q: int, sizes: list[int] | None = None, kv_len: int | None = None
    ) -> None:
        """The next forward feeds q tokens to each of slots first, first + 1, ..., written from rows `starts`; or,
        given `sizes` (each at most q), sizes[i] tokens to slot first + i, packed end to end (`attention.Packing`).
        Attention reads the fed slots' first `kv_len` rows (None: max(starts) + q)."""
        if first + len(starts) > self.slots:
            raise ValueError(f"slots {first}..{first + len(starts) - 1} fed, the cache has {self.slots}")
        self.first, self.starts, self._index = first, starts, None
        self.kv_len = max(starts) + q if kv_len is None else kv_len
        self.sizes = [q] * len(starts) if sizes is None else sizes
        self.slots_used = max(self.slots_used, first + len(starts))

    def index(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The fed slot (N,) and the row (N,) each fed token is written to, in feeding order: made once a forward,
        read by every layer."""
        if self._index is None:
            which = [i for i, n in enumerate(self.sizes) for _ in range(n)]
            rows = [start + k for start, n in zip(self.starts, self.sizes, strict=True) for k in range(n)]
            self._index = (torch.tensor(which, device=device), torch.tensor(rows, device=device))
        return self._index

    def keep_rows(self, slot: int, start: int, rows: torch.Tensor) -> None:
        for layer in self.layers:
            layer.keep_rows(slot, start, rows)

    def copy(self, src: int, dst: int | slice, length: int) -> None:
        """The first `length` rows of slot `src` to slot(s) `dst`, in every layer."""
        dst = slice(dst, dst + 1) if isinstance(dst, int) else dst
        self.slots_used = max(self.slots_used, dst.stop)
        for layer in self.layers:
            layer.copy(src, dst, length)

    def snapshot(self, slot: int, stop: int, start: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A copy of slot `slot`'s rows start..stop in every layer (`restore` writes rows from 0 into any slot)."""
        return [layer.snapshot(slot, stop, start) for layer in self.layers]

    def restore(self, slot: int, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.slots_used = max(self.slots_used, slot + 1)
        for layer, layer_kv in zip(self.layers, kv, strict=True):
            layer.restore(slot, layer_kv)

    def release(self) -> None:
        """Free every buffer (the batch is empty) and return the memory to the system; the next forward allocates
        again."""
        for layer in self.layers:
            layer._k = layer._v = None
            layer.keys = layer.values = torch.empty(0)  # the last forward's views, which would keep the buffers
        self.slots_used = 1
        trim_heap()

    def nbytes(self) -> int:
        """Bytes the buffers hold now."""
        return sum(2 * layer._k.nbytes for layer in self.layers if layer._k is not None)


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


def trim_heap() -> bool:
    """Hand the C heap's free pages back to the system (glibc's `malloc_trim`); False where there is no such call
    (not glibc). Costs a walk of the free lists: call it when much was just freed, not every round."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    return bool(trim(0)) if trim is not None else False

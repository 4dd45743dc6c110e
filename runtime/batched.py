"""Continuous batching: many sequences decode through the target's own forward at once, and a finished one's
slot takes the next prompt at once (distillation's engine; `train/distill.py`).

transformers' batched `generate` pads every prompt to the longest of its batch and keeps decoding rows that
have finished until the last one does. Here each of `slots` sequences owns one row of a preallocated KV cache
(`SlotCache`: (slots, kv_heads, capacity, head_dim) per layer) where position j of the sequence is row j, so
sequences of any lengths share a forward: a step feeds each live sequence its last token at its own position
with a mask that shows it its own keys only. When a sequence ends (an EOS or `max_new_tokens`) its slot is
free; free slots are refilled together once enough are free (batched prefills of the next prompts, grouped
by length). The prompts' common prefix (a chat template's system prompt) is computed once, in a spare slot,
and copied into each new sequence's slot: causal attention makes its keys and values the same in every one.

The cache convention is the decode loop's (`runtime/target.py`): a sequence's cache holds every token but
the last, the root, which the next step feeds. A prefill caches a prompt's tokens but the last; its first
decode step scores that last token, so every new token comes out of the same decode forward.

Greedy (T = 0) picks the argmax; T > 0 samples the target's softmax(logits / T) with a generator per
sequence seeded from its own seed, so a sequence's tokens depend on its seed, not on its batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from headstart.heads.masks import additive_mask
from headstart.runtime.attention import AttentionLayout
from headstart.runtime.kvcache import MIN_CAPACITY  # positions a slot holds at first; doubling past it
from headstart.runtime.sampling import draw

PREFILL_TOKENS = 8192  # padded tokens a prefill forward feeds at most


class SlotLayer(DynamicLayer):
    """One layer's keys and values for every slot: (slots, kv_heads, capacity, head_dim)."""

    def __init__(self, cache: SlotCache) -> None:
        super().__init__()
        self.cache = cache
        self._k = self._v = None

    def _reserve(self, like_k: torch.Tensor, like_v: torch.Tensor) -> None:
        need, have = self.cache.kv_len, (0 if self._k is None else self._k.shape[2])
        if need <= have:
            return
        capacity = max(need, 2 * have, MIN_CAPACITY)
        k = like_k.new_zeros((self.cache.slots, like_k.shape[1], capacity, like_k.shape[3]))
        v = like_v.new_zeros((self.cache.slots, like_v.shape[1], capacity, like_v.shape[3]))
        if have:
            k[:, :, :have] = self._k
            v[:, :, :have] = self._v
        self._k, self._v = k, v

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the fed slots' new keys/values (r, kv_heads, q, head_dim) at their positions; return those
        slots' keys/values over the first `kv_len` positions (a view: the fed slots are contiguous)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        c = self.cache
        self._reserve(key_states, value_states)
        fed = slice(c.first, c.first + key_states.shape[0])
        rows = torch.arange(key_states.shape[0], device=key_states.device)[:, None]  # (r, 1)
        self._k[fed][rows, :, c.positions] = key_states.transpose(1, 2)  # indexed as (r, q, kv_heads, head_dim)
        self._v[fed][rows, :, c.positions] = value_states.transpose(1, 2)
        self.keys, self.values = self._k[fed, :, : c.kv_len], self._v[fed, :, : c.kv_len]
        return self.keys, self.values

    def copy(self, src: int, dst: slice, length: int) -> None:
        """Slot `src`'s first `length` positions to the slots `dst`."""
        if self._k is not None and length:
            self._k[dst, :, :length] = self._k[src, :, :length]
            self._v[dst, :, :length] = self._v[src, :, :length]

    def get_seq_length(self) -> int:
        return self.cache.kv_len


class SlotCache(DynamicCache):
    """Per-slot KV rows; before each forward `feed` says which slots it feeds (a contiguous run, so attention
    reads views, never copies) and at which positions."""

    def __init__(self, slots: int, device) -> None:
        super().__init__()
        self.slots, self.device = slots, device
        self.layer_class_to_replicate = lambda: SlotLayer(self)
        self.first, self.kv_len, self.positions = 0, 0, None  # set by `feed` before every forward

    def feed(self, first: int, positions: torch.Tensor) -> None:
        """The next forward feeds slots first, first + 1, ... the tokens at `positions` (r, q) of their sequences."""
        self.first, self.kv_len = first, int(positions.max()) + 1
        self.positions = positions.to(self.device)

    def copy(self, src: int, dst: int | slice, length: int) -> None:
        """The first `length` cached positions of slot `src` to slot(s) `dst`, in every layer."""
        dst = slice(dst, dst + 1) if isinstance(dst, int) else dst
        for layer in self.layers:
            layer.copy(src, dst, length)


def slot_masks(layout: AttentionLayout, positions: torch.Tensor, kv_len: int, dtype: torch.dtype, device):
    """Float 4D mask(s) (r, 1, q, kv_len): the token at position i of a sequence sees its own positions <= i
    (and > i - window on sliding-window layers); slot row j holds position j, so nothing else is visible."""
    keys = torch.arange(kv_len)[None, None, :]  # (1, 1, kv_len)
    queries = positions[:, :, None]  # (r, q, 1)
    allowed = keys <= queries  # (r, q, kv_len)
    if layout.window is None:
        return additive_mask(allowed, dtype, device)
    windowed = additive_mask(allowed & (keys > queries - layout.window), dtype, device)
    if not layout.mixed:
        return windowed
    return {"full_attention": additive_mask(allowed, dtype, device), "sliding_attention": windowed}


@dataclass
class _Sequence:
    request: int  # index into the requests
    root: int  # the token the next step feeds
    cached: int  # tokens in the slot's cache (the root's position)
    tokens: list[int]
    generator: torch.Generator | None


@torch.inference_mode()
def decode_batched(
    model,
    requests: Sequence[list[int]],
    max_new_tokens: int,
    eos_ids: frozenset[int],
    slots: int = 64,
    temperature: float = 0.0,
    seeds: Sequence[int] | None = None,
    refill_at: int | None = None,
    share_prefix: bool = True,
) -> Iterator[tuple[int, list[int]]]:
    """Answer every request (prompt token ids, in the order given) and yield `(request index, new tokens)` as
    each finishes: at its first EOS (kept) or after `max_new_tokens`, or when the model's positions run out.

    `slots`: sequences decoded together; `refill_at`: free slots that trigger a prefill of the next prompts
    (default: a quarter of the slots, or every free slot when the prompts left are fewer); `seeds`: one per
    request, for T > 0."""
    if temperature > 0 and seeds is None:
        raise ValueError("decode_batched: sampling (temperature > 0) needs a seed per request")
    if any(not ids for ids in requests):
        raise ValueError("decode_batched: every request needs at least one prompt token")
    device, dtype = model.device, model.dtype
    layout = AttentionLayout(model.config)
    max_len = getattr(model.config, "max_position_embeddings", None) or 1 << 30
    slots = max(1, min(slots, len(requests)))
    refill_at = max(1, slots // 4) if refill_at is None else refill_at
    cache = SlotCache(slots + 1, device)  # the last slot holds the prompts' common prefix
    live: list[_Sequence] = []  # slot i holds live[i]: the live sequences fill the first slots
    following = 0  # the next request to start

    def forward(ids: list[list[int]], first: int, start: int) -> None:
        """Cache `ids` (right-padded) in slots first, first + 1, ... from position `start` on."""
        width = max(map(len, ids))
        positions = torch.arange(start, start + width)[None].expand(len(ids), width)  # padding: overwritten later
        cache.feed(first, positions)
        padded = torch.tensor([x + [x[-1]] * (width - len(x)) for x in ids], device=device)
        model(
            input_ids=padded,
            attention_mask=slot_masks(layout, positions, start + width, dtype, device),
            position_ids=positions.to(device),
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )

    shared = _common_prefix(requests) if share_prefix else 0
    if shared:
        forward([list(requests[0][:shared])], slots, 0)

    def prefill(free: int) -> None:
        nonlocal following
        todo = list(range(following, min(following + free, len(requests))))
        following += len(todo)
        first = len(live)
        for i in todo:
            gen = None
            if temperature > 0:
                gen = torch.Generator(device=device).manual_seed(int(seeds[i]))
            live.append(_Sequence(i, requests[i][-1], len(requests[i]) - 1, [], gen))
        cache.copy(slots, slice(first, first + len(todo)), shared)
        group: list[int] = []
        for n, i in enumerate([*todo, None]):  # every token but the shared prefix and the last, by length groups
            rest = None if i is None else requests[i][shared:-1]
            if group and (i is None or _too_wide(len(rest), [len(requests[g]) - 1 - shared for g in group])):
                if any(len(requests[g]) - 1 > shared for g in group):
                    forward(
                        [requests[g][shared:-1] or [requests[g][-1]] for g in group], first + n - len(group), shared
                    )
                group = []
            if i is not None:
                group.append(i)

    while following < len(requests) or live:
        free, left = slots - len(live), len(requests) - following
        if left and free and (free >= min(refill_at, left) or not live):
            prefill(free)
        positions = torch.tensor([[s.cached] for s in live])  # (r, 1)
        cache.feed(0, positions)
        out = model(
            input_ids=torch.tensor([[s.root] for s in live], device=device),
            attention_mask=slot_masks(layout, positions, cache.kv_len, dtype, device),
            position_ids=positions.to(device),
            cache=cache,
            use_cache=True,
        )
        logits = out.logits[:, -1].float()  # (r, V); float32's argmax is also the faster one on CPU
        if temperature == 0:
            chosen = logits.argmax(-1).tolist()
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            chosen = [int(draw(p[None], s.generator)[0]) for p, s in zip(probs, live, strict=True)]
        done = []
        for slot, (seq, token) in enumerate(zip(live, chosen, strict=True)):
            seq.tokens.append(token)
            seq.root, seq.cached = token, seq.cached + 1
            if token in eos_ids or len(seq.tokens) >= max_new_tokens or seq.cached >= max_len:
                done.append(slot)
                yield seq.request, seq.tokens
        for slot in reversed(done):  # the last live sequence fills the hole: one copy of its cache
            last = len(live) - 1
            if slot != last:
                cache.copy(last, slot, live[last].cached)
                live[slot] = live[last]
            live.pop()


def _common_prefix(requests: Sequence[list[int]]) -> int:
    """Tokens every request starts with, short of each one's last token (which the first decode step feeds)."""
    first = requests[0]
    n = min(len(r) for r in requests) - 1
    for r in requests:
        while n and r[:n] != first[:n]:
            n -= 1
    return n


def _too_wide(length: int, group: list[int]) -> bool:
    """Start a new prefill group: `length` more would pad too much or feed too many tokens in one forward."""
    width = max(length, *group)
    return width * (len(group) + 1) > PREFILL_TOKENS or width > 1.25 * min(length, *group) + 8

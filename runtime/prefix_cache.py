"""Prompts' keys and values kept after their requests leave, so that a prompt starting the same way (a question
asked again, the next turn of a conversation, an agent's transcript re-sent with one more step) copies them in
instead of computing them: automatic prefix caching, as vLLM and SGLang keep it, in blocks of `BLOCK` tokens.

A block is keyed by its tokens and the block before it (its id), so a block is found only after the whole prefix
before it: a lookup walks the prompt's blocks from the first while they are held. Each block holds every layer's
keys and values of its positions and, where the decode loop's drafters read features, theirs (a head drafter
starts on the prompt's features). Memory is capped: the least recently used block goes first, and a lookup or a
keep touches a chain's deepest block first, so a chain is cut from its end, never from its start.

Exact: keys, values and features of a position depend on the tokens up to it only (causal attention), so copied
rows are the rows a prefill would compute (up to the rounding of a different chunking, as any chunked prefill).
What it adds is a timing side channel: a prompt that starts like an earlier one gets its first token sooner, so a
client could learn from speed what others asked. One server has one API key (one tenant); `--prefix-cache-gb 0`
turns it off.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

BLOCK = 32  # tokens a block holds


@dataclass
class Block:
    id: int
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # every layer's (kv_heads, BLOCK, head_dim) keys and values
    features: torch.Tensor | None  # (BLOCK, F): the drafters' features of these positions, None if they read none

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.kv) + (0 if self.features is None else self.features.nbytes)


DEFAULT_GB = 1.0  # what a server keeps by default (`ServeConfig`), and `headstart bench --workload` as it would


class PrefixCache:
    """Blocks of finished prompts, at most `max_bytes` of them; `layers`: the feature layers the drafters read
    (a request whose drafter reads others neither uses nor fills it)."""

    def __init__(self, max_bytes: int, layers: tuple[int, ...] = ()) -> None:
        self.max_bytes, self.layers = max_bytes, layers
        self.blocks: OrderedDict[tuple[int, tuple[int, ...]], Block] = OrderedDict()  # least recently used first
        self.nbytes = 0
        self.next_id = 1  # 0: the start of every prompt
        self.lock = threading.Lock()
        self.lookups = self.hit_tokens = self.looked_up_tokens = 0

    def _chain(self, ids: list[int], limit: int) -> list[tuple[int, tuple[int, ...]]]:
        """The keys of the held blocks that start `ids`, at most `limit` tokens, from the first."""
        keys, parent = [], 0
        for start in range(0, limit - BLOCK + 1, BLOCK):
            key = (parent, tuple(ids[start : start + BLOCK]))
            block = self.blocks.get(key)
            if block is None:
                break
            keys.append(key)
            parent = block.id
        return keys

    def _touch(self, keys: list[tuple[int, tuple[int, ...]]]) -> None:
        for key in reversed(keys):  # the deepest first: the chain's start ends as the most recently used
            self.blocks.move_to_end(key)

    def match(self, ids: list[int], limit: int) -> list[Block]:
        """The held blocks that start `ids`, within its first `limit` tokens."""
        with self.lock:
            keys = self._chain(ids, limit)
            self._touch(keys)
            self.lookups += 1
            self.looked_up_tokens += limit
            self.hit_tokens += BLOCK * len(keys)
            return [self.blocks[key] for key in keys]

    def keep(self, ids: list[int], snapshot, features: torch.Tensor | None) -> None:
        """Hold the blocks of `ids` not held yet. `snapshot(start, stop)`: every layer's keys and values of
        positions start..stop (copies); `features`: (>= len(ids), F) or None."""
        with self.lock:
            held = self._chain(ids, len(ids))
            parent = self.blocks[held[-1]].id if held else 0
            keys = list(held)
            for start in range(BLOCK * len(held), len(ids) - BLOCK + 1, BLOCK):
                f = None if features is None else features[start : start + BLOCK].clone()
                block = Block(self.next_id, snapshot(start, start + BLOCK), f)
                if block.nbytes > self.max_bytes:
                    break
                self.next_id += 1
                key = (parent, tuple(ids[start : start + BLOCK]))
                self.blocks[key] = block
                self.nbytes += block.nbytes
                keys.append(key)
                parent = block.id
            self._touch(keys)
            while self.nbytes > self.max_bytes:
                _, old = self.blocks.popitem(last=False)
                self.nbytes -= old.nbytes

    def stats(self) -> dict[str, float]:
        """What /metrics shows: blocks and bytes held, lookups, prompt tokens looked up and found."""
        with self.lock:
            return {
                "blocks": len(self.blocks),
                "bytes": self.nbytes,
                "lookups": self.lookups,
                "looked_up_tokens": self.looked_up_tokens,
                "hit_tokens": self.hit_tokens,
            }


def restore(blocks: list[Block]) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor | None]:
    """The blocks' keys and values joined per layer (kv_heads, n, head_dim), and their features (n, F) or None."""
    kv = [
        (torch.cat([b.kv[i][0] for b in blocks], dim=1), torch.cat([b.kv[i][1] for b in blocks], dim=1))
        for i in range(len(blocks[0].kv))
    ]
    features = None if blocks[0].features is None else torch.cat([b.features for b in blocks])
    return kv, features

"""Padded against packed rows, measured: the attention of one decode round over SmolLM2-135M's 30 layers for B
sequences of spread lengths, as one SDPA call over rows padded to the widest (the loop's layout, a mask hiding
each row's padding) against one call per sequence over its own keys (the best a packed layout can do on a CPU,
which has no varlen kernel). Random tensors of the model's shapes; run alone (background jobs paused).

    python tests/engines/padded_attention.py
"""

from __future__ import annotations

import random
import time

import torch
import torch.nn.functional as F

from headstart.runtime import background

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 30  # SmolLM2-135M
CASES = ((16, 250, 420), (16, 250, 800), (32, 250, 420))  # sequences, shortest and longest cached tokens


def ms(fn, repeats: int = 20) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats * 1e3


def case(b: int, lo: int, hi: int) -> str:
    lens = [random.randint(lo, hi) for _ in range(b)]
    width = max(lens)
    q = torch.randn(b, HEADS, 1, HEAD_DIM)  # (B, heads, 1, D): one decode row a sequence
    k, v = torch.randn(b, KV_HEADS, width, HEAD_DIM), torch.randn(b, KV_HEADS, width, HEAD_DIM)
    mask = torch.zeros(b, 1, 1, width)  # (B, 1, 1, K): each row's padding hidden
    for i, n in enumerate(lens):
        mask[i, ..., n:] = float("-inf")

    def padded():
        for _ in range(LAYERS):
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    def alone():
        for _ in range(LAYERS):
            for i, n in enumerate(lens):
                F.scaled_dot_product_attention(q[i : i + 1], k[i : i + 1, :, :n], v[i : i + 1, :, :n], enable_gqa=True)

    return (
        f"{b} sequences of {lo}-{hi} tokens (mean {sum(lens) / b:.0f}, widest {width}): padded {ms(padded):.1f} "
        f"ms a round, each alone {ms(alone):.1f} ms"
    )


def main() -> None:
    random.seed(0)
    torch.manual_seed(0)
    with background.paused():
        for c in CASES:
            print(case(*c), flush=True)


if __name__ == "__main__":
    main()

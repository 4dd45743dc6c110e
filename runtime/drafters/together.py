"""Drafting for many sequences at once: their heads' forwards batched, one forward per drafting step for the batch.

A drafter that runs a head drafts as a generator (`Drafter.drafting`): it yields each head forward it needs (a
`HeadStep`: the rows to feed its own head cache, the mask over that cache, how many output rows to read out) and
receives the head's outputs and readout logits. `propose_all` runs every sequence's generator in lockstep: the
steps of one round's depth that share a head (the forks of one drafter share it) become one forward, their rows
packed end to end as the target's are (`attention.Packing`: the linear layers see each sequence's own rows;
attention reads each sequence's own cache, padded), then one readout over every row read. A sequence alone takes
the same path as `propose`, row for row. Wrappers (grafted lookup, the budget, the gate) draft with `yield from`
their inner drafter's generator.

The tree a sequence drafts depends on its own cache, context and random stream only: batching changes the float
rounding of a forward (another row count), never which rows a sequence reads.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass

import torch
from torch import nn

from headstart.heads.masks import additive_mask
from headstart.runtime.attention import Packing
from headstart.runtime.drafters.native_head import NativeHead
from headstart.runtime.tree import DraftTree


@dataclass
class HeadStep:
    """One head forward of one sequence: append `tokens`' pairs to `cache` (rows at `positions`, (n,), each seeing
    the keys `allowed` marks, (n, past + n)) and read out the last `read` outputs."""

    head: nn.Module | NativeHead
    readout: nn.Module
    embed: nn.Module
    cache: object  # the sequence's own head cache (a transformers DynamicCache, or a native_head.HeadCache)
    features: torch.Tensor  # (n, F) target features, or the head's own outputs
    tokens: list[int]
    positions: torch.Tensor  # (n,)
    allowed: torch.Tensor  # (n, past + n) bool
    read: int  # outputs read out, from the last

    def group(self) -> tuple[int, int, int]:
        """Steps of one group share a forward: the same head and readout, inputs of the same width."""
        return id(self.head), id(self.readout), self.features.shape[-1]


HeadOut = tuple[torch.Tensor, torch.Tensor | None]  # a step's outputs (n, H) and its read rows' logits (read, N)
Drafting = Generator[HeadStep, HeadOut, DraftTree]


def run_alone(step: HeadStep) -> HeadOut:
    """The head's outputs (n, H) and the logits (read, N) of the last `read` of them, for one sequence."""
    if isinstance(step.head, NativeHead):
        return run_together([step])[0]
    device = step.features.device
    embeds = step.embed(torch.tensor(step.tokens, device=device)).to(step.features.dtype)  # the head's dtype
    mask = additive_mask(step.allowed, step.features.dtype, device)
    out = step.head(step.features[None], embeds[None], step.positions[None].to(device), mask, cache=step.cache)[0]
    return out, step.readout(out[-step.read :]) if step.read else None


def run_together(steps: list[HeadStep]) -> list[HeadOut]:
    """`run_alone` for several sequences sharing a head, in one head forward and one readout."""
    first = steps[0]
    if isinstance(first.head, NativeHead):  # one native call, each sequence's rows in its own slot
        return _read_out(first.readout, first.head.run(steps), steps)
    if len(steps) == 1:
        return [run_alone(first)]
    device, dtype = first.features.device, first.features.dtype  # the head attends with grouped_sdpa (EagleDrafter)
    sizes = [len(s.tokens) for s in steps]
    q, kv = max(sizes), max(s.allowed.shape[1] for s in steps)
    allowed = torch.zeros(len(steps), q, kv, dtype=torch.bool)  # (r, q, kv) over each sequence's own cache
    allowed[:, :, 0] = True  # padding rows see a key: nothing reads them
    for i, s in enumerate(steps):
        allowed[i, : sizes[i], : s.allowed.shape[1]] = s.allowed
    features = torch.cat([s.features for s in steps])[None]  # (1, N, F)
    embeds = first.embed(torch.tensor([t for s in steps for t in s.tokens], device=device))[None].to(dtype)  # (1,N,H)
    positions = torch.cat([s.positions for s in steps])[None].to(device)  # (1, N)
    cache = _Stacked([s.cache for s in steps], sizes)
    mask = additive_mask(allowed, dtype, device)  # (r, 1, q, kv)
    out = first.head(features, embeds, positions, mask, cache=cache, packing=Packing.of(sizes, device))[0]
    return _read_out(first.readout, out.split(sizes), steps)


def _read_out(readout, outs: list[torch.Tensor], steps: list[HeadStep]) -> list[HeadOut]:
    """Each step's outputs (n_i, H) and the logits of its last `read`, every sequence's in one readout."""
    reads = [o[-s.read :] for o, s in zip(outs, steps, strict=True) if s.read]
    logits = iter(readout(torch.cat(reads)).split([s.read for s in steps if s.read]) if reads else ())
    return [(o, next(logits) if s.read else None) for o, s in zip(outs, steps, strict=True)]


class _Stacked:
    """The head caches of several sequences as one for a packed forward: each layer's new keys and values (1, G, N,
    D) go to their own sequence's cache; attention reads every sequence's cache, right-padded to the longest,
    (r, G, kv, D)."""

    def __init__(self, caches: list, sizes: list[int]) -> None:
        self.caches, self.sizes = caches, sizes

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values = [], []
        for cache, k, v in zip(self.caches, key.split(self.sizes, dim=2), value.split(self.sizes, dim=2), strict=True):
            k, v = cache.update(k, v, layer_idx)  # (1, G, past_i + n_i, D)
            keys.append(k[0])
            values.append(v[0])
        return _pad_stack(keys), _pad_stack(values)


def _pad_stack(rows: list[torch.Tensor]) -> torch.Tensor:
    """(G, L_i, D) each -> (r, G, max L_i, D), zeros after each one's own."""
    g, _, d = rows[0].shape
    out = rows[0].new_zeros(len(rows), g, max(x.shape[1] for x in rows), d)
    for i, x in enumerate(rows):
        out[i, :, : x.shape[1]] = x
    return out


def drive(drafting: Drafting) -> DraftTree:
    """Run one sequence's drafting to its tree, each head step alone."""
    try:
        step = next(drafting)
        while True:
            step = drafting.send(run_alone(step))
    except StopIteration as done:
        return done.value


@torch.inference_mode()
def propose_all(drafters: list, contexts: list[list[int]], sizes: list | None = None) -> list[DraftTree]:
    """Every sequence's tree (`Drafter.drafting` of each, at its size where `sizes` gives them, an `Offer` each:
    runtime/sizing's plan; None: each its own tree), their head forwards batched step by step."""
    trees: list[DraftTree | None] = [None] * len(drafters)
    running: dict[int, tuple[Drafting, HeadStep]] = {}

    def advance(i: int, drafting: Drafting, answer) -> None:
        try:
            step = next(drafting) if answer is None else drafting.send(answer)
            running[i] = (drafting, step)
        except StopIteration as done:
            trees[i] = done.value

    for i, (d, c) in enumerate(zip(drafters, contexts, strict=True)):
        advance(i, d.drafting(c, None if sizes is None else sizes[i]), None)
    while running:
        groups: dict[tuple[int, int, int], list[int]] = {}
        for i, (_, step) in running.items():
            groups.setdefault(step.group(), []).append(i)
        for members in groups.values():
            answers = run_together([running[i][1] for i in members])
            for i, answer in zip(members, answers, strict=True):
                advance(i, running.pop(i)[0], answer)
    return trees


@torch.inference_mode()
def measure_shared(drafter, prompt: list[int], features: torch.Tensor, k: int = 4, reps: int = 5) -> float:
    """The share of one sequence's drafting that `k` sequences drafting together pay once (their head forwards read
    the weights once): f = (k t1 - tk) / ((k - 1) t1) from t1, one fork's `propose_all`, and tk, k forks', each the
    fastest of `reps` after a warm-up, every fork started on `prompt` and its `features` (len - 1, F) (the trees
    drafted from the prompt's root, again and again). 0 for a drafter that drafts no head forward; within [0, 1]."""
    forks = [drafter.fork() for _ in range(k)]
    for fork in forks:
        fork.start(prompt, features)
    contexts = [list(prompt)] * k
    times = {1: [], k: []}
    for _ in range(reps + 1):  # the first round warms up (and enters the prompt's pairs)
        for n in times:
            t0 = time.perf_counter()
            propose_all(forks[:n], contexts[:n])
            times[n].append(time.perf_counter() - t0)
    one, many = min(times[1][1:]), min(times[k][1:])
    return min(max((k * one - many) / ((k - 1) * one), 0.0), 1.0)


def measure_catch_up(drafter, prompt: list[int], features: torch.Tensor, reps: int = 3) -> float:
    """ms a pair costs a head to catch up with (a plain stretch's pairs, entered in one forward before drafting):
    a fresh fork's first drafting on `prompt`, which enters its len - 1 pairs the same way, less its second, which
    drafts the same tree with nothing to enter (the fastest of `reps` of each after a warm-up), per pair. ~0 for a
    drafter without a head."""
    first, second = [], []
    with torch.inference_mode():
        for _ in range(reps + 1):  # the first fork warms up
            fork = drafter.fork()
            fork.start(prompt, features)
            t0 = time.perf_counter()
            fork.propose(prompt)
            t1 = time.perf_counter()
            fork.propose(prompt)
            first.append(t1 - t0)
            second.append(time.perf_counter() - t1)
    return max(1e3 * (min(first[1:]) - min(second[1:])) / max(len(prompt) - 1, 1), 0.0)

"""Trees sized by measured cost: the verify-cost curve of the loaded target, and the budget it makes best.

A round's speed is (expected tokens per round) / (round cost). The expected tokens of the best tree of B
nodes follow from the heads' measured per-rank accuracies (`tree.choose_tree_shape`); its cost is the
target's forward over B + 1 rows plus the drafting, which grows with the tree's depth. Both curves are
measured, not looked up by model name: `cost_curve` times the target's forward at several row counts on its
own device and dtype (a few seconds, once; cached per model, device, dtype, kernels and torch), and
`choose_budget` takes the budget with the most expected tokens per millisecond. A flat curve (a GPU at
batch 1) buys a larger tree than a steep one (a 2-core CPU in float32).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from headstart.runtime.target import Target
from headstart.runtime.tree import DraftTree, choose_tree_shape, expected_acceptance_length

ROWS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64)  # row counts timed (root + nodes)
PAST = 256  # cached tokens while timing (a typical chat prompt)


def _key(target: Target) -> str:
    """What the curve depends on: the model's config and weights' identity, device, dtype, kernels, torch."""
    config = target.model.config.to_json_string(use_diff=False)
    cpu = platform.processor() or platform.machine()
    device = torch.cuda.get_device_name(target.device) if target.device.type == "cuda" else cpu
    kernels = f"{target.packed.kind}, grouped attention {target.grouped}"
    parts = [config, str(target.dtype), device, kernels, torch.__version__, str(torch.get_num_threads())]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def measure_cost_curve(target: Target, reps: int = 5) -> dict[int, float]:
    """ms per target forward at each of ROWS (a chain of rows - 1 nodes over PAST cached tokens), the median of
    `reps` passes that interleave the row counts (so machine noise hits them alike), made non-decreasing (fewer
    rows never cost more than more rows: a dearer point is noise, lowered to the cheapest count above it).
    Leaves the cache empty."""
    gen = torch.Generator().manual_seed(0)
    vocab = target.model.config.vocab_size
    past = min(PAST, target.max_len - max(ROWS) - 1)
    prompt = torch.randint(0, vocab, (past + 1,), generator=gen).tolist()
    target.prefill(prompt[:-1], ())
    times: dict[int, list[float]] = {rows: [] for rows in ROWS}
    for _ in range(reps + 1):  # the first pass warms up
        for rows in ROWS:
            tree = DraftTree(prompt[1:rows], list(range(-1, rows - 2)))
            t0 = time.perf_counter()
            target.verify(prompt[-1], tree, ())
            if target.device.type == "cuda":
                torch.cuda.synchronize(target.device)
            times[rows].append(time.perf_counter() - t0)
            target.commit([])
    target.prefill([])
    curve, cheapest = {}, float("inf")
    for rows in sorted(times, reverse=True):
        cheapest = min(cheapest, 1e3 * statistics.median(times[rows][1:]))
        curve[rows] = cheapest
    return dict(sorted(curve.items()))


def cost_curve(target: Target, cache: Path | None) -> dict[int, float]:
    """The target's cost curve, read from `cache` (a folder) when it was measured before, else measured there."""
    path = cache / f"{_key(target)}.json" if cache is not None else None
    if path is not None and path.exists():
        return {int(k): v for k, v in json.loads(path.read_text()).items()}
    curve = measure_cost_curve(target)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(curve))
    return curve


def cost_at(curve: dict[int, float], rows: int) -> float:
    """ms at `rows`: linear between measured counts, the last slope past the end."""
    points = sorted(curve.items())
    for (r0, c0), (r1, c1) in itertools.pairwise(points):
        if rows <= r1:
            return c0 + (c1 - c0) * max(rows - r0, 0) / (r1 - r0)
    (r0, c0), (r1, c1) = points[-2], points[-1]
    return c1 + (c1 - c0) * (rows - r1) / (r1 - r0)


@dataclass(frozen=True)
class TreeChoice:
    budget: int  # draft nodes
    depth: int  # the deepest path of the best tree of that budget
    expected_tokens: float  # per round (expected acceptance length)
    round_ms: float  # forward over budget + 1 rows + drafting
    plain_ms: float  # a forward over one row

    @property
    def expected_speedup(self) -> float:
        return self.expected_tokens / self.round_ms * self.plain_ms


def choose_budget(
    curve: dict[int, float],
    rank_accuracy: list[list[float]],
    draft_ms_per_depth: float,
    max_budget: int = 63,
) -> TreeChoice:
    """The budget B with the most expected tokens per ms: tokens = the expected acceptance length of the best
    tree of B nodes under `rank_accuracy` (p that head/depth d's rank-r guess is right); ms = the forward over
    B + 1 rows (`curve`) + `draft_ms_per_depth` times that tree's depth."""
    best = None
    for budget in range(1, max_budget + 1):
        shape = choose_tree_shape(rank_accuracy, budget)
        if len(shape) < budget:  # no more nodes with a chance of acceptance
            break
        depth = max(len(path) for path in shape)
        tokens = expected_acceptance_length(rank_accuracy, shape)
        ms = cost_at(curve, budget + 1) + draft_ms_per_depth * depth
        choice = TreeChoice(budget, depth, tokens, ms, cost_at(curve, 1))
        if best is None or tokens / ms > best.expected_tokens / best.round_ms:
            best = choice
    if best is None:
        raise ValueError("no tree: the heads' rank accuracies are all zero")
    return best

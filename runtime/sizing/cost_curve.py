"""Trees sized by measured cost: the verify-cost curve of the loaded target, and the budget it makes best.

A round's speed is (expected tokens per round) / (round cost). The expected tokens of the best tree of B
nodes follow from the heads' measured per-rank accuracies (`tree.choose_tree_shape`); its cost is the
target's forward over B + 1 rows plus the drafting, which grows with the tree's depth. Both curves are
measured, not looked up by model name: `cost_curve` times the target's forward at several row counts on its
own device and dtype (a few seconds, once; cached per model, device, dtype, kernels and torch), and
`choose_budget` takes the budget with the most expected tokens per millisecond. A flat curve (a GPU at
batch 1) buys a larger tree than a steep one (a 2-core CPU in float32).

The accuracies are the heads' training metrics: teacher-forced, greedy, on the training distribution.
Live traffic accepts what it accepts (another domain, a sampled tree at T > 0), so `LiveSizer` keeps
the choice up to date from the acceptance the drafter sees: every `every` rounds it fits one factor c on
the accuracies (depth d's paths scale as c^d) that makes the expected acceptance of the tree in use equal
the one seen, and chooses again. Greedy and sampled trees keep factors of their own.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from headstart.runtime import native
from headstart.runtime.kernels import FP32_KINDS, fp32_kinds
from headstart.runtime.paths import cache_dir
from headstart.runtime.target import Target
from headstart.runtime.tree import (
    DraftTree,
    Shape,
    TreeChoice,
    choose_tree_shape,
    expected_acceptance_length,
    scale_accuracy,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel


ROWS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64)  # row counts timed (root + nodes)
PAST = 256  # cached tokens while timing (a typical chat prompt)
FORWARD_VERSION = 5  # raise when the target's forward changes its costs, so that cached curves are measured again
TREE_ROWS = tuple(r for r in ROWS if r <= 16)  # the row counts `choose_kernels` compares the kernels over


def cpu_name() -> str:
    """The CPU's model and the vector ISAs kernels choose by (`platform.processor()` is often empty on Linux, and a
    home folder, with its cached curves, may move to another kind of CPU between sessions)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    fields = dict(line.split(":", 1) for line in reversed(lines) if ":" in line)  # the first CPU's values
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    isa = sorted(f for f in fields.get("flags", "").split() if f.startswith(("avx", "amx")))
    return " ".join([fields.get("model name") or platform.machine(), *isa])


def _key(target: Target, kind: str | None = None) -> str:
    """What the curve depends on: the model's config and weights' identity, device, dtype, kernels (`kind`
    None: those packed now; the native ones' build), torch, the version of our forward."""
    config = target.model.config.to_json_string(use_diff=False)
    device = torch.cuda.get_device_name(target.device) if target.device.type == "cuda" else cpu_name()
    kind = target.packed.kind if kind is None else kind
    kernels = f"{kind}, grouped attention {target.grouped}"
    if kind == "native":  # its costs change with its source
        kernels += f", native {native.build_id()}"
    parts = [config, str(target.dtype), device, kernels, torch.__version__, str(torch.get_num_threads())]
    parts.append(f"forward v{FORWARD_VERSION}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def measure_cost_curve(target: Target, reps: int = 5, rows_timed: tuple[int, ...] = ROWS) -> dict[int, float]:
    """ms per target forward at each of `rows_timed` (a chain of rows - 1 nodes over PAST cached tokens), the median of
    `reps` passes that interleave the row counts (so machine noise hits them alike), made non-decreasing (fewer
    rows never cost more than more rows: a dearer point is noise, lowered to the cheapest count above it).
    Leaves the cache empty."""
    gen = torch.Generator().manual_seed(0)
    vocab = target.model.config.vocab_size
    past = min(PAST, target.max_len - max(rows_timed) - 1)
    prompt = torch.randint(0, vocab, (past + 1,), generator=gen).tolist()
    target.prefill(prompt[:-1], ())
    times: dict[int, list[float]] = {rows: [] for rows in rows_timed}
    for _ in range(reps + 1):  # the first pass warms up
        for rows in rows_timed:
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


def _cached(path: Path | None, measure):
    """The JSON object stored at `path`, else `measure()`, stored there (when `path` is not None)."""
    if path is not None and path.exists():
        return json.loads(path.read_text())
    value = measure()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))
    return value


def cost_curve(target: Target, cache: Path | None) -> dict[int, float]:
    """The target's cost curve, read from `cache` (a folder) when it was measured before, else measured there."""
    path = cache / f"{_key(target)}.json" if cache is not None else None
    return {int(k): v for k, v in _cached(path, lambda: measure_cost_curve(target)).items()}


def choose_kernels(target: Target, cache: Path | None) -> str:
    """A float32 target on a CPU: pack it with whichever of `kernels.FP32_KINDS` makes its forward over 1-16 rows
    (the trees' range; the sum of ms at the counts of ROWS up to 16) cheaper on this machine, timed on the whole
    target once, then read from `cache` (a folder). MKL's packed GEMM wins on one CPU, oneDNN's on another
    (`runtime/kernels.py`). Other targets keep their kernels, the native ones included (they alone give a row the
    same values at any row count: runtime/native.py). Returns the kind in use."""
    if target.dtype != torch.float32 or target.packed.kind not in FP32_KINDS:
        return target.packed.kind
    path = cache / f"kernels-{_key(target, 'fp32')}.json" if cache is not None else None
    costs = _cached(path, lambda: _time_fp32_kernels(target))
    target.use_kernels(min(costs, key=costs.get))
    return target.packed.kind


def calibrated_target(model: PreTrainedModel, fast: bool | None = None, slots: int = 1) -> Target:
    """`Target(model, fast, slots)` on the kernels measured cheapest here (`choose_kernels`, the choice cached under
    `~/.cache/headstart/costs`): the engine's target, and the one the measuring commands (`python -m
    headstart.runtime.sizing.cost_curve`, `... .batch_cost`) time, so they print the kernels the engine runs."""
    target = Target(model, fast=fast, slots=slots)
    choose_kernels(target, cache_dir() / "costs")
    return target


def _time_fp32_kernels(target: Target) -> dict[str, float]:
    """ms summed over the TREE_ROWS forwards under each of the float32 kinds this machine runs (`fp32_kinds`; the
    median of 3 turns), said on stderr (it takes seconds)."""
    t0 = time.perf_counter()
    print("headstart: timing the float32 kernels on this CPU (once; cached)", file=sys.stderr, flush=True)
    times: dict[str, list[float]] = {kind: [] for kind in fp32_kinds()}
    for _ in range(3):  # the kinds in turn, three times: a machine that drifts while one is timed moves both
        for kind in times:
            target.use_kernels(kind)
            times[kind].append(sum(measure_cost_curve(target, reps=1, rows_timed=TREE_ROWS).values()))
    costs = {kind: statistics.median(t) for kind, t in times.items()}
    said = ", ".join(f"{kind} {ms:.0f} ms" for kind, ms in costs.items())
    print(
        f"headstart: {len(TREE_ROWS)} forwards of 1-16 rows: {said} -> {min(costs, key=costs.get)} "
        f"({time.perf_counter() - t0:.1f} s)",
        file=sys.stderr,
    )
    return costs


def cost_at(curve: dict[int, float], rows: int) -> float:
    """ms at `rows`: linear between measured counts, the last slope past the end."""
    points = sorted(curve.items())
    for (r0, c0), (r1, c1) in itertools.pairwise(points):
        if rows <= r1:
            return c0 + (c1 - c0) * max(rows - r0, 0) / (r1 - r0)
    (r0, c0), (r1, c1) = points[-2], points[-1]
    return c1 + (c1 - c0) * (rows - r1) / (r1 - r0)


def choose_budget(
    curve: dict[int, float],
    rank_accuracy: list[list[float]],
    draft_ms_per_depth: float,
    max_budget: int = 63,
) -> TreeChoice:
    """The budget B with the most expected tokens per ms: tokens = the expected acceptance length of the best
    tree of B nodes under `rank_accuracy` (p that head/depth d's rank-r guess is right); ms = the forward over
    B + 1 rows (`curve`) + `draft_ms_per_depth` times that tree's depth."""
    best, tokens, depth = None, 1.0, 0
    full = choose_tree_shape(rank_accuracy, max_budget)  # best first: the best tree of B nodes is its first B
    for budget, path in enumerate(full, start=1):  # (one tree, not one a budget: the live sizer refits under load)
        tokens += math.prod(rank_accuracy[d][rank] for d, rank in enumerate(path))  # `expected_acceptance_length`
        depth = max(depth, len(path))
        ms = cost_at(curve, budget + 1) + draft_ms_per_depth * depth
        choice = TreeChoice(budget, depth, tokens, ms, cost_at(curve, 1), tuple(full[:budget]))
        if best is None or tokens / ms > best.expected_tokens / best.round_ms:
            best = choice
    if best is None:
        raise ValueError("no tree: the heads' rank accuracies are all zero")
    return best


def fit_factor(
    rank_accuracy: list[list[float]],
    shape: Shape | dict[Shape, int],
    observed: float,
    low: float = 1 / 16,
    high: float = 8.0,
) -> float:
    """The factor c in [low, high] for which `shape`'s expected acceptance length under
    `scale_accuracy(rank_accuracy, c)` is `observed` (tokens per round, the target's own token included), by
    bisection: it grows with c, so a length out of reach gives the nearer bound. `shape` may be the rounds' shapes
    with how many rounds drafted each: their mean expected length is fitted."""
    shapes = shape if isinstance(shape, dict) else {shape: 1}
    rounds = sum(shapes.values())
    for _ in range(40):
        mid = (low + high) / 2
        accuracy = scale_accuracy(rank_accuracy, mid)
        expected = sum(n * expected_acceptance_length(accuracy, list(s)) for s, n in shapes.items()) / rounds
        if expected < observed:
            low = mid
        else:
            high = mid
    return (low + high) / 2


class LiveSizer:
    """A drafter's tree size, kept the best for the acceptance seen on live traffic.

    Starts from the heads' training metrics (`rank_accuracy`); every `every` rounds of a kind (greedy or
    sampled), it fits the factor that makes the expected acceptance of that kind's tree equal the mean seen
    (`fit_factor`; the tree modelled by the best static shape of its budget: a greedy dynamic tree's real
    shape varies by round, and the factor absorbs what that gains), moves its factor halfway there in log
    space (one window never overrules all the evidence before it), and chooses the budget again on the
    scaled accuracies (`choose_budget`).
    One sizer may serve every drafter of a spec on an engine: they see the same traffic.
    """

    def __init__(
        self,
        curve: dict[int, float],
        rank_accuracy: list[list[float]],
        draft_ms_per_depth: float,
        every: int = 64,
        shared: float = 0.0,
        pair_ms: float = 0.0,
    ) -> None:
        """`shared`: the share of a sequence's drafting that sequences drafting together pay once (measured:
        `together.measure_shared`; the load budget's offers carry it); `pair_ms`: what a pair costs the head to
        catch up with before drafting (`together.measure_catch_up`; the budget charges a request's backlog)."""
        self.curve, self.rank_accuracy, self.draft_ms, self.every = curve, rank_accuracy, draft_ms_per_depth, every
        self.shared, self.pair_ms = shared, pair_ms
        self.curves: dict[tuple, object] = {}  # the drafters' offers by factor (`EagleDrafter.curve`)
        first = choose_budget(curve, rank_accuracy, draft_ms_per_depth)
        self.factor = {False: 1.0, True: 1.0}  # sampled? -> factor on the accuracies
        self.choice = {False: first, True: first}
        self._seen: dict[bool, list] = {False: [{}, 0], True: [{}, 0]}  # sampled? -> [rounds by shape, tokens accepted]

    def record(self, sampled: bool, accepted: int, shape: Shape | None = None) -> TreeChoice | None:
        """One round of a `sampled` (T > 0) or greedy tree whose heads' nodes gave `accepted` tokens; `shape`: the
        static shape of the tree drafted when it was not this sizer's choice (the load budget sizes trees round by
        round: fitted against the choice, a window of 1-node trees read as a 6-node tree accepting little, and the
        factor, the offers and so the trees fell round after round). The new choice of that kind when this round
        ends a window and the tree changes, else None."""
        seen = self._seen[sampled]
        drafted = self.choice[sampled].shape if shape is None else tuple(shape)
        seen[0][drafted] = seen[0].get(drafted, 0) + 1
        seen[1] += accepted
        rounds = sum(seen[0].values())
        if rounds < self.every:
            return None
        shapes, tokens = seen
        self._seen[sampled] = [{}, 0]
        old = self.choice[sampled]
        fitted = fit_factor(self.rank_accuracy, shapes, 1 + tokens / rounds)
        self.factor[sampled] = (self.factor[sampled] * fitted) ** 0.5
        new = choose_budget(self.curve, scale_accuracy(self.rank_accuracy, self.factor[sampled]), self.draft_ms)
        self.choice[sampled] = new
        return new if (new.budget, new.depth, new.shape) != (old.budget, old.depth, old.shape) else None


def main(argv: list[str] | None = None) -> int:
    """`python -m headstart.runtime.sizing.cost_curve [--model M] [--dtype D]`: the target's cost curve measured now
    (not read from the cache), printed as ms and as a multiple of one row: what "several positions cost about as much
    as one" means on this machine. Background jobs are paused while it measures."""
    import argparse

    from headstart.runtime import background
    from headstart.runtime.models import DEFAULT_MODEL, DTYPES, load_model

    p = argparse.ArgumentParser(description="the target's forward cost over 1-64 new rows, measured on this machine")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    args = p.parse_args(argv)
    model, _ = load_model(args.model, args.dtype)
    with background.paused():
        target = calibrated_target(model)
        curve = measure_cost_curve(target)
    print(
        f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}, {args.model} {args.dtype}, "
        f"kernels {target.packed.kind}, {PAST} cached tokens; ms per forward (x one row):"
    )
    print(" ".join(f"{rows}: {ms:.1f} ({ms / curve[1]:.2f}x)" for rows, ms in curve.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

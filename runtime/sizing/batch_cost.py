"""The cost of one batched verify forward, as a model measured on this machine: what the budget spends
(`runtime/sizing/planner.py`).

A forward over B sequences at width w (draft nodes, the widest tree's) feeds R = B * (w + 1) rows when they are
padded to the widest tree, and each row attends the keys of its own sequence, about K = the longest cached
sequence:

    ms = rows(R) + d * B + e * B * (K - PAST0) + c * R * (K - PAST0)

rows(R): the rows' share of the forward, linear between the row counts measured (on a CPU far from linear in R:
16 rows cost ~1.5x one row in bfloat16, the weights read once for all of them); d: a sequence's own share (its
mask, its attention call); e: reading one more cached key's keys and values than PAST0, once a sequence whatever
its rows; c: one row's products with that key. With c alone the cache's reading was charged by the row (float32 on
a 2-core Xeon: +4.2 ms for 4 plain sequences at 320 cached keys against 64, +3.1 at 7 nodes each): the fit then
under-charged plain rounds and over-charged trees, and the served budget gave 4 sequences 1-node trees (1.26x plain
in-process where a fixed 3-node tree made 1.50x). `measure_batch_cost` times
the target's own forward over a grid of B, w and cached lengths (every sequence at the same width, so packed and
padded rows are the same rows), fits the four by least squares (no term negative) and keeps the model's worst
relative error over the grid beside them, and at each batch size measured (the budget's margin at that size), so
a machine the model does not describe shows.

`Target.verify_batch` packs the rows end to end on the fast path (`attention.Packing`): the linear layers see
B + N rows for N draft nodes in all, and only attention reads them padded. Then (`packed`) the rows' share is
rows(B) plus N times the curve's slope from B rows to B * (w + 1) (exact at no node and at every sequence at the
full width; where the curve is straight, as here beyond ~4 rows, exact between), the attention term stays padded:

    ms = rows(B) + N * (rows(B (w + 1)) - rows(B)) / (B w) + d * B + (e * B + c * B (w + 1)) * (K - PAST0)

Cached per model, device, dtype, kernels and torch, as the batch-1 curve is (`cost_curve._key`).
"""

from __future__ import annotations

import itertools
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from headstart.runtime.sizing.cost_curve import _cached, _key, cost_at
from headstart.runtime.target import Target
from headstart.runtime.tree import DraftTree

SEQUENCES = (1, 2, 4, 8, 16)  # batch sizes timed (those that fit the target's slots)
WIDTHS = (0, 1, 3, 7, 15)  # draft nodes per sequence timed
PASTS = (64, 320)  # cached tokens per sequence timed; the first is PAST0
MAX_ROWS = 128  # grid points feeding more rows are skipped (they would take most of the time)
MODEL_VERSION = 6  # raise when the model or the grid changes, so that cached fits are measured again


@dataclass(frozen=True)
class BatchCost:
    """ms of one batched verify forward: rows(R) + d * B + (e * B + c * R) * (K - PASTS[0]) (module docstring)."""

    rows: dict[int, float]  # R -> ms of the rows' share of a forward over R rows (two points at least)
    c: float  # ms per row and cached key beyond PASTS[0]
    d: float = 0.0  # ms per sequence fed (its mask, its own attention call's share)
    worst_error: float = 0.0  # the model's largest |model - measured| / measured over the grid it was fitted on
    errors: dict[int, float] = field(default_factory=dict)  # sequences -> the largest error at that many
    packed: bool = False  # the target packs tree rows end to end: a node costs its own row only (module docstring)
    e: float = 0.0  # ms per sequence and cached key beyond PASTS[0] (its keys and values read, whatever its rows)

    def __post_init__(self) -> None:
        # ints sorted (a cached file's keys are strings: sorted as such, 16 came before 2 and `least_node_ms` took
        # slopes between rows out of order)
        object.__setattr__(self, "rows", dict(sorted((int(r), float(ms)) for r, ms in self.rows.items())))
        object.__setattr__(self, "errors", dict(sorted((int(s), float(e)) for s, e in self.errors.items())))
        object.__setattr__(self, "_row_ms", {})  # R -> cost_at(rows, R), as asked (a plan asks ~60 a round)

    def rows_ms(self, rows: int) -> float:
        """The rows' share of a forward over `rows` rows (`cost_at` of the row curve, kept once asked)."""
        ms = self._row_ms.get(rows)
        if ms is None:
            ms = self._row_ms[rows] = cost_at(self.rows, rows)
        return ms

    def error(self, sequences: int) -> float:
        """The model's largest relative error at `sequences` sequences: at the fewest measured that many or more
        (the largest measured beyond them), `worst_error` where no count was measured apart."""
        if not self.errors:
            return self.worst_error
        return next((e for s, e in self.errors.items() if s >= sequences), self.errors[max(self.errors)])

    @classmethod
    def linear(cls, a: float, b: float, c: float) -> BatchCost:
        """a + b * R + c * R * (K - PASTS[0]): a straight row curve (tests, synthetic machines)."""
        return cls({1: a + b, 2: a + 2 * b}, c)

    def forward_ms(self, sequences: int, width: int, longest: int, nodes: int | None = None) -> float:
        """`sequences` sequences at `width` draft nodes at most, `nodes` in all (None: `width` each), the longest
        holding `longest` cached tokens."""
        nodes = sequences * width if nodes is None else nodes
        return self.base_ms(sequences, width, longest) + self.node_ms(sequences, width) * nodes

    def base_ms(self, sequences: int, width: int, longest: int) -> float:
        """The forward at this width before its draft nodes' own rows: padded, all of it (`node_ms` is 0)."""
        full = sequences * (width + 1)
        attention = self.d * sequences + (self.e * sequences + self.c * full) * max(longest - PASTS[0], 0)
        return self.rows_ms(sequences if self.packed else full) + attention

    def node_ms(self, sequences: int, width: int) -> float:
        """What a draft node's own row adds at this width: packed, the row curve's slope from `sequences` rows to the
        full width's; padded, 0 (the width's rows are paid whatever the sequences draft)."""
        if not self.packed or not width:
            return 0.0
        return (self.rows_ms(sequences * (width + 1)) - self.rows_ms(sequences)) / (sequences * width)

    def least_node_ms(self, sequences: int) -> float:
        """What a node costs at least, at any width (`node_ms`: the row curve's average slope from `sequences` rows
        on, so never below its least slope there; the last slope runs on past the end); padded, 0."""
        if not self.packed:
            return 0.0
        points = list(self.rows.items())
        slopes = [(c1 - c0) / (r1 - r0) for (r0, c0), (r1, c1) in itertools.pairwise(points) if r1 > sequences]
        (r0, c0), (r1, c1) = points[-2], points[-1]
        return min(slopes or [(c1 - c0) / (r1 - r0)])


def fit_batch_cost(points: list[tuple[int, int, int, float]]) -> BatchCost:
    """The model from (sequences, width, cached tokens, ms) points, by least squares with no term negative: rows(R)
    linear between the row counts measured (one unknown per count, hat functions), d per sequence, e per sequence and
    key, c per row and key beyond the shortest past; rows(R) then made non-decreasing (a dearer point of fewer rows is
    noise)."""
    short = min(k for *_, k, _ in points)
    knots = sorted({s * (w + 1) for s, w, _, _ in points})
    if len(knots) == 1:
        knots.append(knots[0] + 1)

    def basis(s: int, w: int, k: int) -> list[float]:
        r, hat = s * (w + 1), [0.0] * len(knots)
        for i, (r0, r1) in enumerate(itertools.pairwise(knots)):
            if r0 <= r <= r1:
                hat[i], hat[i + 1] = (r1 - r) / (r1 - r0), (r - r0) / (r1 - r0)
                break
        return [*hat, float(s), float(s * (k - short)), float(r * (k - short))]

    x = torch.tensor([basis(s, w, k) for s, w, k, _ in points], dtype=torch.float64)  # (P, knots + 3)
    y = torch.tensor([ms for *_, ms in points], dtype=torch.float64)  # (P,)
    keep = list(range(x.shape[1]))
    while True:  # drop the most negative term and refit without it, until none is negative
        coef = torch.linalg.lstsq(x[:, keep], y[:, None]).solution[:, 0]
        if (coef >= 0).all():
            break
        keep.pop(int(coef.argmin()))
    full = torch.zeros(x.shape[1], dtype=torch.float64)
    full[keep] = coef
    cheapest, rows = float("inf"), {}
    for r, ms in sorted(zip(knots, full[: len(knots)].tolist(), strict=True), reverse=True):
        cheapest = min(cheapest, ms)
        rows[r] = cheapest
    d, e, c = (float(v) for v in full[-3:])
    model = BatchCost(rows, c, d, e=e)
    errors: dict[int, float] = {}
    for s, w, k, ms in points:
        errors[s] = max(errors.get(s, 0.0), abs(model.forward_ms(s, w, k - short + PASTS[0]) - ms) / ms)
    return replace(model, worst_error=max(errors.values()), errors=errors)


@torch.inference_mode()
def measure_batch_cost(
    target: Target, reps: int = 5, record: list[tuple[int, int, int, float]] | None = None
) -> BatchCost:
    """Time `target.verify_batch` over the grid (SEQUENCES up to the target's slots x WIDTHS x PASTS, at most
    MAX_ROWS rows; the fastest of `reps` after a warm-up, points interleaved: whatever else runs on the machine
    only ever adds time) and fit the model. Slot 0 is
    prefilled with random tokens and copied to the others; the cache is empty afterwards. `record`: a list the
    measured (sequences, width, cached tokens, ms) points are appended to."""
    gen = torch.Generator().manual_seed(0)
    vocab = target.model.config.vocab_size
    longest = min(max(PASTS), target.max_len - max(WIDTHS) - 2)
    prompt = torch.randint(0, vocab, (longest + 1,), generator=gen).tolist()
    batches = [s for s in SEQUENCES if s <= target.slots]
    target.prefill(prompt[:-1], ())
    if batches[-1] > 1:
        target.cache.copy(0, slice(1, batches[-1]), longest)
    grid = [(s, w, min(k, longest)) for s, w, k in itertools.product(batches, WIDTHS, PASTS) if s * (w + 1) <= MAX_ROWS]
    times: dict[tuple[int, int, int], list[float]] = {point: [] for point in grid}
    for _ in range(reps + 1):  # the first pass warms up
        for s, w, k in grid:
            target.lengths[:s] = [k] * s
            tree = DraftTree(prompt[1 : w + 1], list(range(-1, w - 1)))
            t0 = time.perf_counter()
            target.verify_batch([prompt[-1]] * s, [tree] * s, ())
            if target.device.type == "cuda":
                torch.cuda.synchronize(target.device)
            times[(s, w, k)].append(1e3 * (time.perf_counter() - t0))
            for slot in range(s):
                target.commit([], slot)
    target.lengths[:] = [0] * target.slots
    target.cache.release()
    points = [(s, w, k, min(t[1:])) for (s, w, k), t in times.items()]
    if record is not None:
        record.extend(points)
    return replace(fit_batch_cost(points), packed=target.grouped)


def batch_cost(target: Target, cache: Path | None) -> BatchCost:
    """The target's batched cost model, read from `cache` (a folder) when fitted before, else measured there (with
    background jobs paused: a fit measured beside a training run would be kept)."""
    from headstart.runtime import background

    path = cache / f"batch-{_key(target)}-v{MODEL_VERSION}-{min(target.slots, max(SEQUENCES))}.json" if cache else None

    def measure() -> dict:
        print("headstart: measuring the batched forward's cost on this machine (once; cached)", file=sys.stderr)
        with background.paused():
            return asdict(measure_batch_cost(target))

    return BatchCost(**_cached(path, measure))  # JSON keys are strings: __post_init__ makes them ints again


def main(argv: list[str] | None = None) -> int:
    """`python -m headstart.runtime.sizing.batch_cost [--model M] [--dtype D]`: the batched cost model measured now
    (not read from the cache), each grid point beside what the fit says. Background jobs are paused while it
    measures."""
    import argparse

    from headstart.runtime import background
    from headstart.runtime.models import DEFAULT_MODEL, DTYPES, load_model
    from headstart.runtime.sizing.cost_curve import calibrated_target, cpu_name

    p = argparse.ArgumentParser(description="the batched verify forward's cost model, measured on this machine")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    args = p.parse_args(argv)
    model, _ = load_model(args.model, args.dtype)
    points: list[tuple[int, int, int, float]] = []
    with background.paused():
        target = calibrated_target(model, slots=max(SEQUENCES))
        t0 = time.perf_counter()
        cost = measure_batch_cost(target, record=points)
        seconds = time.perf_counter() - t0
    print(
        f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}, {args.model} {args.dtype}, "
        f"kernels {target.packed.kind} ({seconds:.0f} s): ms at R rows "
        + ", ".join(f"{r}: {ms:.1f}" for r, ms in cost.rows.items())
        + f"; + {cost.d:.2f} * sequences + ({cost.e:.6f} * sequences + {cost.c:.6f} * R) * (cached keys - {PASTS[0]}); "
        f"worst error {cost.worst_error:.0%} ("
        + ", ".join(f"{e:.0%} at {s}" for s, e in cost.errors.items())
        + " sequences)"
    )
    print("| sequences | draft nodes each | cached tokens | measured ms | model ms |\n|---|---|---|---|---|")
    for s, w, k, ms in points:
        print(f"| {s} | {w} | {k} | {ms:.1f} | {cost.forward_ms(s, w, k):.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A drafting step of the shipped EAGLE and EAGLE-3 heads, native draft layers against transformers' layer, in one run.

    .venv/bin/python tests/engines/head_ab.py [--dtype bfloat16] [--rows 1,4,8] [--rounds 7] [--reps 20]

Each head's drafter (`Engine.make_drafter`, the head in its default dtype) enters a held-out prompt's pairs (random
features: the timing does not depend on them), then a drafting step of R rows (siblings after the prompt's entries)
is timed with its readout, ms, on the native
draft layers (runtime/drafters/native_head.py) and on the same head module through transformers' layer and a
DynamicCache (the path before them), the two alternating round by round; medians over rounds of the fastest of
`reps` steps each. Registered background jobs are paused.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_bench import write_heldout

from headstart.runtime.drafters.together import HeadStep, run_alone


def main() -> None:
    from transformers import DynamicCache

    from headstart.runtime.background import paused
    from headstart.runtime.drafters.eagle import EagleDrafter
    from headstart.runtime.drafters.native_head import NativeHead
    from headstart.runtime.engine import Engine

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--rows", default="1,4,8")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    engine = Engine.load(dtype=args.dtype)
    prompts = Path("/tmp") / "head_ab_prompts.jsonl"
    write_heldout(prompts, 1)
    ids = engine.encode(json.loads(prompts.read_text())["turns"][0])
    print(f"{args.dtype} target, a step of R rows after {len(ids)} prompt entries, ms with readout (median of rounds)")
    print("| head | rows | native | transformers' layer | speedup |")
    print("| --- | ---: | ---: | ---: | ---: |")
    torch.set_grad_enabled(False)
    with paused():
        for kind in ("eagle", "eagle3"):
            drafter = engine.make_drafter(kind)
            assert isinstance(drafter, EagleDrafter) and isinstance(drafter.head, NativeHead), kind
            paths = {"native": (drafter.head, drafter.head.new_cache()), "module": (drafter.head.head, DynamicCache())}
            hidden = engine.target.model.config.hidden_size
            width = drafter.head.head.fc.in_features if kind == "eagle3" else hidden  # the target features it reads
            g = torch.Generator().manual_seed(0)
            entries = torch.randn(len(ids) - 1, width, generator=g).to(drafter.dtype)  # the prompt's pairs, entered
            for head, cache in paths.values():
                run_alone(_step(drafter, head, cache, entries, ids[1:], 0))
            past = len(ids) - 1
            for rows in (int(r) for r in args.rows.split(",")):
                times = {"native": [], "module": []}
                feats = torch.randn(rows, hidden, generator=g).to(drafter.dtype)  # the head's own outputs
                for r in range(args.rounds):
                    for path in ("native", "module") if r % 2 == 0 else ("module", "native"):
                        head, cache = paths[path]
                        best = float("inf")
                        for _ in range(args.reps):
                            step = _step(drafter, head, cache, feats, [5] * rows, past)
                            t0 = time.perf_counter()
                            run_alone(step)
                            best = min(best, time.perf_counter() - t0)
                            cache.crop(-rows)
                        times[path].append(1e3 * best)
                n, m = statistics.median(times["native"]), statistics.median(times["module"])
                print(f"| {kind} | {rows} | {n:.2f} | {m:.2f} | {m / n:.2f}x |")


def _step(drafter, head, cache, features: torch.Tensor, tokens: list[int], past: int) -> HeadStep:
    """A step of len(tokens) rows after `past` entries: the first step causal, a later one's rows siblings (each sees
    the entries and itself)."""
    n = len(tokens)
    if past:
        allowed = torch.cat([torch.ones(n, past, dtype=torch.bool), torch.eye(n, dtype=torch.bool)], dim=1)
        positions = torch.full((n,), past)
    else:
        allowed, positions = torch.ones(n, n, dtype=torch.bool).tril(), torch.arange(n)
    return HeadStep(head, drafter.readout, drafter.embed, cache, features, tokens, positions, allowed, read=n)


if __name__ == "__main__":
    main()

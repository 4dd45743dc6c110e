"""The target's forward three ways, ms by rows: transformers' own and the fused stack's (runtime/fused.py) over the
stock packed kernels, and the native forward (runtime/native.py).

    .venv/bin/python tests/engines/forward_ab.py [--dtype bfloat16] [--kernels onednn] [--rounds 3]

The embedded model loaded three times (one Target each; the first two prepacked alike), 256 cached tokens, a chain
of n - 1 draft nodes behind the root (n rows) verified and dropped again; the three paths alternate `--rounds`
times, each timing 15 forwards a round after 3 warm-up ones; the figure is the median round's median. Background
jobs are paused.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

ROWS = (1, 2, 4, 8, 16, 32)


def main() -> None:
    from headstart.runtime.background import paused
    from headstart.runtime.kernels import prepack_linears
    from headstart.runtime.models import load_model
    from headstart.runtime.target import Target
    from headstart.runtime.tree import DraftTree

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--kernels", default=None, help="float32's stock packing (mkl or onednn; default: the Target's own)")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    targets = {}
    for path in ("generic", "fused", "native"):
        os.environ["HEADSTART_NATIVE"] = "1" if path == "native" else "0"
        model, _ = load_model(dtype=args.dtype)
        target = Target(model)
        if args.kernels and path != "native":
            target.use_kernels(args.kernels)
        if path == "generic":  # transformers' forward, every linear layer packed as the fused stack's are
            target.fused = None
            prepack_linears(model, target.packed.kind if target.packed.kind != "none" else None)
        target.prefill(list(range(100, 356)), layers=())
        targets[path] = target

    def step(target: Target, n: int) -> float:
        t0 = time.perf_counter()
        target.verify(5, DraftTree(list(range(1000, 999 + n)), list(range(-1, n - 2))), layers=())
        target.commit([])
        return time.perf_counter() - t0

    ms: dict[tuple[str, int], list[float]] = {}
    with paused():
        for n in ROWS:
            for _ in range(args.rounds):
                for path, target in targets.items():
                    for _ in range(3):
                        step(target, n)
                    ms.setdefault((path, n), []).append(1e3 * statistics.median(step(target, n) for _ in range(15)))
    assert targets["native"].fused.native_layers() is not None, "the native forward did not build"
    print(f"{args.dtype} ({targets['fused'].packed.kind} kernels), ms per forward, 256 cached tokens")
    print("| rows | generic | fused | native | generic / native |\n| ---: | ---: | ---: | ---: | ---: |")
    for n in ROWS:
        g, f, c = (statistics.median(ms[(path, n)]) for path in ("generic", "fused", "native"))
        print(f"| {n} | {g:.1f} | {f:.1f} | {c:.1f} | {g / c:.2f} |")


if __name__ == "__main__":
    main()

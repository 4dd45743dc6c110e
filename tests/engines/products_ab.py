"""The native products of two revisions of runtime/csrc/forward.cpp side by side: ms for one pass over a decoder
stack's weights (SmolLM2-135M's shapes: q/k/v, o, gate/up, down, 30 layers, random values, 212 MB in bf16) by
rows, each build packing its own copy, the two alternating 7 times a row count (the first dropped), medians.

    .venv/bin/python tests/engines/products_ab.py --base REV [--head REV] [--dtype bfloat16|float32] [--rows 1,2,4]

REV: a git revision (`git show REV:runtime/csrc/forward.cpp`); --head defaults to the working tree's file. Both are
compiled as runtime/native.py compiles its library, into a temporary folder. Registered background jobs are paused.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30  # (out, in) of a layer's four products
ROWS = (1, 2, 4, 8, 16, 32, 64)


def build(rev: str | None, tmp: Path, name: str) -> ctypes.CDLL:
    from headstart.runtime import native

    src = tmp / f"{name}.cpp"
    if rev is None:
        src.write_text(native.SOURCE.read_text())
    else:
        src.write_text(
            subprocess.run(
                ["git", "-C", str(ROOT), "show", f"{rev}:runtime/csrc/forward.cpp"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )
    out = tmp / f"{name}.so"
    if error := native.compile_library(src, out):
        raise SystemExit(f"{rev or 'the working tree'}: {error}")
    return ctypes.CDLL(str(out))


def main() -> None:
    from headstart.runtime.background import paused

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", required=True)
    p.add_argument("--head", default=None)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts, comma-separated")
    args = p.parse_args()
    rows = [int(m) for m in args.rows.split(",")]
    dtype = getattr(torch, args.dtype)
    code = 1 if dtype == torch.bfloat16 else 0
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"base": build(args.base, Path(tmp), "base"), "head": build(args.head, Path(tmp), "head")}
        torch.manual_seed(0)
        weights = [torch.randn(n, k, dtype=dtype) for n, k in SHAPES]
        packed = {}
        for label, lib in libs.items():
            packed[label] = [torch.empty_like(w) for w in weights]
            for w, pk in zip(weights, packed[label], strict=True):
                lib.hs_pack(code, ctypes.c_void_p(w.data_ptr()), ctypes.c_void_p(pk.data_ptr()), *w.shape)

        def one_pass(label: str, m: int) -> float:
            xs = {k: torch.randn(m, k, dtype=dtype) for k in {k for _, k in SHAPES}}
            ys = {n: torch.empty(m, n, dtype=dtype) for n in {n for n, _ in SHAPES}}
            t0 = time.perf_counter()
            for (n, k), pk in zip(SHAPES, packed[label], strict=True):
                libs[label].hs_linear(
                    code,
                    ctypes.c_void_p(xs[k].data_ptr()),
                    m,
                    k,
                    ctypes.c_void_p(pk.data_ptr()),
                    None,
                    ctypes.c_void_p(ys[n].data_ptr()),
                    n,
                    torch.get_num_threads(),
                )
            return 1e3 * (time.perf_counter() - t0)

        print(
            f"{args.dtype}, ms a pass over 30 layers' products, base {args.base} / head {args.head or 'working tree'}"
        )
        print("| rows | base | head | base / head |\n| ---: | ---: | ---: | ---: |")
        with paused():
            for m in rows:
                ms: dict[str, list[float]] = {"base": [], "head": []}
                for r in range(7):
                    for label in ("base", "head") if r % 2 else ("head", "base"):
                        ms[label].append(one_pass(label, m))
                b, h = (statistics.median(ms[label][1:]) for label in ("base", "head"))
                print(f"| {m} | {b:.2f} | {h:.2f} | {b / h:.2f} |", flush=True)


if __name__ == "__main__":
    main()

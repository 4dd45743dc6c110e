"""What a long prompt joining costs the streams already decoding: `python -m headstart.runtime.apps.join_gap`.

Eight sequences decode plainly in one batch; after 10 rounds a prompt of `--join-tokens` tokens (the first prompt's
tokens repeated) joins and is prefilled `--prefill-chunk` tokens a round; 10 more rounds follow it. Every round is
a gap between two tokens of each running stream: the median and p95 of those gaps are printed per chunk size (and
written to --out as JSON). Background jobs are paused while it measures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from headstart.runtime.background import paused
from headstart.runtime.engine import Engine
from headstart.runtime.generate import Batch, Request
from headstart.runtime.models import DEFAULT_MODEL
from headstart.runtime.prompts import load_prompts


def gaps(engine: Engine, prompts: list[list[int]], join: list[int], chunk: int, streams: int = 8) -> list[float]:
    """Seconds of each round around the join (10 before, the join's, 10 after)."""
    engine.target.set_slots(streams + 1)
    batch = Batch(engine.target, prefill_chunk=chunk)
    room = [engine.target.max_len - len(prompts[i % len(prompts)]) for i in range(streams)]  # they never finish
    running = [batch.add(Request(prompts[i % len(prompts)], max_new_tokens=min(r, 1000))) for i, r in enumerate(room)]
    for _ in range(10):  # every stream prefilled and decoding
        batch.round()

    def timed() -> float:
        t = time.perf_counter()
        batch.round()
        return time.perf_counter() - t

    seconds = [timed() for _ in range(10)]
    joiner = batch.add(Request(join, max_new_tokens=1))
    while not joiner.done:
        seconds.append(timed())
    seconds += [timed() for _ in range(10)]
    for r in running:
        batch.remove(r)
    return seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m headstart.runtime.apps.join_gap", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompts", required=True, help="JSONL prompts: the running streams' chat prompts")
    p.add_argument("--join-tokens", type=int, default=2000)
    p.add_argument("--prefill-chunk", type=int, nargs="+", default=[32, 64, 128, 256])
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    engine = Engine.load(args.model, args.dtype)
    prompts = [engine.encode(x.text) for x in load_prompts(args.prompts)]
    join = (prompts[0] * (args.join_tokens // len(prompts[0]) + 1))[: args.join_tokens]
    rows = []
    with paused():
        for chunk in args.prefill_chunk:
            s = sorted(gaps(engine, prompts, join, chunk))
            median, p95 = statistics.median(s), s[round(0.95 * (len(s) - 1))]
            rows.append({"prefill_chunk": chunk, "rounds": len(s), "median_ms": 1e3 * median, "p95_ms": 1e3 * p95})
            print(
                f"prefill chunk {chunk}: {len(s)} rounds, median gap {1e3 * median:.0f} ms, p95 {1e3 * p95:.0f} ms "
                f"({p95 / median:.2f}x)",
                flush=True,
            )
    if args.out:
        Path(args.out).write_text(json.dumps({"model": args.model, "dtype": args.dtype, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Every method on the native forward and on the generic path in one run: two engines of the same model, one with
the native forward (the default) and one with `HEADSTART_NATIVE=0` (the fused stack on the stock kernels, the path
before it), answering each prompt in turn, method by method, which path goes first flipped prompt by prompt. Prints
tok/s per method and path over the same prompts (all tokens over all seconds), each path's ratio to its own plain,
native over generic, and how many answers equal their path's plain answer (T = 0).

    .venv/bin/python tests/engines/paths_ab.py [--dtype bfloat16] [--limit-per-category 2] [--prompts FILE]
        [--methods plain,lookup,eagle,eagle+lookup,eagle3,eagle3+lookup] [--max-new-tokens 128] [--demo]

Spec-Bench (../shared/data/eval/spec_bench.jsonl) by default; `--demo`: `headstart demo`'s prompts, each method
the demo can run. Registered background jobs are paused.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PATHS = ("native", "generic")


def main() -> None:
    from tqdm import tqdm

    from headstart.runtime.apps.bench import SPEC_BENCH_GROUPS, method_options, method_spec, run_method
    from headstart.runtime.apps.demo import PROMPTS as DEMO_PROMPTS
    from headstart.runtime.background import paused
    from headstart.runtime.engine import Engine
    from headstart.runtime.prompts import load_prompts
    from headstart.runtime.sampling import SamplingParams

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--prompts", default=str(ROOT.parent / "shared" / "data" / "eval" / "spec_bench.jsonl"))
    p.add_argument("--limit-per-category", type=int, default=2)
    p.add_argument("--methods", default="plain,lookup,eagle,eagle+lookup,eagle3,eagle3+lookup")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--demo", action="store_true", help="`headstart demo`'s prompts instead of --prompts")
    args = p.parse_args()
    methods = args.methods.split(",")
    options = method_options(methods, {})
    engines, drafters = {}, {}
    for path in PATHS:
        os.environ["HEADSTART_NATIVE"] = "1" if path == "native" else "0"  # read as each engine's target is built
        engines[path] = Engine.load(dtype=args.dtype)
        drafters[path] = {m: engines[path].make_drafter(method_spec(m), **o) for m, o in options.items()}
    os.environ.pop("HEADSTART_NATIVE")
    assert engines["native"].target.packed.kind == "native" != engines["generic"].target.packed.kind
    if args.demo:
        texts, source = DEMO_PROMPTS, "headstart demo's prompts"
    else:
        texts = [pr.text for pr in load_prompts(args.prompts, None, args.limit_per_category, groups=SPEC_BENCH_GROUPS)]
        source = f"prompts of {Path(args.prompts).name}"
    encoded = [engines["native"].encode(text) for text in texts]
    greedy = SamplingParams()
    tokens = {(path, m): 0 for path in PATHS for m in methods}
    seconds = dict.fromkeys(tokens, 0.0)
    same = dict.fromkeys(tokens, 0)
    with paused():
        for path in PATHS:  # warm-up: allocations, kernel choices, the cost curves' timing
            for m in methods:
                run_method(engines[path], m, drafters[path], encoded[0], greedy, 16, 0)
        for i, ids in enumerate(tqdm(encoded, desc="paths", unit="prompt")):
            for path in PATHS if i % 2 == 0 else PATHS[::-1]:
                plain = None
                for m in methods:
                    run = run_method(engines[path], m, drafters[path], ids, greedy, args.max_new_tokens, 0)
                    tokens[path, m] += len(run.tokens)
                    seconds[path, m] += run.seconds
                    plain = run.tokens if m == "plain" else plain
                    same[path, m] += run.tokens == plain
    rate = {k: tokens[k] / seconds[k] for k in tokens}
    print(f"{args.dtype}, {len(texts)} {source}, T = 0, {args.max_new_tokens} tokens")
    print("| method | native tok/s | vs its plain | generic tok/s | vs its plain | native / generic | same as plain |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for m in methods:
        n, g = rate["native", m], rate["generic", m]
        print(
            f"| {m} | {n:.1f} | {n / rate['native', 'plain']:.2f} | {g:.1f} | {g / rate['generic', 'plain']:.2f} "
            f"| {n / g:.2f} | {same['native', m]} / {same['generic', m]} of {len(texts)} |"
        )


if __name__ == "__main__":
    main()

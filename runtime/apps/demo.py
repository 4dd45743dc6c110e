"""`headstart demo`: the same prompts decoded plainly and speculatively — same text, fewer target passes.

Accepted draft tokens are marked in the streamed speculative text (green on a terminal, [brackets]
otherwise). fp32 by default: speculative output then equals plain output token for token; in
bfloat16 both are faster but rounding noise can flip a near-tie after a few dozen tokens.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from headstart.runtime.drafters.base import Drafter
    from headstart.runtime.engine import Engine

PROMPTS = [
    "Correct the spelling mistakes in this paragraph and write it out in full: 'Speculativ decoding lets a "
    "smal draft gues several tokens ahead. The big model cheks all of them in one forward pass, acepts the "
    "longest corect prefix, and so the ouput stays exactly the same while fewer passes are needed.'",
    "Add type hints and a docstring to this Python function and show the whole function:\n\n"
    "def moving_average(values, window):\n    if window <= 0:\n        raise ValueError('window must be positive')\n"
    "    out = []\n    for i in range(len(values) - window + 1):\n"
    "        out.append(sum(values[i:i + window]) / window)\n"
    "    return out\n",
    "Summarize the following text in two sentences: 'The city council met on Monday to discuss the new park. "
    "The new park will have a playground, a pond and a small cafe. The council said the new park will open next "
    "spring, and the new park will be free for everyone.'",
]


def _marks(tty: bool) -> tuple[str, str]:
    return ("\x1b[32m", "\x1b[0m") if tty else ("[", "]")


def _decode(engine: Engine, prompt_ids: list[int], drafter: Drafter, max_new_tokens: int, mark: bool):
    """Stream one answer to stdout, accepted draft tokens marked; return (token ids, stats, seconds)."""
    from headstart.runtime.generate import GenerationStats, stream
    from headstart.runtime.text import TextDecoder

    on, off = _marks(sys.stdout.isatty())
    stats = GenerationStats()
    marks = TextDecoder(engine.tokenizer)  # the one detokeniser: splits each round at its last accepted draft token
    ids: list[int] = []
    t0 = time.perf_counter()
    for chunk in stream(engine.target, prompt_ids, drafter, None, max_new_tokens, engine.eos_ids, stats=stats):
        drafted = marks.push(chunk.tokens[: chunk.drafted])
        rest = marks.push(chunk.tokens[chunk.drafted :])
        print(f"{on}{drafted}{off}" if mark and drafted.strip() else drafted, rest, sep="", end="", flush=True)
        ids += chunk.tokens
    print(marks.finish())
    return ids, stats, time.perf_counter() - t0


def run_demo(
    model: str,
    dtype: str,
    device: str,
    max_new_tokens: int,
    drafter: str,
    profile: str | None = None,
    prepack: bool = True,
) -> int:
    """Plain vs `drafter` on the built-in prompts; trained drafters use the heads shipped for `model`."""
    from headstart.runtime.engine import Engine

    print(f"headstart demo: loading {model} ({dtype}, {device}) ...", flush=True)
    engine = Engine.load(model, dtype=dtype, device=device, profile=profile, prepack=prepack)
    packed = engine.target.packed
    if packed.kind != "none":
        print(f"headstart demo: linear kernels prepacked ({packed.kind}) in {packed.seconds:.2f} s", flush=True)
    spec = engine.make_drafter(drafter)
    engine.generate(engine.encode("Hi"), max_new_tokens=4)  # warm-up
    on, off = _marks(sys.stdout.isatty())
    totals = {"plain": [0, 0.0], "spec": [0, 0.0, 0]}
    identical = 0
    for i, prompt in enumerate(PROMPTS, 1):
        print(f"\n=== prompt {i}/{len(PROMPTS)}: {prompt!r}")
        prompt_ids = engine.encode(prompt)
        print("--- plain decoding:")
        plain_ids, _, plain_s = _decode(engine, prompt_ids, engine.make_drafter("none"), max_new_tokens, mark=False)
        print(f"--- speculative decoding ({drafter} drafter; {on}accepted draft tokens{off} marked):")
        spec_ids, stats, spec_s = _decode(engine, prompt_ids, spec, max_new_tokens, mark=True)
        same = spec_ids == plain_ids
        identical += same
        plain_tps, spec_tps = len(plain_ids) / plain_s, len(spec_ids) / spec_s
        print(
            f"--- identical: {'yes' if same else 'NO'} | plain {plain_tps:.1f} tok/s | speculative "
            f"{spec_tps:.1f} tok/s | speedup {spec_tps / plain_tps:.2f}x | acceptance length "
            f"{stats.acceptance_length:.2f} ({stats.new_tokens} tokens in {stats.target_passes} target passes)"
        )
        totals["plain"][0] += len(plain_ids)
        totals["plain"][1] += plain_s
        totals["spec"][0] += len(spec_ids)
        totals["spec"][1] += spec_s
        totals["spec"][2] += stats.target_passes
    plain_tps = totals["plain"][0] / totals["plain"][1]
    spec_tps = totals["spec"][0] / totals["spec"][1]
    print(
        f"\n=== overall: {identical}/{len(PROMPTS)} identical | plain {plain_tps:.1f} tok/s | speculative "
        f"{spec_tps:.1f} tok/s | speedup {spec_tps / plain_tps:.2f}x | acceptance length "
        f"{totals['spec'][0] / totals['spec'][2]:.2f}"
    )
    return 0

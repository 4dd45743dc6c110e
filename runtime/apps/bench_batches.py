"""`headstart bench --breakdown --batch-sizes 1,4,16`: a round's phases with B sequences decoding together.

For each method (our decode loop with its drafter; transformers' methods are batch-1 references and are skipped)
and batch size B, B prompts join one `generate.Batch` (their prompts prefilled first), every sequence drafting
with its own fork of the method's drafter (its tree as the method's options give it: no load budget), and the
rounds while all B decode are timed phase by phase (`generate.PHASES`; the lm_head under the target's hooks).
The rows say what a round costs at that load, where it goes (drafting for the batch, the forward over every tree,
accepting and committing per sequence) and how many tokens it makes.
"""

from __future__ import annotations

import time

from headstart.runtime.apps.bench import HF_METHODS, SPEC_BENCH_GROUPS, method_engines, method_options, method_spec
from headstart.runtime.drafters.base import Drafter
from headstart.runtime.engine import Engine
from headstart.runtime.generate import PHASES, Batch, Request
from headstart.runtime.prompts import load_prompts
from headstart.runtime.sampling import SamplingParams


def batch_breakdown(
    engine: Engine,
    prompts_file: str,
    methods: list[str],
    batch_sizes: list[int],
    temperature: float = 0.0,
    max_new_tokens: int = 128,
    categories: set[str] | None = None,
    seed: int = 0,
    **draft_options,
) -> list[dict]:
    """A row per method and batch size: sequences, rounds timed, ms a round, tokens a round and per second, and ms
    a round of each phase. The first prompts of the file (cycled when B is larger)."""
    methods = [m for m in methods if m not in HF_METHODS]
    options = method_options(methods, draft_options)
    engines = method_engines(engine, options)
    drafters = {m: engines[m].make_drafter(method_spec(m), **o) for m, o in options.items()}
    prompts = load_prompts(prompts_file, categories, None, groups=SPEC_BENCH_GROUPS)
    encoded = [engine.encode(p.text) for p in prompts[: max(batch_sizes)]]
    rows = []
    for runs_on in {id(e): e for e in [engine, *engines.values()]}.values():
        runs_on.target.set_slots(max(batch_sizes))
    for b in batch_sizes:
        for method in methods:
            runs_on = engines.get(method, engine)
            drafter = drafters.get(method) or Drafter()
            ids = [encoded[i % len(encoded)] for i in range(b)]
            _decode(runs_on, drafter, ids[:1], temperature, 8, seed)  # warm-up
            with runs_on.target.timing_lm_head():
                rows.append(
                    {
                        "method": method,
                        "sequences": b,
                        **_decode(runs_on, drafter, ids, temperature, max_new_tokens, seed),
                    }
                )
    return rows


def _decode(engine: Engine, drafter: Drafter, prompts: list[list[int]], temperature: float, max_new: int, seed: int):
    """Decode `prompts` together; the rounds while every one of them decodes, timed."""
    batch = Batch(engine.target, prefix=engine.chat_prefix())
    sampling = SamplingParams(temperature)
    requests = [
        batch.add(Request(p, drafter.fork(), sampling, max_new, engine.eos_ids, seed + i))
        for i, p in enumerate(prompts)
    ]
    while batch.joining:
        batch.round()
    phases, rounds, tokens, t0 = dict.fromkeys(PHASES, 0.0), 0, 0, time.perf_counter()
    while len(batch.decoding) == len(requests):
        witness = batch.decoding[0]  # every live sequence's stats gain the round's batch-wide phase seconds
        before = dict(witness.stats.phase_s)
        out = batch.round()
        rounds += 1
        tokens += sum(len(chunk.tokens) for _, chunk in out)
        for name in PHASES:
            phases[name] += witness.stats.phase_s[name] - before[name]
    seconds = time.perf_counter() - t0
    for r in requests:
        if not r.done:
            batch.remove(r)
    n = max(rounds, 1)
    return {
        "rounds": rounds,
        "round_ms": 1e3 * seconds / n,
        "tokens_per_round": tokens / n,
        "tokens_per_s": tokens / seconds if seconds else 0.0,
        **{name: 1e3 * s / n for name, s in phases.items()},
    }


def batches_markdown(rows: list[dict]) -> str:
    """The rows as a table: ms a round of each phase, the round, its tokens and tokens per second."""
    head = " | ".join(PHASES)
    lines = [
        f"| method | sequences | rounds | {head} | round ms | tokens a round | tok/s |",
        "| --- | ---: | ---: |" + " ---: |" * (len(PHASES) + 3),
    ]
    for r in rows:
        phases = " | ".join(f"{r[name]:.1f}" for name in PHASES)
        lines.append(
            f"| {r['method']} | {r['sequences']} | {r['rounds']} | {phases} | {r['round_ms']:.1f} | "
            f"{r['tokens_per_round']:.2f} | {r['tokens_per_s']:.1f} |"
        )
    return "\n".join(lines) + "\n"

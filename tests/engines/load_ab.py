"""The server's batch under closed-loop load without HTTP: serve's default drafter (budget) against plain, in-process.

    .venv/bin/python tests/engines/load_ab.py [--dtype float32|bfloat16] [--clients 16] [--requests 2]
        [--repeats 2] [--skip 10000] [--max-tokens 64]

`--clients` clients each send `--requests` requests one after another (the next joins as the last ends) to the
`Worker` a server builds (its batch, prefix cache, policy and planner), driven round by round on this thread:
`budget` with the default drafter, then `off` (plain), alternating per repeat, each repeat on prompts of its own
(serve_bench.write_unseen's, from `--skip`), training paused. Prints each run's tok/s, rounds, the share of
sequence-rounds with a tree, and the drafting share of the rounds' phases (propose + observe over all, as /metrics
counts them), and of the treeless rounds' (no sequence drafted): what the server's round costs apart from HTTP and
the event loop; for the default drafter, how many plans asked for offers, gave a tree, or were stopped by
`trees_lose`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_bench import write_unseen

from headstart.commands.common import DEFAULT_DRAFTER
from headstart.runtime.apps.server.metrics import ServerMetrics
from headstart.runtime.apps.server.worker import Worker
from headstart.runtime.background import paused
from headstart.runtime.engine import Engine
from headstart.runtime.generate import Request
from headstart.runtime.prefix_cache import DEFAULT_GB, PrefixCache


def run(engine: Engine, policy: str, texts: list[str], clients: int, max_tokens: int) -> dict:
    """One load: `clients` at once over `texts`, through a fresh Worker running `policy`."""
    layers = engine.drafter.feature_layers if policy != "off" else ()
    cache = PrefixCache(int(DEFAULT_GB * 2**30), layers)
    worker = Worker(
        engine,
        ServerMetrics(None, cache),
        64,
        300.0,
        max_batch=32,
        kv_budget=4 << 30,
        prefix_cache=cache,
        speculation=policy,
    )
    worker.warm_up()
    batch, queue, done = worker.batch, list(texts), []
    checks = watch(batch.planner) if batch.planner is not None else {}

    def submit() -> None:
        ids = engine.encode(queue.pop(0))
        batch.add(Request(ids, worker.drafter.fork(), max_new_tokens=max_tokens, eos_ids=engine.eos_ids))

    for _ in range(min(clients, len(queue))):
        submit()
    t0, rounds, made = time.perf_counter(), 0, 0
    while len(batch):
        out = batch.round()
        rounds += 1
        for r, chunk in out:
            made += len(chunk.tokens)
            if r.done:
                done.append(r.stats)
                if queue:
                    submit()
    seconds = time.perf_counter() - t0
    phases = {k: sum(s.phase_s.get(k, 0.0) for s in done) for k in done[0].phase_s}
    treeless = {k: sum(s.treeless_phase_s.get(k, 0.0) for s in done) for k in done[0].treeless_phase_s}
    spec = sum(s.spec_steps for s in done)
    return {
        "tokens_per_s": made / seconds,
        "rounds": rounds,
        "speculated": spec / max(sum(s.target_passes for s in done), 1),
        "drafting_share": drafting_share(phases),
        "treeless_share": sum(treeless.values()) / sum(phases.values()),
        "treeless_drafting_share": drafting_share(treeless),
        "checks": checks,
    }


def watch(planner) -> dict[str, int]:
    """Counts of the planner's plans that asked for offers, those that gave a tree, and those `trees_lose` stopped
    (this instance's methods wrapped: a bench's look inside, the planner unchanged)."""
    counts = {"asked": 0, "gave a tree": 0, "trees lose": 0}
    choose, lose = planner._choose, planner.trees_lose

    def counted_choose(*args, **kwargs):
        picks = choose(*args, **kwargs)
        counts["asked"] += 1
        counts["gave a tree"] += any(o is not None for o in picks[0])
        return picks

    def counted_lose(near):
        lost = lose(near)
        counts["trees lose"] += lost
        return lost

    planner._choose, planner.trees_lose = counted_choose, counted_lose
    return counts


def drafting_share(phases: dict[str, float]) -> float:
    """Planning, drafting and the drafters' update (propose + observe) over the phases' seconds (0 if none)."""
    total = sum(phases.values())
    return (phases["propose"] + phases["observe"]) / total if total else 0.0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=2, help="per client")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--skip", type=int, default=10000, help="into write_unseen's prompts (the serving bench's come first)"
    )
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    per = args.clients * args.requests
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "prompts.jsonl"
        write_unseen(path, per * args.repeats, args.skip)
        texts = [json.loads(line)["turns"][0] for line in path.open()]
    engine = Engine.load(dtype=args.dtype, drafter=DEFAULT_DRAFTER)
    with paused():
        for r in range(args.repeats):
            ratio = {}
            for policy in ("budget", "off") if r % 2 == 0 else ("off", "budget"):
                got = run(engine, policy, texts[r * per : (r + 1) * per], args.clients, args.max_tokens)
                ratio[policy] = got["tokens_per_s"]
                print(
                    f"repeat {r} {policy:6s} {got['tokens_per_s']:6.1f} tok/s, {got['rounds']} rounds, "
                    f"speculated {got['speculated']:.0%}, drafting {got['drafting_share']:.1%}; treeless rounds "
                    f"{got['treeless_share']:.0%} of the time, their drafting {got['treeless_drafting_share']:.1%}"
                    + "".join(f"; plans: {n} {what}" for what, n in got["checks"].items()),
                    flush=True,
                )
            print(f"repeat {r}: default drafter {ratio['budget'] / ratio['off']:.2f}x plain", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`headstart generate` and `headstart demo`: decoding from the command line."""

from __future__ import annotations

import argparse
import json
import sys

from headstart.commands import common
from headstart.runtime.drafters.registry import names, parse_spec
from headstart.runtime.prompts import Prompt, load_prompts
from headstart.runtime.sizing.policy import POLICIES


def add_parsers(sub) -> None:
    g = sub.add_parser("generate", help="generate text for one prompt or a prompt file")
    common.add_model_args(g, "float32")
    common.add_prepack_arg(g)
    common.add_adapter_args(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompts-file", help="JSONL rows with 'turns' (the first turn is used) or 'prompt'")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    common.add_drafter_args(g)
    g.add_argument(
        "--speculation",
        choices=POLICIES,
        default=None,
        help="how its trees are sized (runtime/sizing/policy.py): budget, the load planner (the default, as serve's "
        "and bench's); fixed, the drafter's own tree; off, plain",
    )
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    g.add_argument("--seed", type=common.seed_value, default=0)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    g.set_defaults(run=cmd_generate)

    d = sub.add_parser("demo", help="plain vs speculative decoding on built-in prompts")
    common.add_model_args(d, "float32")
    common.add_prepack_arg(d)
    d.add_argument("--max-new-tokens", type=int, default=128)
    d.add_argument(
        "--drafter",
        default=None,
        metavar="SPEC",
        help=f"the speculative side: {', '.join(names())} (trained ones use the heads shipped for "
        f"--model; default {common.DEFAULT_DRAFTER_HELP})",
    )
    common.add_profile_arg(d)
    d.set_defaults(run=cmd_demo)


def cmd_generate(args: argparse.Namespace, argv: list[str]) -> int:
    common.check_lengths(args)
    sampling = common.sampling_params(args.temperature, args.top_k, args.top_p)
    if args.prompt is not None:
        if not args.prompt.strip():
            raise common.UserError("empty --prompt")
        prompts = [Prompt("0", "", args.prompt)]
    else:
        prompts = load_prompts(args.prompts_file)

    from headstart.runtime.generate import GenerationStats
    from headstart.runtime.sizing.policy import batch_of_one

    engine = common.load_engine(args)
    planner, drafter = batch_of_one(args.speculation, engine.target, engine.drafter)
    for prompt in prompts:
        prompt_ids = engine.encode(prompt.text, chat=not args.raw)
        options = dict(sampling=sampling, max_new_tokens=args.max_new_tokens, seed=args.seed, stop=args.stop)
        options |= dict(drafter=drafter, planner=planner)
        if args.json:
            result = engine.generate(prompt_ids, **options)
            row = {"id": prompt.id, "token_ids": result.token_ids, "text": result.text, "stats": result.stats.as_dict()}
            print(json.dumps(row), flush=True)
            continue
        stats = GenerationStats()
        for delta in engine.stream_text(prompt_ids, stats=stats, **options):
            print(delta, end="", flush=True)
        print(flush=True)
        s = stats.as_dict()
        print(
            f"[{s['new_tokens']} tokens, {s['tokens_per_s']:.1f} tok/s, acceptance length "
            f"{s['acceptance_length']:.2f}, {s['target_passes']} target passes]",
            file=sys.stderr,
        )
    return 0


def cmd_demo(args: argparse.Namespace, argv: list[str]) -> int:
    from headstart.runtime.apps.demo import run_demo

    if args.drafter is None:
        args.drafter = common.default_drafter(args.model)
    parse_spec(args.drafter)
    return run_demo(
        args.model, args.dtype, args.device, args.max_new_tokens, args.drafter, args.profile, not args.no_prepack
    )

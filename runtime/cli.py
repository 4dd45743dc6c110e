"""The `headstart` command (generate, bench, distill, report, serve, demo); a user error gets one line, exit 2."""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from collections.abc import Sequence

from runtime.bench import METHODS
from runtime.demo import DEFAULT_DRAFTER
from runtime.drafters import DRAFT_VOCAB, DRAFTERS, GRAFTED, MEDUSA_BUDGET
from runtime.drafters.eagle import EagleDrafter
from runtime.models import DEFAULT_MODEL, DTYPES
from runtime.prompts import Prompt, load_prompts
from runtime.sampling import SamplingParams
from train.distill import DERIVED


class UserError(Exception):
    """Bad input: reported as one line, never a traceback."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own errors: one line too
        raise UserError(message)


def _add_model_args(p: argparse.ArgumentParser, dtype: str) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="embedded name, HF model directory or .gguf file")
    p.add_argument("--dtype", default=dtype, choices=list(DTYPES))
    p.add_argument("--device", default="cpu")


def _add_drafter_args(p: argparse.ArgumentParser) -> None:
    eagle = {k: v.default for k, v in inspect.signature(EagleDrafter).parameters.items()}  # its defaults, read
    p.add_argument("--drafter", default="none", choices=DRAFTERS + GRAFTED,
                   help="eagle+lookup etc.: lookup branches grafted onto the drafter's tree")  # fmt: skip
    p.add_argument("--heads", default=None, help="trained heads directory (default: the shipped ones, if any)")
    p.add_argument("--tree-budget", type=int, default=None,
                   help=f"nodes per tree (default: medusa {MEDUSA_BUDGET}, eagle {eagle['budget']} at T = 0 and "
                   f"{eagle['sampled_budget']} above, others 16)")  # fmt: skip
    p.add_argument("--tree-depth", type=int, default=None, help="eagle, model, layerskip: drafting depth")
    p.add_argument("--tree-top-k", type=int, default=None,
                   help="eagle, model, layerskip: nodes expanded and children per node (model, layerskip: 1 = a chain, "
                   "the default)")  # fmt: skip
    _add_draft_vocab_arg(p)
    p.add_argument("--draft-model", default=None, help="model drafter: a small causal LM with the same tokenizer")
    p.add_argument("--draft-layers", default=None, help="layerskip drafter: N first layers, or a list 0,1,2,5")


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _add_draft_vocab_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft-vocab", type=_at_least_one, default=None, metavar="N",
                   help="medusa, eagle: read out only the N most frequent tokens of the heads' draft vocabulary "
                   f"(default {DRAFT_VOCAB})")  # fmt: skip


def _load_engine(args: argparse.Namespace):
    from runtime.engine import Engine

    options = {"tree_budget": args.tree_budget, "tree_depth": args.tree_depth, "tree_top_k": args.tree_top_k,
               "draft_model": args.draft_model, "draft_layers": args.draft_layers,
               "draft_vocab": args.draft_vocab}  # fmt: skip
    return Engine.load(args.model, args.dtype, args.drafter, args.device, args.heads, **options)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="headstart", description="Exact self-speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="generate text for one prompt or a prompt file")
    _add_model_args(g, "float32")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompts-file", help="JSONL rows with 'turns' (the first turn is used) or 'prompt'")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    _add_drafter_args(g)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--json", action="store_true", help="print one JSON object per prompt")

    b = sub.add_parser("bench", help="tokens/s, speedup and acceptance length of decoding methods")
    _add_model_args(b, "bfloat16")
    b.add_argument("--prompts", default=None, help="JSONL prompt file (default: Spec-Bench in ../shared/data)")
    b.add_argument(
        "--methods",
        default="plain,hf,lookup",
        help="comma list of " + ",".join(METHODS) + " (variants: layerskip:N, model:PATH, medusa:B, eagle:B; "
        "B = tree budget; eagle+lookup etc.: lookup branches grafted on)",
    )
    b.add_argument("--medusa-heads", default=None, help="Medusa heads directory (default: shipped)")
    b.add_argument("--eagle-heads", default=None, help="EAGLE head directory (default: shipped)")
    b.add_argument("--draft-layers", default=None, help="layerskip: N first layers or a list 0,1,2,5")
    b.add_argument("--draft-model", default=None, help="model: the draft model")
    _add_draft_vocab_arg(b)
    b.add_argument("--tree-depth", type=int, default=None, help="eagle, model, layerskip: drafting depth")
    b.add_argument("--tree-top-k", type=int, default=None, help="eagle, model, layerskip: nodes expanded per depth")
    b.add_argument("--temperature", default="0", help="comma list of temperatures")
    b.add_argument("--categories", default=None, help="comma list (default: all six; mt_bench = the 8 of MT-bench)")
    b.add_argument("--limit-per-category", type=int, default=None)
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--out", default="bench-results", help="folder for the JSON records and Markdown table")

    ds = sub.add_parser("distill", help="self-distillation: the target answers training prompts (resumable)")
    _add_model_args(ds, "bfloat16")
    ds.add_argument("--prompts", default="../shared/data/train/prompts.jsonl", help="JSONL rows with 'turns'")
    ds.add_argument("--out", required=True, help="folder for the JSONL shards (resumes if it has some)")
    ds.add_argument("--permissive-only", action="store_true", help="only rows with permissive: true")
    ds.add_argument("--derive", default=None, choices=tuple(DERIVED),
                    help="instead of --prompts: prompts of this task over the answers already in --out")  # fmt: skip
    ds.add_argument("--limit", type=int, default=None, help="first N usable prompts")
    ds.add_argument("--max-new-tokens", type=int, default=256)
    ds.add_argument("--temperature", type=float, default=0.0)
    ds.add_argument("--batch-size", type=int, default=16)
    ds.add_argument("--seed", type=int, default=0)

    r = sub.add_parser("report", help="per-head training curves of several runs in one PNG")
    r.add_argument("runs", nargs="+", help="training output directories (with metrics.jsonl)")
    r.add_argument("--out", default="report.png")

    sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (one request at a time, FIFO queue)")
    _add_model_args(sv, "bfloat16")
    _add_drafter_args(sv)
    sv.add_argument("--served-model-name", default=None, help="the `model` clients pass (default: --model)")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--max-queue", type=int, default=None, help="waiting requests before 429 (default 64)")
    sv.add_argument("--time-limit", type=float, default=None, help="seconds per request (default 300)")
    sv.add_argument("--step-aside-queue", type=int, default=None,
                    help="decode plainly while more than this many requests wait (default: never)")  # fmt: skip
    sv.add_argument("--min-acceptance", type=float, default=None,
                    help="decode plainly a while when recent rounds make fewer tokens a pass")  # fmt: skip

    lt = sub.add_parser("loadtest", help="latency and throughput of a running `headstart serve`")
    lt.add_argument("--url", default="http://127.0.0.1:8000")
    lt.add_argument("--clients", default="1,4,16", help="comma list of concurrency levels")
    lt.add_argument("--requests-per-client", type=int, default=2)
    lt.add_argument("--max-tokens", type=int, default=64)
    lt.add_argument("--prompts", default=None, help="JSONL prompt file (default: Spec-Bench in ../shared/data)")
    lt.add_argument("--out", default=None, help="also write the results as JSON here")

    d = sub.add_parser("demo", help="plain vs speculative decoding on built-in prompts")
    _add_model_args(d, "float32")
    d.add_argument("--max-new-tokens", type=int, default=128)
    d.add_argument(
        "--drafter",
        default=DEFAULT_DRAFTER,
        choices=["lookup", "medusa", "eagle", "medusa+lookup", "eagle+lookup"],
        help="speculative side: lookup or the heads shipped for --model (+lookup: both in one tree)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "bench":
            return cmd_bench(args, list(argv) if argv is not None else sys.argv[1:])
        if args.command == "distill":
            return cmd_distill(args)
        if args.command == "report":
            from train.report import draw_report

            print(draw_report(args.runs, args.out))
            return 0
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "loadtest":
            return cmd_loadtest(args)
        if args.command == "demo":
            from runtime.demo import run_demo

            return run_demo(args.model, args.dtype, args.device, args.max_new_tokens, args.drafter)
    except (UserError, ValueError) as e:
        print(f"headstart: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("headstart: interrupted", file=sys.stderr)
        return 130
    return 0


def _check_lengths(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 0:
        raise UserError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")


def cmd_generate(args: argparse.Namespace) -> int:
    _check_lengths(args)
    try:
        sampling = SamplingParams(args.temperature, args.top_k, args.top_p)
    except ValueError as e:
        raise UserError(str(e).replace("top_", "--top-").replace("temperature", "--temperature")) from e
    if args.prompt is not None:
        if not args.prompt.strip():
            raise UserError("empty --prompt")
        prompts = [Prompt("0", "", args.prompt)]
    else:
        prompts = load_prompts(args.prompts_file)

    from runtime.generate import GenerationStats

    engine = _load_engine(args)
    for prompt in prompts:
        prompt_ids = engine.encode(prompt.text, chat=not args.raw)
        options = dict(sampling=sampling, max_new_tokens=args.max_new_tokens, seed=args.seed, stop=args.stop)
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


def cmd_serve(args: argparse.Namespace) -> int:
    import dataclasses

    import uvicorn

    from runtime.server.app import ServeConfig, build_app

    if not 0 < args.port < 65536:
        raise UserError(f"--port must be in 1..65535, got {args.port}")
    for flag, value in (("--max-queue", args.max_queue), ("--time-limit", args.time_limit)):
        if value is not None and value <= 0:
            raise UserError(f"{flag} must be > 0, got {value}")
    if args.step_aside_queue is not None and args.step_aside_queue < 0:
        raise UserError(f"--step-aside-queue must be >= 0, got {args.step_aside_queue}")
    options = {"max_queue": args.max_queue, "time_limit_s": args.time_limit, "step_aside_queue": args.step_aside_queue,
               "min_acceptance": args.min_acceptance}  # fmt: skip
    config = ServeConfig(args.served_model_name or args.model, **{k: v for k, v in options.items() if v is not None})
    engine = _load_engine(args)
    print(f"headstart: serving {config.model_name} on http://{args.host}:{args.port}/v1 ({dataclasses.asdict(config)})",
          file=sys.stderr)  # fmt: skip
    uvicorn.run(build_app(engine, config), host=args.host, port=args.port, log_level="info")
    return 0


def cmd_loadtest(args: argparse.Namespace) -> int:
    from pathlib import Path

    import httpx

    from runtime import bench
    from runtime.server import loadtest

    try:
        levels = [int(c) for c in args.clients.split(",")]
    except ValueError as e:
        raise UserError(f"--clients takes a comma list of integers: {e}") from e
    if min(levels) < 1 or args.requests_per_client < 1 or args.max_tokens < 1:
        raise UserError("--clients, --requests-per-client and --max-tokens must be >= 1")
    prompts = [p.text for p in load_prompts(args.prompts or bench.DEFAULT_PROMPTS)]
    try:
        health = httpx.get(args.url.rstrip("/") + "/health", timeout=10).json()
    except (httpx.HTTPError, ValueError) as e:
        raise UserError(f"no headstart server at {args.url}: {e}") from e
    rows = [loadtest.run_level(args.url, health["model"], prompts, c, args.requests_per_client, args.max_tokens)
            for c in levels]  # fmt: skip
    print(loadtest.markdown(rows, health["drafter"]))
    if args.out:
        Path(args.out).write_text(json.dumps({"server": health, "levels": rows}, indent=2))
    return 0


def cmd_distill(args: argparse.Namespace) -> int:
    from runtime.models import load_model
    from train.distill import derived_prompts, distill

    _check_lengths(args)
    SamplingParams(args.temperature)
    if args.batch_size < 1 or (args.limit is not None and args.limit < 1):
        raise UserError("--batch-size and --limit must be >= 1")
    if args.derive is None:
        prompts = load_prompts(args.prompts, permissive_only=args.permissive_only, limit=args.limit,
                               skip_malformed=True)  # fmt: skip
    model, tokenizer = load_model(args.model, args.dtype, args.device)
    if args.derive is not None:
        prompts = derived_prompts(args.derive, args.out, tokenizer, args.limit or 1000)
    stats = distill(model, tokenizer, prompts, args.out, args.max_new_tokens, args.temperature, args.batch_size,
                    seed=args.seed)  # fmt: skip
    print(
        f"distilled {stats['new_rows']} new rows ({stats['rows']} in {args.out}): {stats['new_tokens']} tokens "
        f"in {stats['seconds']:.0f} s, {stats['tokens_per_s']:.0f} tokens/s",
        file=sys.stderr,
    )
    return 0


def cmd_bench(args: argparse.Namespace, argv: list[str]) -> int:
    import platform
    from pathlib import Path

    import torch

    from runtime import bench
    from runtime.engine import Engine

    _check_lengths(args)
    try:
        temperatures = [float(t) for t in args.temperature.split(",")]
    except ValueError as e:
        raise UserError(f"--temperature takes a comma list of numbers: {e}") from e
    for t in temperatures:
        SamplingParams(t)
    if args.limit_per_category is not None and args.limit_per_category < 1:
        raise UserError("--limit-per-category must be >= 1")
    prompts = args.prompts or bench.DEFAULT_PROMPTS
    if not Path(prompts).is_file():
        raise UserError(f"prompts file not found: {prompts} (pass --prompts FILE)")
    categories = set(args.categories.split(",")) if args.categories else None
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    engine = Engine.load(args.model, args.dtype, "none", args.device)
    heads = {"medusa": args.medusa_heads, "eagle": args.eagle_heads}
    records = bench.run_bench(
        engine, prompts, methods, temperatures, args.max_new_tokens, args.limit_per_category, categories, args.seed,
        heads, args.model, draft_layers=args.draft_layers, draft_model=args.draft_model,
        tree_depth=args.tree_depth, tree_top_k=args.tree_top_k, draft_vocab=args.draft_vocab,
    )  # fmt: skip
    table = bench.summarize(records)
    machine = (
        f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"{args.dtype}, {args.device}, model {args.model}"
    )
    meta = {"command": "headstart " + " ".join(argv), "machine": machine}
    json_path, md_path, png_path = bench.save(records, table, Path(args.out), meta)
    print(bench.markdown(table))
    print(f"records: {json_path}\ntable: {md_path}\nchart: {png_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`headstart distill`, `magpie`, `drift` and `report`: training data, an adapter's drift, training curves."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from headstart.commands import common
from headstart.runtime import background
from headstart.runtime.models import DEFAULT_MODEL, DTYPES
from headstart.runtime.prompts import load_prompts
from headstart.train.config import HELDOUT_IDS
from headstart.train.distill import BACKENDS, DERIVED


def add_parsers(sub) -> None:
    ds = sub.add_parser("distill", help="self-distillation: the target answers training prompts (resumable)")
    common.add_model_args(ds, "auto")
    common.add_adapter_args(ds)
    ds.add_argument("--prompts", default="../shared/data/train/prompts.jsonl", help="JSONL rows with 'turns'")
    ds.add_argument("--out", required=True, help="folder for the JSONL shards (resumes if it has some)")
    ds.add_argument("--permissive-only", action="store_true", help="only rows with permissive: true")
    ds.add_argument(
        "--derive",
        default=None,
        choices=tuple(DERIVED),
        help="instead of --prompts: prompts of this task over the answers already in --out",
    )
    ds.add_argument("--limit", type=int, default=None, help="first N usable prompts")
    only = (
        "answer only the prompts whose ids this file lists, one a line (e.g. the held-out list, "
        f"{HELDOUT_IDS}, into a folder of its own); the default --exclude then leaves them in"
    )
    ds.add_argument("--only", default=None, metavar="FILE", help=only)
    ds.add_argument("--max-new-tokens", type=int, default=256)
    ds.add_argument("--temperature", type=float, default=0.0)
    ds.add_argument("--batch-size", type=int, default=64, help="sequences decoded together")
    ds.add_argument(
        "--backend",
        default="batched",
        choices=BACKENDS,
        help="batched: continuous batching (default); hf: transformers' generate",
    )
    ds.add_argument(
        "--compare-backends",
        action="store_true",
        help="benchmark: answer the prompts with both backends (T = 0) into OUT/hf and OUT/batched, "
        "print both rates and how many rows agree",
    )
    ds.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="DIR",
        help="distilled folders beside --out: ids in them are not answered again (repeatable)",
    )
    ds.add_argument(
        "--exclude",
        action="append",
        default=None,
        metavar="FILE",
        help="prompt files held out of distillation, by id, source id or text (repeatable; default: "
        "configs/tune-prompts.jsonl, configs/tune-derived.jsonl and Spec-Bench where present)",
    )
    ds.add_argument("--no-prepack", action="store_true", help="stock linear kernels (runtime/kernels.py)")
    ds.add_argument(
        "--engine",
        default=None,
        metavar="URL",
        help="answer on this OpenAI-compatible server (vLLM, SGLang, headstart serve), not locally; "
        "--model is the target it must serve (checked on a probe prompt)",
    )
    ds.add_argument("--concurrency", type=common.at_least_one, default=16, help="--engine: requests in flight")
    ds.add_argument(
        "--api-key", default=None, metavar="KEY", help="--engine: the server's key (default: $HEADSTART_API_KEY)"
    )
    ds.add_argument("--retries", type=int, default=5, help="--engine: retries of a failed request, with backoff")
    ds.add_argument(
        "--no-model-check", action="store_true", help="--engine: skip the probe that the server serves --model"
    )
    ds.add_argument("--seed", type=common.seed_value, default=0)
    ds.set_defaults(run=cmd_distill)

    mp = sub.add_parser("magpie", help="prompts the target writes itself (its user turn left open), filtered")
    common.add_model_args(mp, "auto")
    mp.add_argument("--out", required=True, help="JSONL prompt rows (appended; a second run resumes)")
    mp.add_argument("--count", type=common.at_least_one, required=True, help="prompts --out holds at the end")
    mp.add_argument("--batch-size", type=common.at_least_one, default=64, help="sequences decoded together")
    mp.add_argument("--max-prompt-tokens", type=common.at_least_one, default=96, help="a longer turn is refused")
    mp.add_argument("--temperature", type=float, default=1.0)
    mp.add_argument("--seed", type=common.seed_value, default=0, help="the first sequence's (then +1 each)")
    mp.add_argument(
        "--prompts",
        default="../shared/data/train/prompts.jsonl",
        help="the training prompts the held-out id list names (their texts are kept away from)",
    )
    mp.set_defaults(run=cmd_magpie)

    dr = sub.add_parser("drift", help="how far a LoRA adapter (Medusa-2 heads' own) moves the model's answers")
    dr.add_argument("adapter", help="a peft LoRA adapter directory, or Medusa-2 heads (which hold theirs)")
    dr.add_argument("--model", default=None, help="the base model (default: the one the heads were trained for)")
    dr.add_argument("--dtype", default="float32", choices=DTYPES)
    dr.add_argument("--device", default="cpu")
    dr.add_argument(
        "--prompts", default=None, help="JSONL prompt file (default: the prompts the heads' training run held out)"
    )
    dr.add_argument("--data", default=None, help="the training run's distilled data, if it moved")
    dr.add_argument("--limit", type=common.at_least_one, default=20, help="prompts")
    dr.add_argument("--max-new-tokens", type=common.at_least_one, default=128)
    dr.add_argument("--out", default="bench-results", help="folder for the JSON results")
    dr.set_defaults(run=cmd_drift)

    r = sub.add_parser("report", help="per-head training curves of several runs in one PNG")
    r.add_argument("runs", nargs="+", help="training output directories (with metrics.jsonl)")
    r.add_argument("--out", default="report.png")
    r.add_argument(
        "--x",
        choices=("step", "cpu_s"),
        default="step",
        help="the curves against optimizer steps or training CPU-seconds (evaluation excluded)",
    )
    r.set_defaults(run=cmd_report)


# never distilled into training folders: tuning prompts, Spec-Bench, the committed held-out list (train/heldout.py)
HELD_OUT = ("configs/tune-prompts.jsonl", "configs/tune-derived.jsonl", common.SPEC_BENCH, HELDOUT_IDS)


def cmd_distill(args: argparse.Namespace, argv: list[str]) -> int:
    from headstart.runtime.models import load_model
    from headstart.train.distill import compare_backends, derived_prompts, distill
    from headstart.train.sources import answered_ids, file_sha, held_out, read_ids

    common.check_lengths(args)
    common.sampling_params(args.temperature)
    if args.batch_size < 1 or (args.limit is not None and args.limit < 1):
        raise common.UserError("--batch-size and --limit must be >= 1")
    if args.retries < 0:
        raise common.UserError(f"--retries must be >= 0, got {args.retries}")
    for folder in args.also:
        if not Path(folder).is_dir():
            raise common.UserError(f"--also {folder}: no such folder")
    default_exclude = [f for f in HELD_OUT if Path(f).is_file() and f != args.only]
    exclude = args.exclude if args.exclude is not None else default_exclude
    if args.only is not None and not Path(args.only).is_file():
        raise common.UserError(f"--only {args.only}: no such file")
    for f in exclude:
        if not Path(f).is_file():
            raise common.UserError(f"--exclude {f}: no such file")
    if args.derive is None:
        prompts = load_prompts(
            args.prompts, permissive_only=args.permissive_only, limit=args.limit, skip_malformed=True
        )
        if args.only is not None:
            wanted = set(read_ids(args.only))
            prompts = [p for p in prompts if p.id in wanted]
            if len(prompts) < len(wanted):
                print(
                    f"headstart: warning: {len(wanted) - len(prompts)} id(s) of {args.only} not among the prompts",
                    file=sys.stderr,
                )
        source = {
            "prompts": args.prompts,
            "prompts_sha": file_sha(args.prompts),
            "filter": {"permissive_only": args.permissive_only, "limit": args.limit, "only": args.only},
        }
    model, tokenizer = load_model(args.model, args.dtype, args.device, args.adapter, not args.no_merge)
    if args.derive is not None:
        prompts = derived_prompts(args.derive, args.out, tokenizer, args.limit or 1000)
        source = {"prompts": f"derived:{args.derive}", "filter": {"limit": args.limit}}
    prompts, dropped = held_out(prompts, exclude)
    source["held_out"] = {"files": exclude, "dropped": dropped}
    if dropped:
        print(f"headstart: {dropped} prompt(s) held out (tuning and evaluation prompts)", file=sys.stderr)
    if args.compare_backends:
        result = compare_backends(model, tokenizer, prompts, args.out, args.max_new_tokens, args.batch_size)
        print(json.dumps(result, indent=2))
        (Path(args.out) / "compare.json").write_text(json.dumps(result, indent=2))
        return 0
    given = (model, tokenizer, prompts, args.out, args.max_new_tokens, args.temperature)  # what both ways answer
    if args.engine:
        from headstart.train.distill_remote import distill_with_engine

        stats = distill_with_engine(
            args.engine,
            *given,
            args.concurrency,
            args.seed,
            args.retries,
            check_model=not args.no_model_check,
            api_key=common.given_api_key(args),
        )
    else:
        background.register(f"distill -> {args.out}")  # benchmarks stop it while they measure
        stats = distill(
            *given,
            args.batch_size,
            seed=args.seed,
            backend=args.backend,
            skip_ids=answered_ids(args.also),
            prepack=not args.no_prepack,
            source=source,
        )
    summary = (
        f"distilled {stats['new_rows']} new rows ({stats['rows']} in {args.out}): {stats['new_tokens']} tokens "
        f"in {stats['seconds']:.0f} s, {stats['tokens_per_s']:.0f} tokens/s"
    )
    print(summary, file=sys.stderr)
    return 0


def cmd_magpie(args: argparse.Namespace, argv: list[str]) -> int:
    from headstart.runtime.models import load_model
    from headstart.train.magpie import MagpieError, magpie, protected_texts

    if args.temperature <= 0:
        raise common.UserError(f"--temperature must be > 0 (every turn alike otherwise), got {args.temperature}")
    if Path(args.out).is_dir():
        raise common.UserError(f"--out {args.out} is a folder: give a JSONL file")
    protected = protected_texts([f for f in HELD_OUT if Path(f).is_file()], args.prompts)
    model, tokenizer = load_model(args.model, args.dtype, args.device)
    background.register(f"magpie -> {args.out}")  # benchmarks stop it while they measure
    try:
        stats = magpie(
            model,
            tokenizer,
            args.out,
            args.count,
            protected,
            seed=args.seed,
            batch_size=args.batch_size,
            max_prompt_tokens=args.max_prompt_tokens,
            temperature=args.temperature,
        )
    except MagpieError as e:
        raise common.UserError(str(e)) from None
    refused = ", ".join(f"{n} {why}" for why, n in sorted(stats["refused"].items(), key=lambda kv: -kv[1]))
    print(
        f"{stats['prompts']} prompts in {args.out}; this run sampled {stats['sampled']}, refused {refused or 'none'}",
        file=sys.stderr,
    )
    return 0


def cmd_drift(args: argparse.Namespace, argv: list[str]) -> int:
    from headstart.heads.checkpoint import CheckpointConfig
    from headstart.runtime.engine import Engine
    from headstart.train.drift import held_out_prompts, measure_drift, save_drift, summarize_drift

    heads = CheckpointConfig.find(args.adapter)  # Medusa-2 heads hold their adapter; a bare adapter names no target
    trained_for = heads.target.get("name") if heads is not None else None
    model = args.model or trained_for or DEFAULT_MODEL
    engine = Engine.load(model, args.dtype, "none", args.device, adapter=args.adapter, merge_adapter=False)
    if args.prompts:
        prompts = [engine.encode(p.text) for p in load_prompts(args.prompts, limit=args.limit)]
    else:
        prompts = held_out_prompts(args.adapter, args.limit, args.data)
    results = measure_drift(engine, prompts, args.max_new_tokens)
    summary = summarize_drift(results)
    meta = {"command": "headstart " + " ".join(argv), "model": model, "adapter": args.adapter, "dtype": args.dtype}
    path = save_drift(results, summary, Path(args.out), meta)
    print(json.dumps(summary, indent=2))
    print(f"results: {path}", file=sys.stderr)
    return 0


def cmd_report(args: argparse.Namespace, argv: list[str]) -> int:
    from headstart.train.report import draw_report

    print(draw_report(args.runs, args.out, args.x))
    return 0

"""The `headstart` command (generate, bench, distill, report, serve, loadtest, demo): the composition root.

This is the one module that imports every part (heads, runtime, train). At the top it imports only what
the parser needs, so `headstart --help` loads no torch; each subcommand imports its own needs.
A user error gets one line and exit 2, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

from headstart import __version__
from headstart.extras import COMMANDS, MissingExtraError, require
from headstart.runtime.demo import DEFAULT_DRAFTER
from headstart.runtime.drafters.registry import names, option_names, parse_spec
from headstart.runtime.models import DEFAULT_MODEL, DTYPES
from headstart.runtime.profiles import PROFILES
from headstart.runtime.prompts import SPEC_BENCH, TEST_PROMPTS, Prompt, load_prompts
from headstart.train.distill import BACKENDS, DERIVED

# CLI flag of each drafter option (registry.option_names): the flags users type, named in errors.
FLAGS = {"heads": "--heads", "budget": "--tree-budget", "depth": "--tree-depth", "top_k": "--tree-top-k",
         "draft_vocab": "--draft-vocab", "draft_model": "--draft-model", "draft_layers": "--draft-layers",
         "allow_adapter_mismatch": "--allow-adapter-mismatch"}  # fmt: skip


class UserError(Exception):
    """Bad input: reported as one line, never a traceback."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own errors: one line too
        raise UserError(message)


def _add_model_args(p: argparse.ArgumentParser, dtype: str) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="embedded name, HF model directory or .gguf file")
    p.add_argument("--dtype", default=dtype, choices=list(DTYPES))
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ...")


def _add_prepack_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-prepack", action="store_true",
                   help="keep the stock linear kernels (default: prepacked on a CPU; docs/tuning.md)")  # fmt: skip


def _add_adapter_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--adapter", default=None, metavar="DIR",
                   help="a peft LoRA adapter directory applied on top of --model, merged into its weights")  # fmt: skip
    p.add_argument("--no-merge", action="store_true",
                   help="--adapter: keep the adapter live instead of merging it (slower, the same output)")  # fmt: skip


def _add_profile_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", default=None, choices=list(PROFILES),
                   help=f"drafter defaults tuned for a model and machine (default: the model's own; {DEFAULT_MODEL} "
                   "uses smollm2-135m-cpu, other models neutral; docs/tuning.md)")  # fmt: skip


def _add_tree_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tree-depth", type=_at_least_one, default=None, help="eagle, eagle3, model, layerskip: drafting depth"
    )
    p.add_argument("--tree-top-k", type=_at_least_one, default=None,
                   help="eagle, eagle3, model, layerskip: nodes expanded per depth and children per node "
                   "(model, layerskip: 1 = a chain, their default)")  # fmt: skip
    p.add_argument("--draft-vocab", type=_at_least_one, default=None, metavar="N",
                   help="medusa, eagle, eagle3: read out only the N most frequent draft tokens")  # fmt: skip
    p.add_argument("--draft-model", default=None, help="model drafter: a small causal LM with the same tokenizer")
    p.add_argument("--draft-layers", default=None, help="layerskip drafter: N first layers, or a list 0,1,2,5")
    p.add_argument("--allow-adapter-mismatch", action="store_true", default=None,
                   help="run heads trained for another LoRA adapter, or none (exact; acceptance may drop)")  # fmt: skip


def _add_drafter_args(p: argparse.ArgumentParser, default: str = "none") -> None:
    p.add_argument("--drafter", default=default, metavar="SPEC",
                   help=f"{', '.join(names())}; NAME:VALUE sets its first option (medusa:16, layerskip:8); "
                   f"+lookup grafts prompt-lookup branches onto the tree (default {default})")  # fmt: skip
    p.add_argument("--heads", default=None, help="trained heads directory (default: the shipped ones, if any)")
    p.add_argument("--tree-budget", type=_at_least_one, default=None,
                   help="nodes per tree (default: the drafter's, from the profile)")  # fmt: skip
    _add_tree_args(p)
    _add_profile_arg(p)


def _has_cuda() -> bool:
    """Whether a CUDA device is visible, without importing torch (which help must not load)."""
    return os.environ.get("CUDA_VISIBLE_DEVICES", "x") != "" and Path("/dev/nvidiactl").exists()


def _seed(text: str) -> int:
    """A torch seed: 0 .. 2**63 - 2 (drafters seed their own stream with seed + 1)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if not 0 <= value <= 2**63 - 2:
        raise argparse.ArgumentTypeError(f"must be in 0 .. 2**63 - 2, got {value}")
    return value


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _flag_values(args: argparse.Namespace, keys) -> dict:
    """{option: the value of its flag (FLAGS), None where the subcommand has no such flag or it was not given}."""
    return {key: getattr(args, FLAGS[key][2:].replace("-", "_"), None) for key in keys}


def _drafter_options(args: argparse.Namespace, spec: str) -> dict:
    """The drafter flags given on the command line, as options of `spec`; a flag it does not take is an error."""
    options = {k: v for k, v in _flag_values(args, FLAGS).items() if v is not None}
    refused = [FLAGS[k] for k in options if k not in option_names(spec)]
    if refused:
        raise UserError(f"--drafter {spec} does not take {', '.join(refused)}")
    return options


def _load_engine(args: argparse.Namespace):
    from headstart.runtime.engine import Engine

    options = _drafter_options(args, args.drafter)  # checked before the model loads
    return Engine.load(args.model, args.dtype, args.drafter, args.device, args.profile, args.adapter,
                       not args.no_merge, not args.no_prepack, **options)  # fmt: skip


def _sampling(temperature: float, top_k: int = 0, top_p: float = 1.0):
    from headstart.runtime.sampling import SamplingParams

    try:
        return SamplingParams(temperature, top_k, top_p)
    except ValueError as e:
        raise UserError(str(e).replace("top_", "--top-").replace("temperature", "--temperature")) from e


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="headstart", description="Exact self-speculative decoding.")
    parser.add_argument("--version", action="version", version=f"headstart {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="generate text for one prompt or a prompt file")
    _add_model_args(g, "float32")
    _add_prepack_arg(g)
    _add_adapter_args(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompts-file", help="JSONL rows with 'turns' (the first turn is used) or 'prompt'")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    _add_drafter_args(g)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    g.add_argument("--seed", type=_seed, default=0)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--json", action="store_true", help="print one JSON object per prompt")

    b = sub.add_parser("bench", help="tokens/s, speedup and acceptance length of decoding methods")
    _add_model_args(b, "bfloat16")
    _add_prepack_arg(b)
    _add_adapter_args(b)
    b.add_argument("--prompts", default=None, help=f"JSONL prompt file (default: Spec-Bench at {SPEC_BENCH})")
    b.add_argument("--methods", default="plain,hf,lookup",
                   help="comma list: plain, hf, hf-lookup (transformers' generate) and drafter specs: "
                   f"{', '.join(names())}; NAME:VALUE variants such as medusa:16, layerskip:8, model:PATH")  # fmt: skip
    b.add_argument("--medusa-heads", default=None, help="Medusa heads directory (default: shipped)")
    b.add_argument("--eagle-heads", default=None, help="EAGLE head directory (default: shipped)")
    b.add_argument("--eagle3-heads", default=None, help="EAGLE-3 head directory (default: shipped)")
    b.add_argument("--medusa2-heads", default=None,
                   help="Medusa-2 heads directory (default: shipped); run on --model + their adapter")  # fmt: skip
    b.add_argument("--heads", action="append", default=None, metavar="LABEL=DIR",
                   help="compare heads side by side (repeatable): each method of their kind runs as METHOD@LABEL, "
                   "beside METHOD@shipped; DIR: headstart heads or a published layout (Medusa, EAGLE, "
                   "EAGLE-3)")  # fmt: skip
    _add_tree_args(b)
    _add_profile_arg(b)
    b.add_argument("--temperature", default="0", help="comma list of temperatures")
    b.add_argument("--categories", default=None, help="comma list (default: all six; mt_bench = the 8 of MT-bench)")
    b.add_argument("--limit-per-category", type=int, default=None)
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--seed", type=_seed, default=0)
    b.add_argument("--out", default="bench-results", help="folder for the JSON records and Markdown table")
    b.add_argument(
        "--breakdown",
        action="store_true",
        help="also time each phase of a round (draft, mask, layers, lm_head, accept, commit ...): a table",
    )
    b.add_argument(
        "--breakdown-doc",
        default=None,
        metavar="FILE",
        help="--breakdown: also write the table into FILE (docs/tuning.md), a section per dtype",
    )
    b.add_argument("--report-to", default="none", choices=("none", "wandb"),
                   help="also log the figures to W&B (offline without WANDB_API_KEY; `wandb sync` later)")  # fmt: skip

    ds = sub.add_parser("distill", help="self-distillation: the target answers training prompts (resumable)")
    _add_model_args(ds, "bfloat16")
    _add_adapter_args(ds)
    ds.add_argument("--prompts", default="../shared/data/train/prompts.jsonl", help="JSONL rows with 'turns'")
    ds.add_argument("--out", required=True, help="folder for the JSONL shards (resumes if it has some)")
    ds.add_argument("--permissive-only", action="store_true", help="only rows with permissive: true")
    ds.add_argument("--derive", default=None, choices=tuple(DERIVED),
                    help="instead of --prompts: prompts of this task over the answers already in --out")  # fmt: skip
    ds.add_argument("--limit", type=int, default=None, help="first N usable prompts")
    ds.add_argument("--max-new-tokens", type=int, default=256)
    ds.add_argument("--temperature", type=float, default=0.0)
    ds.add_argument("--batch-size", type=int, default=64, help="sequences decoded together")
    ds.add_argument("--backend", default="batched", choices=BACKENDS,
                    help="batched: continuous batching (default); hf: transformers' generate")  # fmt: skip
    ds.add_argument("--compare-backends", action="store_true",
                    help="benchmark: answer the prompts with both backends (T = 0) into OUT/hf and OUT/batched, "
                    "print both rates and how many rows agree")  # fmt: skip
    ds.add_argument("--also", action="append", default=[], metavar="DIR",
                    help="distilled folders beside --out: ids in them are not answered again (repeatable)")  # fmt: skip
    ds.add_argument("--exclude", action="append", default=None, metavar="FILE",
                    help="prompt files held out of distillation, by id, source id or text (repeatable; default: "
                    "configs/tune-prompts.jsonl, configs/tune-derived.jsonl and Spec-Bench where present)")  # fmt: skip
    ds.add_argument("--no-prepack", action="store_true", help="stock linear kernels (runtime/kernels.py)")
    ds.add_argument("--engine", default=None, metavar="URL",
                    help="answer on this OpenAI-compatible server (vLLM, SGLang, headstart serve), not locally; "
                    "--model is the target it must serve (checked on a probe prompt)")  # fmt: skip
    ds.add_argument("--concurrency", type=_at_least_one, default=16, help="--engine: requests in flight")
    ds.add_argument("--api-key", default=None, metavar="KEY",
                    help="--engine: the server's key (default: $HEADSTART_API_KEY)")  # fmt: skip
    ds.add_argument("--retries", type=int, default=5, help="--engine: retries of a failed request, with backoff")
    ds.add_argument(
        "--no-model-check", action="store_true", help="--engine: skip the probe that the server serves --model"
    )
    ds.add_argument("--seed", type=_seed, default=0)

    dr = sub.add_parser("drift", help="how far a LoRA adapter (Medusa-2 heads' own) moves the model's answers")
    dr.add_argument("adapter", help="a peft LoRA adapter directory, or Medusa-2 heads (which hold theirs)")
    dr.add_argument("--model", default=None, help="the base model (default: the one the heads were trained for)")
    dr.add_argument("--dtype", default="float32", choices=DTYPES)
    dr.add_argument("--device", default="cpu")
    dr.add_argument("--prompts", default=None,
                    help="JSONL prompt file (default: the prompts the heads' training run held out)")  # fmt: skip
    dr.add_argument("--data", default=None, help="the training run's distilled data, if it moved")
    dr.add_argument("--limit", type=_at_least_one, default=20, help="prompts")
    dr.add_argument("--max-new-tokens", type=_at_least_one, default=128)
    dr.add_argument("--out", default="bench-results", help="folder for the JSON results")

    r = sub.add_parser("report", help="per-head training curves of several runs in one PNG")
    r.add_argument("runs", nargs="+", help="training output directories (with metrics.jsonl)")
    r.add_argument("--out", default="report.png")

    sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (one request at a time, FIFO queue)")
    _add_model_args(sv, "bfloat16")
    _add_prepack_arg(sv)
    _add_adapter_args(sv)
    _add_drafter_args(sv)
    sv.add_argument("--served-model-name", default=None,
                    help="the `model` clients pass (default: --model's last path part, never a path)")  # fmt: skip
    sv.add_argument("--max-body-mb", type=float, default=None, help="largest request body, larger gets 413 (default 4)")
    sv.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1/ routes (default: $HEADSTART_API_KEY, else none)",
    )
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
    lt.add_argument("--api-key", default=None, metavar="KEY", help="the server's key (default: $HEADSTART_API_KEY)")
    lt.add_argument("--clients", default="1,4,16", help="comma list of concurrency levels")
    lt.add_argument("--requests-per-client", type=int, default=2)
    lt.add_argument("--max-tokens", type=int, default=64)
    lt.add_argument("--prompts", default=None, help=f"JSONL prompt file (default: Spec-Bench at {SPEC_BENCH})")
    lt.add_argument("--out", default=None, help="also write the results as JSON here")
    lt.add_argument("--soak", type=float, default=None, metavar="SECONDS",
                    help="instead: a soak of valid, malformed, disconnecting and oversized requests from --clients "
                    "clients (one level) for SECONDS; counts by kind and status, /health p99, server RSS")  # fmt: skip

    ex = sub.add_parser("export", help="write trained EAGLE-3 heads in the layout vLLM and SGLang load")
    ex.add_argument("heads", help="trained heads directory (a training run's output_dir/heads)")
    ex.add_argument("out", help="a new (or empty) folder to write")
    ex.add_argument("--format", default="specforge", choices=("specforge", "speculators"),
                    help="specforge: the EAGLE-3 layout vLLM and SGLang load (default); speculators: vLLM's "
                    "self-describing twin (`vllm serve OUT`)")  # fmt: skip
    ex.add_argument("--target", default=None,
                    help="the target's path or hub name the commands and the speculators config name (default: the "
                    "model the heads were trained for; an embedded name becomes its local directory)")  # fmt: skip

    cv = sub.add_parser("convert", help="write published Medusa / EAGLE / EAGLE-3 heads as headstart heads")
    cv.add_argument("src", help="the published heads' folder (Medusa authors', EAGLE authors', SpecForge, speculators)")
    cv.add_argument("out", help="a new (or empty) folder to write")
    cv.add_argument("--model", default=DEFAULT_MODEL,
                    help="the target the heads draft for (embedded name, HF model directory or .gguf file): its "
                    "fingerprint is written with them")  # fmt: skip

    cb = sub.add_parser(
        "calibrate", help="measure heads' per-rank accuracies on your prompts (what trees are shaped from)"
    )
    cb.add_argument("heads", help="a headstart heads directory (`headstart convert` published heads first)")
    cb.add_argument("--prompts", required=True, help="JSONL prompt file (chat prompts, as serving sees them)")
    _add_model_args(cb, "float32")
    cb.add_argument("--limit", type=_at_least_one, default=64, help="prompts to answer (default 64)")
    cb.add_argument("--max-new-tokens", type=_at_least_one, default=128)

    ck = sub.add_parser("check", help="a device check: float32 greedy identity of every drafter, then a short bench")
    ck.add_argument("--model", default=DEFAULT_MODEL, help="embedded name, HF model directory or .gguf file")
    ck.add_argument("--device", default="cuda" if _has_cuda() else "cpu", help="cuda, cpu ...")
    ck.add_argument("--prompts", default=TEST_PROMPTS, help="JSONL prompt file (default: the project's test prompts)")
    ck.add_argument("--max-new-tokens", type=_at_least_one, default=48)
    ck.add_argument("--out", default="bench-results", help="folder for the bench records")

    d = sub.add_parser("demo", help="plain vs speculative decoding on built-in prompts")
    _add_model_args(d, "float32")
    _add_prepack_arg(d)
    d.add_argument("--max-new-tokens", type=int, default=128)
    d.add_argument("--drafter", default=DEFAULT_DRAFTER, metavar="SPEC",
                   help=f"the speculative side: {', '.join(names())} (trained ones use the heads shipped for "
                   f"--model; default {DEFAULT_DRAFTER})")  # fmt: skip
    _add_profile_arg(d)
    return parser


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> str:
    return f"headstart: warning: {message}\n"


def main(argv: Sequence[str] | None = None) -> int:
    warnings.formatwarning = _one_line_warning  # what a user reads is the message, not the line that warned
    try:
        args = build_parser().parse_args(argv)
        if args.command in COMMANDS:
            require(COMMANDS[args.command], f"headstart {args.command}")
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "bench":
            return cmd_bench(args, list(argv) if argv is not None else sys.argv[1:])
        if args.command == "distill":
            return cmd_distill(args)
        if args.command == "drift":
            return cmd_drift(args, list(argv) if argv is not None else sys.argv[1:])
        if args.command == "report":
            from headstart.train.report import draw_report

            print(draw_report(args.runs, args.out))
            return 0
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "loadtest":
            return cmd_loadtest(args)
        if args.command == "export":
            from headstart.heads.export import export_heads
            from headstart.runtime.models import DEFAULT_MODEL, resolve_model_dir

            def target_path(name: str) -> str:
                return str(resolve_model_dir(name)) if name == DEFAULT_MODEL else name

            print(export_heads(args.heads, args.out, args.format, args.target, resolve=target_path))
            return 0
        if args.command == "convert":
            from headstart.heads.published import convert_heads
            from headstart.runtime.models import load_model

            model, tokenizer = load_model(args.model)
            print(convert_heads(args.src, args.out, model, tokenizer))
            return 0
        if args.command == "calibrate":
            return cmd_calibrate(args)
        if args.command == "check":
            from headstart.runtime.check import run_check

            if not Path(args.prompts).is_file():
                raise UserError(f"prompts file not found: {args.prompts} (run from a checkout, or pass --prompts FILE)")
            return run_check(args.model, args.device, args.prompts, max_new_tokens=args.max_new_tokens, out=args.out)
        if args.command == "demo":
            from headstart.runtime.demo import run_demo

            parse_spec(args.drafter)
            return run_demo(args.model, args.dtype, args.device, args.max_new_tokens, args.drafter, args.profile,
                            not args.no_prepack)  # fmt: skip
    except (UserError, ValueError, MissingExtraError) as e:
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
    sampling = _sampling(args.temperature, args.top_k, args.top_p)
    if args.prompt is not None:
        if not args.prompt.strip():
            raise UserError("empty --prompt")
        prompts = [Prompt("0", "", args.prompt)]
    else:
        prompts = load_prompts(args.prompts_file)

    from headstart.runtime.generate import GenerationStats

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


def served_name(model: str, given: str | None) -> str:
    """The id clients pass as `model`: `given`, else the last part of --model (never a filesystem path)."""
    return given or Path(model.rstrip("/")).name.removesuffix(".gguf")


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else $HEADSTART_API_KEY, else None."""
    return args.api_key or os.environ.get("HEADSTART_API_KEY") or None


def cmd_serve(args: argparse.Namespace) -> int:
    import dataclasses

    import uvicorn

    from headstart.runtime.server.app import ServeConfig, build_app

    if not 0 < args.port < 65536:
        raise UserError(f"--port must be in 1..65535, got {args.port}")
    for flag, value in (("--max-queue", args.max_queue), ("--time-limit", args.time_limit)):
        if value is not None and value <= 0:
            raise UserError(f"{flag} must be > 0, got {value}")
    if args.step_aside_queue is not None and args.step_aside_queue < 0:
        raise UserError(f"--step-aside-queue must be >= 0, got {args.step_aside_queue}")
    options = {"max_queue": args.max_queue, "time_limit_s": args.time_limit, "step_aside_queue": args.step_aside_queue,
               "min_acceptance": args.min_acceptance}  # fmt: skip
    if args.max_body_mb is not None:
        if args.max_body_mb <= 0:
            raise UserError(f"--max-body-mb must be > 0, got {args.max_body_mb}")
        options["max_body_bytes"] = int(args.max_body_mb * (1 << 20))
    config = ServeConfig(served_name(args.model, args.served_model_name),
                         **{k: v for k, v in options.items() if v is not None})  # fmt: skip
    api_key = _api_key(args)
    if api_key is None and args.host not in LOOPBACK:
        print(f"headstart: warning: serving on {args.host} without an API key: anyone who reaches it can use it "
              "(--api-key or HEADSTART_API_KEY)", file=sys.stderr)  # fmt: skip
    engine = _load_engine(args)
    auth = "an API key required" if api_key else "no API key"
    print(f"headstart: serving {config.model_name} on http://{args.host}:{args.port}/v1, {auth} "
          f"({dataclasses.asdict(config)})", file=sys.stderr)  # fmt: skip
    uvicorn.run(build_app(engine, config, api_key), host=args.host, port=args.port, log_level="info")
    return 0


def cmd_loadtest(args: argparse.Namespace) -> int:
    from pathlib import Path

    import httpx

    from headstart.runtime.server import loadtest

    try:
        levels = [int(c) for c in args.clients.split(",")]
    except ValueError as e:
        raise UserError(f"--clients takes a comma list of integers: {e}") from e
    if min(levels) < 1 or args.requests_per_client < 1 or args.max_tokens < 1:
        raise UserError("--clients, --requests-per-client and --max-tokens must be >= 1")
    prompts = [p.text for p in load_prompts(_bench_prompts(args.prompts))]
    api_key = _api_key(args)
    try:
        health = httpx.get(args.url.rstrip("/") + "/health", timeout=10).json()
    except (httpx.HTTPError, ValueError) as e:
        raise UserError(f"no headstart server at {args.url}: {e}") from e
    if args.soak is not None:
        result = loadtest.soak(args.url, health["model"], prompts, args.soak, max(levels), api_key=api_key)
        print(json.dumps(result, indent=2))
        if args.out:
            Path(args.out).write_text(json.dumps({"server": health, "soak": result}, indent=2))
        return 0
    rows = [loadtest.run_level(args.url, health["model"], prompts, c, args.requests_per_client, args.max_tokens,
                               api_key) for c in levels]  # fmt: skip
    print(loadtest.markdown(rows, health["drafter"]))
    if args.out:
        Path(args.out).write_text(json.dumps({"server": health, "levels": rows}, indent=2))
    return 0


HELD_OUT = ("configs/tune-prompts.jsonl", "configs/tune-derived.jsonl", SPEC_BENCH)  # never distilled


def cmd_distill(args: argparse.Namespace) -> int:
    from headstart.runtime.models import load_model
    from headstart.train.distill import compare_backends, derived_prompts, distill
    from headstart.train.sources import answered_ids, file_sha, held_out

    _check_lengths(args)
    _sampling(args.temperature)
    if args.batch_size < 1 or (args.limit is not None and args.limit < 1):
        raise UserError("--batch-size and --limit must be >= 1")
    if args.retries < 0:
        raise UserError(f"--retries must be >= 0, got {args.retries}")
    for folder in args.also:
        if not Path(folder).is_dir():
            raise UserError(f"--also {folder}: no such folder")
    exclude = args.exclude if args.exclude is not None else [f for f in HELD_OUT if Path(f).is_file()]
    for f in exclude:
        if not Path(f).is_file():
            raise UserError(f"--exclude {f}: no such file")
    if args.derive is None:
        prompts = load_prompts(args.prompts, permissive_only=args.permissive_only, limit=args.limit,
                               skip_malformed=True)  # fmt: skip
        source = {"prompts": args.prompts, "prompts_sha": file_sha(args.prompts),
                  "filter": {"permissive_only": args.permissive_only, "limit": args.limit}}  # fmt: skip
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
    if args.engine:
        from headstart.train.engine import distill_with_engine

        stats = distill_with_engine(args.engine, model, tokenizer, prompts, args.out, args.max_new_tokens,
                                    args.temperature, args.concurrency, args.seed, args.retries,
                                    check_model=not args.no_model_check,
                                    api_key=_api_key(args))  # fmt: skip
    else:
        stats = distill(model, tokenizer, prompts, args.out, args.max_new_tokens, args.temperature, args.batch_size,
                        seed=args.seed, backend=args.backend, skip_ids=answered_ids(args.also),
                        prepack=not args.no_prepack, source=source)  # fmt: skip
    print(
        f"distilled {stats['new_rows']} new rows ({stats['rows']} in {args.out}): {stats['new_tokens']} tokens "
        f"in {stats['seconds']:.0f} s, {stats['tokens_per_s']:.0f} tokens/s",
        file=sys.stderr,
    )
    return 0


def _bench_prompts(path: str | None) -> str:
    """The prompt file of bench and loadtest: `path`, else Spec-Bench where a checkout keeps it."""
    from pathlib import Path

    if path is not None:
        if not Path(path).is_file():
            raise UserError(f"prompts file not found: {path}")
        return path
    if not Path(SPEC_BENCH).is_file():
        raise UserError(
            f"no --prompts and no Spec-Bench at {SPEC_BENCH}: get question.jsonl from "
            "https://github.com/hemingkx/Spec-Bench (data/spec_bench/question.jsonl) and pass --prompts FILE"
        )
    return SPEC_BENCH


def cmd_drift(args: argparse.Namespace, argv: list[str]) -> int:
    from headstart.heads.checkpoint import HeadsConfig
    from headstart.runtime.engine import Engine
    from headstart.train.drift import held_out_prompts, measure_drift, save_drift, summarize_drift

    heads = HeadsConfig.find(args.adapter)  # Medusa-2 heads hold their adapter; a bare adapter names no target
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


def cmd_calibrate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from headstart.heads.checkpoint import HeadsConfig, load_heads, save_config
    from headstart.heads.published import detect_layout
    from headstart.runtime.drafters.options import EagleOptions
    from headstart.runtime.engine import Engine
    from headstart.runtime.tokens import cut_at_eos, pad_id
    from headstart.train.data import Row
    from headstart.train.evaluate import MEDUSA_KINDS, measure

    if detect_layout(args.heads) != "headstart":
        raise UserError(f"{args.heads} holds published heads: `headstart convert {args.heads} OUT` first, then "
                        "calibrate OUT")  # fmt: skip
    config = HeadsConfig.read(args.heads)
    if not Path(args.prompts).is_file():
        raise UserError(f"prompts file not found: {args.prompts}")
    prompts = load_prompts(args.prompts)[: args.limit]
    adapter = args.heads if config.kind == "medusa2" else None  # Medusa-2 heads draft for base + their adapter
    engine = Engine.load(args.model, args.dtype, "none", args.device, adapter=adapter)
    heads, _ = load_heads(args.heads, engine.target.model, engine.tokenizer)
    rows = []
    for i, prompt in enumerate(tqdm(prompts, desc="answer", unit="prompt", dynamic_ncols=True)):
        ids = engine.encode(prompt.text)
        answer = cut_at_eos(engine.generate(ids, max_new_tokens=args.max_new_tokens).token_ids, engine.eos_ids)
        rows.append(Row(ids + answer, len(ids), i, prompt.id))
    depths = heads.num_heads if config.kind in MEDUSA_KINDS else EagleOptions().depth
    metrics, accuracy = measure(config.kind, heads.float(), engine.target.model, rows, depths, pad_id(engine.tokenizer))
    calibrated = {"prompts": str(args.prompts), "answers": len(rows), "max_new_tokens": args.max_new_tokens,
                  "metrics": metrics}  # fmt: skip
    save_config(args.heads, dataclasses.replace(config, rank_accuracy=accuracy,
                                                extra={**config.extra, "calibrated_on": calibrated}))  # fmt: skip
    print(f"acceptance length {metrics['acceptance_length']:.2f}; top-1 per depth "
          + ", ".join(f"{a[0]:.3f}" for a in accuracy))  # fmt: skip
    return 0


def _labelled_heads(entries: list[str]) -> dict[str, str]:
    """--heads LABEL=DIR entries as {label: directory}."""
    labelled = {}
    for entry in entries:
        label, eq, directory = entry.partition("=")
        if not eq or not label or not directory or any(c in label for c in "@,= "):
            raise UserError(f"--heads takes LABEL=DIR (a label without @ , = or spaces), got {entry!r}")
        if label in labelled:
            raise UserError(f"--heads: the label {label} is given twice")
        labelled[label] = directory
    return labelled


def cmd_bench(args: argparse.Namespace, argv: list[str]) -> int:
    import platform
    from pathlib import Path

    import torch

    from headstart.runtime import bench
    from headstart.runtime.engine import Engine

    _check_lengths(args)
    try:
        temperatures = [float(t) for t in args.temperature.split(",")]
    except ValueError as e:
        raise UserError(f"--temperature takes a comma list of numbers: {e}") from e
    for t in temperatures:
        _sampling(t)
    if args.limit_per_category is not None and args.limit_per_category < 1:
        raise UserError("--limit-per-category must be >= 1")
    if args.breakdown_doc and not args.breakdown:
        raise UserError("--breakdown-doc needs --breakdown")
    prompts = _bench_prompts(args.prompts)
    categories = set(args.categories.split(",")) if args.categories else None
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    options = _flag_values(args, [k for k in FLAGS if k not in ("heads", "budget")])
    options["heads"] = {"medusa": args.medusa_heads, "eagle": args.eagle_heads, "eagle3": args.eagle3_heads,
                        "medusa2": args.medusa2_heads}  # fmt: skip
    labelled = _labelled_heads(args.heads or [])
    methods = bench.label_methods(methods, labelled, args.model)
    unused = sorted(set(labelled) - {m.partition(bench.LABEL_SEP)[2] for m in methods})
    if unused:
        raise UserError(f"--heads {unused[0]}=...: no method in --methods runs heads of its kind")
    options["labelled_heads"] = labelled
    bench.method_options(methods, options)  # every method and option checked before the model loads
    engine = Engine.load(args.model, args.dtype, "none", args.device, args.profile, args.adapter, not args.no_merge,
                         not args.no_prepack)  # fmt: skip
    records = bench.run_bench(engine, prompts, methods, temperatures, args.max_new_tokens, args.limit_per_category,
                              categories, args.seed, args.breakdown, **options)  # fmt: skip
    table = bench.summarize(records)
    packed = engine.target.packed
    machine = (
        f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"{args.dtype}, {args.device}, model {args.model}, kernels {packed.kind} (packed in {packed.seconds:.2f} s)"
    )
    meta = {"command": "headstart " + " ".join(argv), "machine": machine}
    json_path, md_path, png_path = bench.save(records, table, Path(args.out), meta)
    print(bench.markdown(table))
    print(f"records: {json_path}\ntable: {md_path}\nchart: {png_path}", file=sys.stderr)
    if args.breakdown:
        text = (f"`{meta['command']}`\n\n{machine}; ms per round (prefill left out)\n\n"
                + bench.breakdown_markdown(records))  # fmt: skip
        print(text)
        md_path.with_name(md_path.stem + "-breakdown.md").write_text(text)
        if args.breakdown_doc:
            bench.replace_section(Path(args.breakdown_doc), f"breakdown {args.dtype}", text)
    if args.report_to == "wandb":
        print(bench.report_wandb(table, meta, Path(args.out), run_name=json_path.stem), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

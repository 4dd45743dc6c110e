"""What every subcommand shares: the one-line user error, the parser class, argument groups and checks."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from headstart.runtime.drafters.options import HEAD_DTYPES, GraftOptions
from headstart.runtime.drafters.registry import names, option_names
from headstart.runtime.models import DEFAULT_MODEL, DTYPES
from headstart.runtime.profiles import PROFILES

# Where a checkout keeps prompt files (the command line's defaults; the library has none):
SPEC_BENCH = "../shared/data/eval/spec_bench.jsonl"  # Spec-Bench's question.jsonl (hemingkx/Spec-Bench)
TEST_PROMPTS = "tests/data/prompts.jsonl"  # 32 prompts written for this project (tests/data/README.md)

# CLI flag of each drafter option (registry.option_names): the flags users type, named in errors.
FLAGS = {
    "heads": "--heads",
    "budget": "--tree-budget",
    "graft_budget": "--graft-budget",
    "depth": "--tree-depth",
    "top_k": "--tree-top-k",
    "draft_vocab": "--draft-vocab",
    "draft_model": "--draft-model",
    "draft_layers": "--draft-layers",
    "allow_adapter_mismatch": "--allow-adapter-mismatch",
    "draft_temperature": "--draft-temperature",
    "head_dtype": "--head-dtype",
    "pool_tokens": "--suffix-pool-tokens",
}


class UserError(Exception):
    """Bad input: reported as one line, never a traceback."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own errors: one line too
        raise UserError(message)


def add_model_args(p: argparse.ArgumentParser, dtype: str) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="embedded name, HF model directory or .gguf file")
    p.add_argument("--dtype", default=dtype, choices=list(DTYPES))
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ...")


def add_prepack_arg(p: argparse.ArgumentParser) -> None:
    kernels = "keep the stock linear kernels (default: prepacked on a CPU; docs/tuning.md)"
    p.add_argument("--no-prepack", action="store_true", help=kernels)


def add_adapter_args(p: argparse.ArgumentParser) -> None:
    merged = "a peft LoRA adapter directory applied on top of --model, merged into its weights"
    p.add_argument("--adapter", default=None, metavar="DIR", help=merged)
    live = "--adapter: keep the adapter live instead of merging it (slower, the same output)"
    p.add_argument("--no-merge", action="store_true", help=live)


def add_profile_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--profile",
        default=None,
        choices=list(PROFILES),
        help=f"drafter defaults tuned for a model and machine (default: the model's own; {DEFAULT_MODEL} "
        "uses smollm2-135m-cpu, other models neutral; docs/tuning.md)",
    )


def add_tree_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tree-depth", type=at_least_one, default=None, help="eagle, eagle3, model, layerskip: drafting depth"
    )
    p.add_argument(
        "--tree-top-k",
        type=at_least_one,
        default=None,
        help="eagle, eagle3, model, layerskip: nodes expanded per depth and children per node "
        "(model, layerskip: 1 = a chain, their default)",
    )
    p.add_argument(
        "--draft-vocab",
        type=at_least_one,
        default=None,
        metavar="N",
        help="medusa, eagle, eagle3: read out only the N most frequent draft tokens",
    )
    p.add_argument(
        "--draft-temperature",
        type=float,
        default=None,
        metavar="F",
        help="medusa, eagle, eagle3 at T > 0: draw the guesses at the decode's temperature times F "
        "(< 1 sharpens the heads' q; exact at any F; default 1; docs/tuning.md)",
    )
    p.add_argument(
        "--head-dtype",
        default=None,
        choices=list(HEAD_DTYPES),
        help="eagle, eagle3: the head's dtype (default auto: greedy decodes draft in bfloat16 under a float32 "
        "target on a CPU with bf16 kernels, the rest in the target's; exact in any; docs/tuning.md)",
    )
    p.add_argument("--draft-model", default=None, help="model drafter: a small causal LM with the same tokenizer")
    p.add_argument("--draft-layers", default=None, help="layerskip drafter: N first layers, or a list 0,1,2,5")
    p.add_argument(
        "--allow-adapter-mismatch",
        action="store_true",
        default=None,
        help="run heads trained for another LoRA adapter, or none (exact; acceptance may drop)",
    )


# The one default drafter of generate, demo, bench and serve where a model has shipped EAGLE heads: the shipped EAGLE
# head's tree with the branches of the request's own prompt and of earlier finished requests (the suffix pool), sized
# by measured cost (and by load when serving). Served at one client, bf16: 1.27x eagle+lookup on the agent workload,
# 1.32x on extraction, 0.99x on held-out chat, which does not repeat (docs/benchmarks.md).
DEFAULT_DRAFTER = "eagle+suffix"
DEFAULT_DRAFTER_HELP = f"{DEFAULT_DRAFTER} for a model with shipped EAGLE heads, else none"


def default_drafter(model: str, adapter: str | None = None) -> str:
    """What a command decodes with when no --drafter is given: DEFAULT_DRAFTER, or plain for a model without shipped
    heads or with an adapter (the heads were trained on the base)."""
    from headstart.heads.checkpoint import shipped_heads

    return DEFAULT_DRAFTER if adapter is None and shipped_heads(model, "eagle") is not None else "none"


def add_drafter_args(p: argparse.ArgumentParser) -> None:
    """`--drafter` (None: `default_drafter`) and the tree's options."""
    p.add_argument(
        "--drafter",
        default=None,
        metavar="SPEC",
        help=f"{', '.join(names())}; NAME:VALUE sets its first option (medusa:16, layerskip:8); "
        f"+lookup grafts prompt-lookup branches onto the tree (default {DEFAULT_DRAFTER_HELP})",
    )
    p.add_argument("--heads", default=None, help="trained heads directory (default: the shipped ones, if any)")
    budget = "nodes per tree (default: the drafter's, from the profile)"
    p.add_argument("--tree-budget", type=at_least_one, default=None, help=budget)
    graft = f"X+lookup, X+suffix: the most lookup nodes grafted onto X's tree (default {GraftOptions().graft_budget})"
    p.add_argument("--graft-budget", type=at_least_one, default=None, metavar="N", help=graft)
    p.add_argument(
        "--suffix-pool-tokens",
        type=at_least_zero,
        default=None,
        metavar="N",
        help="X+suffix: tokens of finished requests kept to draft from (default 262144; 0: none)",
    )
    add_tree_args(p)
    add_profile_arg(p)


def has_cuda() -> bool:
    """Whether a CUDA device is visible, without importing torch (which help must not load)."""
    return os.environ.get("CUDA_VISIBLE_DEVICES", "x") != "" and Path("/dev/nvidiactl").exists()


def seed_value(text: str) -> int:
    """A torch seed: 0 .. 2**63 - 2 (drafters seed their own stream with seed + 1)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if not 0 <= value <= 2**63 - 2:
        raise argparse.ArgumentTypeError(f"must be in 0 .. 2**63 - 2, got {value}")
    return value


def at_least_one(text: str) -> int:
    return _int_at_least(text, 1)


def at_least_zero(text: str) -> int:
    return _int_at_least(text, 0)


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
    return value


def flag_values(args: argparse.Namespace, keys) -> dict:
    """{option: the value of its flag (FLAGS), None where the subcommand has no such flag or it was not given}."""
    return {key: getattr(args, FLAGS[key][2:].replace("-", "_"), None) for key in keys}


def drafter_options(args: argparse.Namespace, spec: str) -> dict:
    """The drafter flags given on the command line, as options of `spec`; a flag it does not take is an error."""
    options = {k: v for k, v in flag_values(args, FLAGS).items() if v is not None}
    refused = [FLAGS[k] for k in options if k not in option_names(spec)]
    if refused:
        raise UserError(f"--drafter {spec} does not take {', '.join(refused)}")
    return options


def load_engine(args: argparse.Namespace):
    from headstart.runtime.engine import Engine

    if args.drafter is None:
        args.drafter = default_drafter(args.model, args.adapter)
    options = drafter_options(args, args.drafter)  # checked before the model loads
    engine = Engine.load(
        args.model,
        args.dtype,
        args.drafter,
        args.device,
        args.profile,
        args.adapter,
        not args.no_merge,
        not args.no_prepack,
        **options,
    )
    if args.adapter is None and engine.adapter is not None:  # the target is not the model alone: say so
        print(
            f"headstart: the {args.drafter} heads carry the LoRA adapter they were trained with: the target is "
            f"{args.model} + {engine.adapter}",
            file=sys.stderr,
        )
    return engine


def sampling_params(temperature: float, top_k: int = 0, top_p: float = 1.0):
    from headstart.runtime.sampling import SamplingParams

    try:
        return SamplingParams(temperature, top_k, top_p)
    except ValueError as e:
        raise UserError(str(e).replace("top_", "--top-").replace("temperature", "--temperature")) from e


def check_lengths(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 0:
        raise UserError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")


def bench_prompts(path: str | None) -> str:
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


def given_api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else $HEADSTART_API_KEY, else None."""
    return args.api_key or os.environ.get("HEADSTART_API_KEY") or None


OPTION_FLAGS = {**FLAGS, "prompts": "--prompts", "model": "--model"}


def with_flags(message: str) -> str:
    """A library error, its options (written `name`) named by the flags a command-line user types."""
    for option, flag in OPTION_FLAGS.items():
        message = message.replace(f"`{option}`", flag)
    return message

"""`headstart bench` and `headstart check`: speed and exactness measured on prompt files."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from headstart.commands import common
from headstart.runtime.drafters.registry import names
from headstart.runtime.models import DEFAULT_MODEL
from headstart.runtime.sizing.policy import POLICIES
from headstart.runtime.workloads import WORKLOADS


def add_parsers(sub) -> None:
    b = sub.add_parser("bench", help="tokens/s, speedup and acceptance length of decoding methods")
    common.add_model_args(b, "auto")
    common.add_prepack_arg(b)
    common.add_adapter_args(b)
    b.add_argument("--prompts", default=None, help=f"JSONL prompt file (default: Spec-Bench at {common.SPEC_BENCH})")
    b.add_argument(
        "--workload",
        default=None,
        choices=tuple(WORKLOADS),
        help="instead of --prompts: a generated workload that repeats across requests, replayed in order, each "
        "method with its own suffix pool starting empty (runtime/workloads.py; written to --out)",
    )
    b.add_argument("--workload-size", type=common.at_least_one, default=40, help="--workload: its prompts")
    b.add_argument(
        "--prefix-cache-gb",
        type=float,
        default=None,
        help="each method keeps finished prompts' keys and values for prompts that start the same way, as a server "
        "does (default: serve's, 1, with --workload; 0: off, the default with --prompts)",
    )
    b.add_argument(
        "--methods",
        default=None,
        help=f"comma list (default plain,hf,lookup and {common.DEFAULT_DRAFTER_HELP}): plain, hf, hf-lookup "
        "(transformers' generate) and drafter specs: "
        f"{', '.join(names())}; NAME:VALUE variants such as medusa:16, layerskip:8, model:PATH",
    )
    for kind in OLD_HEADS_FLAGS:  # refused in one line naming the new form (cmd_bench)
        b.add_argument(f"--{kind}-heads", default=None, help=argparse.SUPPRESS)
    b.add_argument(
        "--heads",
        action="append",
        default=None,
        metavar="LABEL=DIR",
        help="heads to run (repeatable). KIND=DIR (a head kind: medusa, eagle, eagle3 ...): those heads instead "
        "of the shipped ones, the methods keep their names; any other LABEL=DIR: compared side by side, each "
        "method of their kind as METHOD@LABEL beside METHOD@shipped. DIR: headstart heads or a published "
        "layout (Medusa, EAGLE, EAGLE-3)",
    )
    common.add_tree_args(b)
    common.add_profile_arg(b)
    b.add_argument("--temperature", default="0", help="comma list of temperatures")
    b.add_argument("--categories", default=None, help="comma list (default: all six; mt_bench = the 8 of MT-bench)")
    b.add_argument("--limit-per-category", type=int, default=None)
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--seed", type=common.seed_value, default=0)
    b.add_argument("--out", default="bench-results", help="folder for the JSON records and Markdown table")
    b.add_argument(
        "--speculation",
        choices=POLICIES,
        default=None,
        help="the speculation policy of every drafter method (runtime/sizing/policy.py, a batch of one): budget, the "
        "load planner (the default, as serve's); fixed, each drafter's own tree sized by measured cost; off, plain",
    )
    b.add_argument(
        "--breakdown",
        action="store_true",
        help="also time each phase of a round (draft, mask, layers, lm_head, accept, commit ...): a table",
    )
    b.add_argument(
        "--batch-sizes",
        default=None,
        metavar="B,B,...",
        help="--breakdown: instead of one prompt at a time, time each round with B sequences decoding together "
        "(each drafting its own tree) for every B listed, at the first --temperature: a table",
    )
    b.add_argument(
        "--breakdown-doc",
        default=None,
        metavar="FILE",
        help="--breakdown: also write the table into FILE (docs/tuning.md), a section per dtype",
    )
    b.add_argument(
        "--report-to",
        default="none",
        choices=("none", "wandb"),
        help="also log the figures to W&B (offline without WANDB_API_KEY; `wandb sync` later)",
    )
    b.set_defaults(run=cmd_bench)

    ck = sub.add_parser("check", help="a device check: float32 greedy identity of every drafter, then a short bench")
    ck.add_argument("--model", default=DEFAULT_MODEL, help="embedded name, HF model directory or .gguf file")
    ck.add_argument("--device", default="cuda" if common.has_cuda() else "cpu", help="cuda, cpu ...")
    ck.add_argument(
        "--prompts", default=common.TEST_PROMPTS, help="JSONL prompt file (default: the project's test prompts)"
    )
    ck.add_argument("--max-new-tokens", type=common.at_least_one, default=48)
    ck.add_argument("--identity-prompts", type=common.at_least_one, default=5, help="prompts of the identity check")
    ck.add_argument("--bench-prompts", type=common.at_least_one, default=12, help="prompts of the short bench")
    ck.add_argument("--out", default="bench-results", help="folder for the bench records")
    ck.set_defaults(run=cmd_check)


OLD_HEADS_FLAGS = ("medusa", "eagle", "eagle3", "medusa2")  # --KIND-heads DIR, now --heads KIND=DIR


def _given_heads(entries: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """--heads entries as ({drafter: directory} replacing the shipped heads of a kind, {label: directory} compared
    beside them). A KIND=DIR folder must hold heads of that kind."""
    from headstart.heads.kinds import KINDS
    from headstart.heads.published import heads_kind

    kinds, labelled = {}, {}
    for entry in entries:
        label, eq, directory = entry.partition("=")
        if not eq or not label or not directory or any(c in label for c in "@,= "):
            raise common.UserError(f"--heads takes LABEL=DIR (a label without @ , = or spaces), got {entry!r}")
        if label in kinds or label in labelled:
            raise common.UserError(f"--heads: {label} is given twice")
        if label in KINDS:
            try:
                found = heads_kind(directory)
            except (OSError, ValueError) as e:
                raise common.UserError(f"--heads {label}={directory}: {e}") from e
            if found != label:
                raise common.UserError(f"--heads {label}={directory}: that folder holds {found} heads, not {label}")
            kinds[KINDS[label].drafter_name] = directory  # the methods of the drafter that decodes this kind
        else:
            labelled[label] = directory
    return kinds, labelled


def cmd_bench(args: argparse.Namespace, argv: list[str]) -> int:
    from pathlib import Path

    import torch

    from headstart.runtime import background, prefix_cache
    from headstart.runtime.apps import bench, bench_report
    from headstart.runtime.engine import Engine
    from headstart.runtime.sizing.cost_curve import cpu_name

    common.check_lengths(args)
    try:
        temperatures = [float(t) for t in args.temperature.split(",")]
    except ValueError as e:
        raise common.UserError(f"--temperature takes a comma list of numbers: {e}") from e
    for t in temperatures:
        common.sampling_params(t)
    if args.limit_per_category is not None and args.limit_per_category < 1:
        raise common.UserError("--limit-per-category must be >= 1")
    if args.breakdown_doc and not args.breakdown:
        raise common.UserError("--breakdown-doc needs --breakdown")
    batch_sizes = None
    if args.batch_sizes is not None:
        if not args.breakdown:
            raise common.UserError("--batch-sizes needs --breakdown")
        try:
            batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
        except ValueError as e:
            raise common.UserError(f"--batch-sizes takes a comma list of whole numbers: {e}") from e
        if min(batch_sizes) < 1:
            raise common.UserError("--batch-sizes: every size must be >= 1")
    if args.prefix_cache_gb is not None and args.prefix_cache_gb < 0:
        raise common.UserError(f"--prefix-cache-gb must be >= 0, got {args.prefix_cache_gb}")
    prefix_cache_gb = args.prefix_cache_gb
    if prefix_cache_gb is None:
        prefix_cache_gb = prefix_cache.DEFAULT_GB if args.workload is not None else 0.0
    if args.workload is not None:
        if args.prompts is not None:
            raise common.UserError("give --prompts or --workload, not both")
        from headstart.runtime import workloads

        Path(args.out).mkdir(parents=True, exist_ok=True)
        generated = workloads.workload(args.workload, args.workload_size, args.seed)
        prompts = str(workloads.write(generated, Path(args.out) / f"workload-{args.workload}.jsonl"))
    else:
        prompts = common.bench_prompts(args.prompts)
    categories = set(args.categories.split(",")) if args.categories else None
    if args.methods is None:
        default = common.default_drafter(args.model, args.adapter)
        args.methods = "plain,hf,lookup" + ("" if default == "none" else f",{default}")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    options = common.flag_values(args, [k for k in common.FLAGS if k not in ("heads", "budget")])
    for kind in OLD_HEADS_FLAGS:
        if getattr(args, f"{kind}_heads") is not None:
            raise common.UserError(f"--{kind}-heads is gone: use --heads {kind}=DIR")
    options["heads"], labelled = _given_heads(args.heads or [])
    methods = bench.label_methods(methods, labelled, args.model)
    unused = sorted(set(labelled) - {m.partition(bench.LABEL_SEP)[2] for m in methods})
    if unused:
        raise common.UserError(f"--heads {unused[0]}=...: no method in --methods runs heads of its kind")
    options["labelled_heads"] = labelled
    bench.method_options(methods, options)  # every method and option checked before the model loads
    with background.paused():  # the load times the kernels and the tree's cost curve: measure alone too
        engine = Engine.load(
            args.model,
            args.dtype,
            "none",
            args.device,
            args.profile,
            args.adapter,
            not args.no_merge,
            not args.no_prepack,
        )
        if batch_sizes is not None:
            return _bench_batches(
                args, argv, engine, prompts, methods, batch_sizes, temperatures[0], categories, options
            )
        records = bench.run_bench(
            engine,
            prompts,
            methods,
            temperatures,
            args.max_new_tokens,
            args.limit_per_category,
            categories,
            args.seed,
            args.breakdown,
            prefix_cache_gb,
            args.speculation,
            **options,
        )
    table = bench.summarize(records)
    packed, grouped = engine.target.packed, "grouped-query" if engine.target.grouped else "stock"
    device, dtype = engine.target.device, str(engine.target.dtype).removeprefix("torch.")
    processor = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    machine = (
        f"{processor}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"{dtype}, {args.device}, model {args.model}, kernels {packed.kind} (packed in {packed.seconds:.2f} s), "
        f"{grouped} tree attention"
    )
    meta = {"command": "headstart " + " ".join(argv), "machine": machine}
    json_path, md_path, png_path = bench_report.save(records, table, Path(args.out), meta)
    print(bench_report.markdown(table))
    print(f"records: {json_path}\ntable: {md_path}\nchart: {png_path}", file=sys.stderr)
    if args.breakdown:
        text = (
            f"`{meta['command']}`\n\n{machine}; ms per round (prefill left out)\n\n"
            + bench_report.breakdown_markdown(records)
        )
        print(text)
        md_path.with_name(md_path.stem + "-breakdown.md").write_text(text)
        if args.breakdown_doc:
            bench_report.replace_section(Path(args.breakdown_doc), f"breakdown {dtype}", text)
    if args.report_to == "wandb":
        print(bench_report.report_wandb(table, meta, Path(args.out), run_name=json_path.stem), file=sys.stderr)
    return 0


def _bench_batches(args, argv, engine, prompts, methods, batch_sizes, temperature, categories, options) -> int:
    """`--breakdown --batch-sizes`: the round's phases with B sequences together (runtime/apps/bench_batches.py)."""
    from headstart.runtime.apps.bench_batches import batch_breakdown, batches_markdown
    from headstart.runtime.sizing.cost_curve import cpu_name

    rows = batch_breakdown(
        engine, prompts, methods, batch_sizes, temperature, args.max_new_tokens, categories, args.seed, **options
    )
    dtype = str(engine.target.dtype).removeprefix("torch.")
    text = (
        f"`headstart {' '.join(argv)}`\n\n{cpu_name()}, {dtype}, T = {temperature}; ms a round while every sequence "
        f"decodes (prefill left out)\n\n" + batches_markdown(rows)
    )
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"batches-{dtype}.md").write_text(text)
    return 0


def cmd_check(args: argparse.Namespace, argv: list[str]) -> int:
    from headstart.runtime.apps.check import run_check

    if not Path(args.prompts).is_file():
        raise common.UserError(f"prompts file not found: {args.prompts} (run from a checkout, or pass --prompts FILE)")
    return run_check(
        args.model, args.device, args.prompts, args.identity_prompts, args.bench_prompts, args.max_new_tokens, args.out
    )

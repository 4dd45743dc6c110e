"""`headstart export`, `convert`, `calibrate` and `score`: heads to and from other layouts, and their accuracies."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from headstart.commands import common
from headstart.runtime.models import DEFAULT_MODEL
from headstart.runtime.profiles import EMBEDDED_HUB_ID
from headstart.runtime.prompts import load_prompts


def add_parsers(sub) -> None:
    ex = sub.add_parser("export", help="write trained EAGLE-3 heads in the layout vLLM and SGLang load")
    ex.add_argument("heads", help="trained heads directory (a training run's output_dir/heads)")
    ex.add_argument("out", help="a new (or empty) folder to write")
    ex.add_argument(
        "--format",
        default="specforge",
        choices=("specforge", "speculators"),
        help="specforge: the EAGLE-3 layout vLLM and SGLang load (default); speculators: vLLM's "
        "self-describing twin (`vllm serve OUT`)",
    )
    ex.add_argument(
        "--target",
        default=None,
        help="the target's hub name or path the commands and the speculators config name (default: the "
        f"model the heads were trained for; the embedded model is {EMBEDDED_HUB_ID})",
    )
    ex.add_argument(
        "--model",
        default=None,
        help="speculators format: the target whose input embedding it stores (embedded name, HF model directory "
        "or .gguf file; default: the model the heads were trained for)",
    )
    ex.add_argument(
        "--for",
        dest="engine",
        default=None,
        choices=("vllm", "llamacpp"),
        help="refuse heads this engine would draft otherwise (llama.cpp: one draft layer, 3 fused layers, no fc_norm "
        "or norm_output); default: no engine check",
    )
    ex.set_defaults(run=cmd_export)

    cv = sub.add_parser("convert", help="write published Medusa / EAGLE / EAGLE-3 heads as headstart heads")
    cv.add_argument("src", help="the published heads' folder (Medusa authors', EAGLE authors', SpecForge, speculators)")
    cv.add_argument("out", help="a new (or empty) folder to write")
    cv.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="the target the heads draft for (embedded name, HF model directory or .gguf file): its "
        "fingerprint is written with them",
    )
    cv.set_defaults(run=cmd_convert)

    cb = sub.add_parser(
        "calibrate", help="measure heads' per-rank accuracies on your prompts (what trees are shaped from)"
    )
    cb.add_argument("heads", help="a headstart heads directory (`headstart convert` published heads first)")
    cb.add_argument("--prompts", required=True, help="JSONL prompt file (chat prompts, as serving sees them)")
    common.add_model_args(cb, "float32")
    cb.add_argument("--limit", type=common.at_least_one, default=64, help="prompts to answer (default 64)")
    cb.add_argument("--max-new-tokens", type=common.at_least_one, default=128)
    cb.set_defaults(run=cmd_calibrate)

    sc = sub.add_parser("score", help="heads' held-out acceptance on distilled rows (the training ledger's measure)")
    sc.add_argument("heads", nargs="+", help="headstart heads directories, scored on the same rows")
    sc.add_argument(
        "--rows",
        required=True,
        help="a distilled folder (e.g. the committed held-out prompts' answers, configs/heldout-ids.txt)",
    )
    common.add_model_args(sc, "bfloat16")
    sc.add_argument("--depths", type=common.at_least_one, default=4, help="drafting depths scored (training's 4)")
    sc.add_argument("--max-len", type=common.at_least_one, default=512, help="tokens per row, as training cuts them")
    sc.set_defaults(run=cmd_score)


def cmd_export(args: argparse.Namespace, argv: list[str]) -> int:
    from headstart.heads.export import export_heads

    def target_name(name: str) -> str:
        return EMBEDDED_HUB_ID if name == DEFAULT_MODEL else name

    embedding = None
    if args.format == "speculators":
        embedding = trained_for_embedding(args.heads, args.model)
    out = export_heads(
        args.heads, args.out, args.format, args.target, resolve=target_name, embedding=embedding, engine=args.engine
    )
    print(out)
    return 0


def trained_for_embedding(heads: str, model: str | None):
    """The input embedding of `model`, or of the target the heads in `heads` were trained for (its name there)."""
    from headstart.heads.checkpoint import CheckpointConfig
    from headstart.runtime.models import load_model

    name = model or CheckpointConfig.read(Path(heads)).target.get("name")
    if not name:
        raise ValueError("the heads' config does not name their target: give --model (its directory or .gguf file)")
    target, _ = load_model(name)
    return target.get_input_embeddings().weight.detach()


def cmd_convert(args: argparse.Namespace, argv: list[str]) -> int:
    from headstart.heads.published import convert_heads
    from headstart.runtime.models import load_model

    model, tokenizer = load_model(args.model)
    print(convert_heads(args.src, args.out, model, tokenizer))
    return 0


def cmd_calibrate(args: argparse.Namespace, argv: list[str]) -> int:
    from tqdm import tqdm

    from headstart.heads.checkpoint import CheckpointConfig, save_config
    from headstart.heads.kinds import get_kind
    from headstart.heads.load import load_heads
    from headstart.heads.published import detect_layout
    from headstart.runtime.drafters.options import EagleOptions
    from headstart.runtime.engine import Engine
    from headstart.runtime.tokens import cut_at_eos, pad_id
    from headstart.train.data import Row
    from headstart.train.evaluate import measure

    if detect_layout(args.heads) != "headstart":
        raise common.UserError(
            f"{args.heads} holds published heads: `headstart convert {args.heads} OUT` first, then calibrate OUT"
        )
    config = CheckpointConfig.read(args.heads)
    if not Path(args.prompts).is_file():
        raise common.UserError(f"prompts file not found: {args.prompts}")
    prompts = load_prompts(args.prompts)[: args.limit]
    kind = get_kind(config.kind)
    adapter = args.heads if kind.trains_target else None  # Medusa-2 heads draft for base + their adapter
    engine = Engine.load(args.model, args.dtype, "none", args.device, adapter=adapter)
    heads, _ = load_heads(args.heads, engine.target.model, engine.tokenizer)
    rows = []
    for i, prompt in enumerate(tqdm(prompts, desc="answer", unit="prompt", dynamic_ncols=True)):
        ids = engine.encode(prompt.text)
        answer = cut_at_eos(engine.generate(ids, max_new_tokens=args.max_new_tokens).token_ids, engine.eos_ids)
        rows.append(Row(ids + answer, len(ids), i, prompt.id))
    depths = heads.num_heads if kind.static_tree else EagleOptions().depth  # Medusa: every head; EAGLE: its drafting
    metrics, accuracy = measure(config.kind, heads.float(), engine.target.model, rows, depths, pad_id(engine.tokenizer))
    calibrated = {
        "prompts": str(args.prompts),
        "answers": len(rows),
        "max_new_tokens": args.max_new_tokens,
        "metrics": metrics,
    }
    save_config(
        args.heads,
        dataclasses.replace(config, rank_accuracy=accuracy, extra={**config.extra, "calibrated_on": calibrated}),
    )
    print(
        f"acceptance length {metrics['acceptance_length']:.2f}; top-1 per depth "
        + ", ".join(f"{a[0]:.3f}" for a in accuracy)
    )
    return 0


def cmd_score(args: argparse.Namespace, argv: list[str]) -> int:
    import hashlib

    from headstart.heads.checkpoint import CheckpointConfig
    from headstart.heads.load import load_heads
    from headstart.runtime.models import load_model
    from headstart.runtime.tokens import pad_id
    from headstart.train.data import load_rows
    from headstart.train.evaluate import measure

    if not any(Path(args.rows).glob("shard-*.jsonl")):
        raise common.UserError(f"--rows {args.rows}: no distilled shards (shard-*.jsonl) there")
    configs = [CheckpointConfig.read(h) for h in args.heads]
    model, tokenizer = load_model(args.model, args.dtype, args.device)
    rows = load_rows(args.rows, args.max_len)
    print("| heads | model.safetensors sha256 | rows | acceptance length | top-1 per depth |")
    print("| --- | --- | ---: | ---: | --- |")
    for path, config in zip(args.heads, configs, strict=True):
        heads, _ = load_heads(path, model, tokenizer)
        metrics, accuracy = measure(config.kind, heads.float(), model, rows, args.depths, pad_id(tokenizer))
        sha = hashlib.sha256((Path(path) / "model.safetensors").read_bytes()).hexdigest()[:12]
        top1 = " / ".join(f"{a[0]:.3f}" for a in accuracy)
        print(f"| {path} | {sha} | {len(rows)} | {metrics['acceptance_length']:.3f} | {top1} |", flush=True)
    return 0

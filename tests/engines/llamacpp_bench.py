"""`make bench-llamacpp`: headstart beside llama.cpp on the same model, prompts and machine, one request at a time.

    .venv/bin/python tests/engines/llamacpp_bench.py [--dtypes float32,bfloat16] [--prompts N] [--repeats R] [--skip S]

The embedded model converted by llama.cpp's own converter from headstart's weights (F32 and BF16 GGUFs, cached
beside the build of `make llamacpp`), T = 0, batch 1, held-out chat prompts (the committed held-out ids, never
trained on; not the tune prompts), 128 new tokens. Per dtype:
  llama.cpp (`llama-server`, 2 threads, one server a mode, all started before the first prompt): plain,
  ngram-simple 3/6 and with its defaults, ngram-mod, draft-eagle3 with headstart's exported EAGLE-3 head (chains of
  3, `headstart export --for llamacpp`, converted by llama.cpp's converter); and the `llama-lookup` CLI with n_max 3
  and 8 (one process a prompt, timed by its own encode + decode figures, so its model load is not counted);
  headstart (`Engine` in this process, its defaults for the dtype): plain, eagle3+lookup, eagle+lookup,
  eagle+suffix.
Every system answers a prompt before any answers the next, the order rotated prompt by prompt, so the machine's
drift falls on all alike. tok/s counts prefill and decoding (a request's wall time; the server's HTTP round trip
on llama.cpp's side, well under a millisecond). Each repeat sends prompts of its own (no prompt twice); a row's
figure is the median of the repeats' tok/s (each: its tokens over its seconds). Answers are compared as text
with each side's plain answers (the same text at T = 0, or not). Prints the tables, writes them with the CPU's name into
FILE (docs/benchmarks.md) between `<!-- llamacpp-bench -->` markers, and every figure to OUT/llamacpp-bench.json.
Registered background jobs (training, distillation) are paused throughout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from llamacpp_check import LLAMACPP_HOME, complete, convert, draft_eagle3_args, llama_server, target_gguf
from serve_bench import write_heldout

ROOT = Path(__file__).resolve().parents[2]
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16"}
LLAMACPP_MODES = {  # label -> llama-server arguments (None: the converted head's, llamacpp_check.draft_eagle3_args)
    "llama.cpp plain": [],
    "llama.cpp ngram-simple 3/6": [
        *("--spec-type", "ngram-simple"),
        *("--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "6"),
    ],
    "llama.cpp ngram-simple (defaults)": ["--spec-type", "ngram-simple"],
    "llama.cpp ngram-mod": ["--spec-type", "ngram-mod"],
    "llama.cpp draft-eagle3 (our head, n_max 3)": None,
}
# llama.cpp's `llama-lookup` CLI (prompt lookup with its n-gram caches), n_max drafted tokens: it takes the prompt as
# text (the chat template rendered with its special tokens, which it parses back to the same ids) and reports its
# own encode and decode times
LOOKUP_MODES = {"llama.cpp llama-lookup n_max 3": 3, "llama.cpp llama-lookup n_max 8": 8}
HEADSTART_METHODS = ("none", "eagle3+lookup", "eagle+lookup", "eagle+suffix")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def lookup(bin_dir: Path, gguf: Path, prompt: str, n_max: int, max_tokens: int, threads: int) -> tuple[str, int, float]:
    """`llama-lookup` on one prompt: (the text it wrote after the prompt, tokens decoded, encode + decode seconds)."""
    # it stops once it has decoded more than -n tokens: -n max_tokens - 1 decodes max_tokens, as the others do
    cmd = [str(bin_dir / "llama-lookup"), "-m", str(gguf), "-p", prompt, "-n", str(max_tokens - 1), "-t", str(threads)]
    cmd += ["-c", "4096", "--temp", "0", "--spec-draft-n-max", str(n_max)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    timed = re.findall(r"(encoded|decoded)\s+(\d+) tokens in\s+([\d.]+) seconds", done.stderr)
    if done.returncode != 0 or len(timed) != 2:
        sys.exit(f"llama-lookup failed ({' '.join(cmd[:4])} ...):\n{done.stderr[-2000:]}")
    text = ANSI.sub("", done.stdout)
    text = text.split(prompt, 1)[1] if prompt in text else text
    return text.split("\n\n\n")[0], int(timed[1][1]), float(timed[0][2]) + float(timed[1][2])


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def run_dtype(dtype: str, args, home: Path, model_dir: Path, draft: Path, prompts: list[list[list[int]]]) -> dict:
    """{label: {"tok/s": [per repeat], "same as plain": n, "answers": n}} for every system in one dtype (texts
    compared: the answers' tokens decoded, the CLI's written text)."""
    from headstart.runtime.apps.bench import run_method
    from headstart.runtime.engine import Engine
    from headstart.runtime.sampling import SamplingParams

    gguf = target_gguf(home, sys.executable, model_dir, GGUF_TYPES[dtype])
    engine = Engine.load(dtype=dtype)
    drafters = {m: engine.make_drafter(m) for m in HEADSTART_METHODS}
    tokenizer = engine.tokenizer
    ours = [f"headstart {'plain' if m == 'none' else m}" for m in HEADSTART_METHODS]
    labels = [*LLAMACPP_MODES, *LOOKUP_MODES, *ours]
    figures = {label: {"tokens": [], "seconds": [], "answers": []} for label in labels}
    with contextlib.ExitStack() as stack:
        urls = {
            label: stack.enter_context(
                llama_server(
                    home / "build/bin",
                    gguf,
                    draft_eagle3_args(draft) if extra is None else extra,
                    args.threads,
                    Path(args.out) / f"server-{dtype}-{i}.log",
                )
            )
            for i, (label, extra) in enumerate(LLAMACPP_MODES.items())
        }

        def answer(label: str, ids: list[int]) -> tuple[str, int, float]:
            """(the answer's text, its tokens, seconds): texts are compared, as the CLI writes text"""
            if label in LOOKUP_MODES:
                prompt = tokenizer.decode(ids, skip_special_tokens=False)
                text, n, seconds = lookup(
                    home / "build/bin", gguf, prompt, LOOKUP_MODES[label], args.max_tokens, args.threads
                )
                return text.replace(tokenizer.eos_token or "\0", "").strip(), n, seconds
            if label in urls:
                got = complete(urls[label], [ids], args.max_tokens)
                tokens, seconds = got["token_ids"][0], got["seconds"]
            else:
                method = label.removeprefix("headstart ").replace("plain", "none")
                t0 = time.perf_counter()
                tokens = run_method(engine, method, drafters, ids, SamplingParams(), args.max_tokens, 0).tokens
                seconds = time.perf_counter() - t0
            return tokenizer.decode(tokens, skip_special_tokens=True).strip(), len(tokens), seconds

        for label in labels:  # warm-up, on a prompt no repeat sends
            answer(label, prompts[-1][0][:64])
        for r, repeat in enumerate(prompts[: args.repeats]):
            for f in figures.values():
                f["tokens"].append(0)
                f["seconds"].append(0.0)
            for p, ids in enumerate(repeat):
                shift = (r * len(repeat) + p) % len(labels)
                for label in labels[shift:] + labels[:shift]:
                    text, tokens, seconds = answer(label, ids)
                    f = figures[label]
                    f["tokens"][-1] += tokens
                    f["seconds"][-1] += seconds
                    f["answers"].append(text)
            print(f"{dtype}: repeat {r + 1} of {args.repeats} done", file=sys.stderr)
    rows = {}
    for label, f in figures.items():
        plain = figures["headstart plain" if label in ours else "llama.cpp plain"]["answers"]
        rows[label] = {
            "tok/s": [t / s for t, s in zip(f["tokens"], f["seconds"], strict=True)],
            "same as plain": sum(a == b for a, b in zip(f["answers"], plain, strict=True)),
            "same as headstart plain": sum(
                a == b for a, b in zip(f["answers"], figures["headstart plain"]["answers"], strict=True)
            ),
            "answers": len(f["answers"]),
        }
    return rows


def table(dtype: str, rows: dict) -> list[str]:
    base = statistics.median(rows["llama.cpp plain"]["tok/s"])
    own = statistics.median(rows["headstart plain"]["tok/s"])
    lines = [
        f"{dtype}:",
        "",
        "| system | tok/s (median) | repeats | vs llama.cpp plain | vs headstart plain | same text as its plain "
        "| same text as headstart plain |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for label, row in rows.items():
        med = statistics.median(row["tok/s"])
        each = " / ".join(f"{x:.1f}" for x in row["tok/s"])
        n = row["answers"]
        lines.append(
            f"| {label} | {med:.1f} | {each} | {med / base:.2f} | {med / own:.2f} | {row['same as plain']}/{n} "
            f"| {row['same as headstart plain']}/{n} |"
        )
    return [*lines, ""]


def main() -> int:
    from transformers import AutoTokenizer

    from headstart.heads.checkpoint import shipped_heads
    from headstart.heads.export import export_heads
    from headstart.runtime import background
    from headstart.runtime.apps.bench_report import replace_section
    from headstart.runtime.models import DEFAULT_MODEL, resolve_model_dir
    from headstart.runtime.paths import cache_dir
    from headstart.runtime.prompts import load_prompts
    from headstart.runtime.tokens import prompt_ids

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--llamacpp", default=str(LLAMACPP_HOME), help="the folder `make llamacpp` builds into")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--prompts", type=int, default=8, help="held-out chat prompts a repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip", type=int, default=0, help="start this many held-out prompts in (prompts no run sent)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(cache_dir() / "runs" / "llamacpp-bench"))
    p.add_argument("--doc", default=None, help="also write the tables into this Markdown file (docs/benchmarks.md)")
    args = p.parse_args()
    home = Path(args.llamacpp)
    if not (home / ".built").exists():
        sys.exit(f"no llama.cpp build in {home}: run `make llamacpp`")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model_dir(DEFAULT_MODEL)
    head_dir = out / "eagle3"  # exported and converted at every run: the shipped head may have changed since the last
    shutil.rmtree(head_dir, ignore_errors=True)
    export_heads(
        shipped_heads(DEFAULT_MODEL, "eagle3"), head_dir, resolve=lambda name: str(model_dir), engine="llamacpp"
    )
    draft = convert(home / "llama.cpp", sys.executable, head_dir, out / "eagle3-f32.gguf", "f32", model_dir)

    needed = args.prompts * (args.repeats + 1)  # + one set for the warm-up
    write_heldout(out / "heldout-chat.jsonl", args.skip + needed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    texts = [pr.text for pr in load_prompts(out / "heldout-chat.jsonl")][args.skip :]
    if len(texts) < needed:
        sys.exit(f"--skip {args.skip}: only {len(texts)} held-out prompts left, {needed} needed")
    ids = [prompt_ids(tokenizer, t) for t in texts]
    prompts = [ids[i : i + args.prompts] for i in range(0, needed, args.prompts)]

    results, lines = {}, []
    with background.paused():
        for dtype in args.dtypes.split(","):
            results[dtype] = run_dtype(dtype, args, home, model_dir, draft, prompts)
            lines += table(dtype, results[dtype])
    (out / "llamacpp-bench.json").write_text(json.dumps(results, indent=2))
    head = (
        f"`make bench-llamacpp`, {time.strftime('%Y-%m-%d')}, {cpu_name()} ({args.threads} threads): T = 0, batch 1, "
        f"{args.prompts} held-out chat prompts a repeat (from held-out prompt {args.skip + 1}), {args.repeats} "
        "repeats on prompts of their own, "
        f"{args.max_tokens} new tokens; llama.cpp 0.3.36's (0c1e570), the same weights converted by its converter"
    )
    text = "\n".join([head, "", *lines])
    print(text)
    if args.doc:
        replace_section(Path(args.doc), "llamacpp-bench", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

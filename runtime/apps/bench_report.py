"""`headstart bench`'s reports, apart from its measuring (`bench.py`): the Markdown tables, the round-cost
breakdown, the chart, W&B, the files of a run and the doc sections they are written into."""

from __future__ import annotations

import json
import textwrap
import time
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

from headstart.runtime.apps.bench import Record


def report_wandb(table: dict, meta: dict, out_dir: Path, run_name: str | None = None) -> str:
    """Log every method's figures per temperature and category to W&B (offline without WANDB_API_KEY, as
    training is), named as training names them: `{method}/{category}/T={t}/acceptance_length`,
    `.../head_{d}/acceptance` (depth d given depth d-1), `.../tokens_per_s`, `.../speedup_vs_plain`."""
    import os

    import wandb

    mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
    run = wandb.init(project="headstart", job_type="bench", name=run_name, dir=str(out_dir), mode=mode, config=meta)
    metrics, rows = {}, []
    for (temperature, category), methods in table.items():
        for method, f in methods.items():
            key = f"{method}/{category}/T={temperature}"
            for name in ("acceptance_length", "tokens_per_s", "speedup_vs_plain"):
                if f[name] is not None:
                    metrics[f"{key}/{name}"] = f[name]
            for d, share in enumerate(f["acceptance_per_depth"] or [], 1):
                metrics[f"{key}/head_{d}/acceptance"] = share
            rows.append(
                [
                    method,
                    category,
                    temperature,
                    f["tokens_per_s"],
                    f["speedup_vs_plain"],
                    f["acceptance_length"],
                    json.dumps(f["acceptance_per_depth"]),
                ]
            )
    columns = [
        "method",
        "category",
        "temperature",
        "tokens_per_s",
        "speedup_vs_plain",
        "acceptance_length",
        "acceptance_per_depth",
    ]
    run.log({**metrics, "bench": wandb.Table(columns=columns, data=rows)})
    run.summary.update(metrics)
    where = f"W&B run {run.name} ({mode}, {run.dir})"
    run.finish()
    return where


def markdown(table: dict) -> str:
    def fmt(v, spec):
        return "–" if v is None else format(v, spec) if not isinstance(v, str) else v

    lines = []
    for temperature in sorted({t for t, _ in table}):
        lines += [
            f"\n**T = {temperature}**\n",
            "| category | method | tok/s | speedup vs plain | speedup vs hf | acceptance length "
            "| acceptance per depth | draft ms/round | verify ms/round | same tokens as plain |",
            "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
        ]
        cats = [*sorted(c for t, c in table if t == temperature and c != "overall"), "overall"]
        for cat in cats:
            for method, f in table[(temperature, cat)].items():
                lines.append(
                    f"| {cat} | {method} | {f['tokens_per_s']:.1f} | {fmt(f['speedup_vs_plain'], '.2f')} "
                    f"| {fmt(f['speedup_vs_hf'], '.2f')} | {fmt(f['acceptance_length'], '.2f')} "
                    f"| {' / '.join(format(a, '.2f') for a in (f['acceptance_per_depth'] or [])[:5]) or '–'} "
                    f"| {fmt(f['draft_ms'], '.2f')} | {fmt(f['verify_ms'], '.1f')} | {fmt(f['same_as_plain'], '')} |"
                )
    return "\n".join(lines) + "\n"


BREAKDOWN = ("propose", "mask", "layers", "lm_head", "accept", "commit", "observe", "python", "detokenise")
FORWARD = ("mask", "layers", "lm_head")  # the target's verification forward over the tree


def breakdown_markdown(records: list[Record]) -> str:
    """The round-cost table of a `--breakdown` run: per method and temperature, ms per round of each phase
    (weighted by rounds), the round's total, that total in plain steps (plain's round at the same temperature),
    the acceptance length and speedup = acceptance length / plain steps, up to the prefill. The forward-only
    ceiling is the speedup were drafting, accepting and committing free: acceptance length / (the target's
    forward over the tree, `FORWARD`, in plain steps). What the heads' acceptance allows on this machine, whatever
    the drafting costs."""
    groups: dict[tuple[float, str], list[Record]] = defaultdict(list)
    for r in records:
        if r.phase_ms is not None:
            groups[(r.temperature, r.method)].append(r)
    rows, round_ms = [], {}
    for (temperature, method), rs in groups.items():
        passes = sum(r.target_passes or 0 for r in rs)
        ms = {k: sum(r.phase_ms.get(k, 0.0) * (r.target_passes or 0) for r in rs) / max(passes, 1) for k in BREAKDOWN}
        round_ms[(temperature, method)] = sum(ms.values())
        rows.append((temperature, method, ms, sum(r.new_tokens for r in rs) / max(passes, 1)))
    head = " | ".join(BREAKDOWN)
    lines = [
        f"| T | method | {head} | round ms | plain steps | acceptance length | speedup | forward-only ceiling |",
        "| ---: | --- |" + " ---: |" * (len(BREAKDOWN) + 5),
    ]
    for temperature, method, ms, tau in sorted(rows, key=lambda row: row[0]):
        plain = round_ms.get((temperature, "plain"))
        total = round_ms[(temperature, method)]
        forward = sum(ms[k] for k in FORWARD)
        ratios = (
            f"{total / plain:.2f} | {tau:.2f} | {tau * plain / total:.2f} | {tau * plain / forward:.2f}"
            if plain and total and forward
            else f"– | {tau:.2f} | – | –"
        )
        cells = " | ".join(f"{ms[k]:.2f}" for k in BREAKDOWN)
        lines.append(f"| {temperature} | {method} | {cells} | {total:.1f} | {ratios} |")
    return "\n".join(lines) + "\n"


def replace_section(path: Path, key: str, text: str) -> None:
    """Write `text` into `path` between the lines `<!-- key -->` and `<!-- /key -->` (appended if absent)."""
    start, end = f"<!-- {key} -->", f"<!-- /{key} -->"
    doc = path.read_text() if path.exists() else ""
    block = f"{start}\n{text.rstrip()}\n{end}"
    if start in doc and end in doc:
        doc = doc[: doc.index(start)] + block + doc[doc.index(end) + len(end) :]
    else:
        doc = doc.rstrip() + "\n\n" + block + "\n"
    path.write_text(doc)


def chart(table: dict, path: Path, title: str = "") -> Path:
    """PNG: per temperature, speedup over plain and acceptance length per category (bars: methods)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temperatures = sorted({t for t, _ in table})
    fig, axes = plt.subplots(len(temperatures), 2, figsize=(13, 3.6 * len(temperatures)), squeeze=False)
    for row, temperature in enumerate(temperatures):
        cats = [*sorted(c for t, c in table if t == temperature and c != "overall"), "overall"]
        methods = [m for m in table[(temperature, "overall")] if m not in ("plain", "hf")]
        width = 0.8 / max(len(methods), 1)
        for col, (key, label) in enumerate(
            [("speedup_vs_plain", "speedup over plain"), ("acceptance_length", "acceptance length")]
        ):
            ax = axes[row][col]
            for j, method in enumerate(methods):
                values = [table[(temperature, c)].get(method, {}).get(key) or 0.0 for c in cats]
                ax.bar([i + j * width for i in range(len(cats))], values, width, label=method)
            ax.axhline(1.0, color="grey", linewidth=0.8)
            ax.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(cats))], cats, rotation=20)
            ax.set_title(f"{label}, T = {temperature}")
    handles, labels = axes[0][0].get_legend_handles_labels()
    height = fig.get_figheight()
    fig.legend(handles, labels, loc="lower center", ncol=max(len(labels), 1), fontsize=9, frameon=False)  # off the bars
    if title:
        fig.suptitle(textwrap.fill(title, 160), fontsize=9)  # a machine's flags run long
    fig.tight_layout(rect=(0, 0.4 / height, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def save(records: list[Record], table: dict, out_dir: Path, meta: dict) -> tuple[Path, Path, Path]:
    """JSON records + summary, the Markdown table and the PNG chart, named by the time of the run."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    json_path = out_dir / f"bench-{stamp}.json"
    md_path = out_dir / f"bench-{stamp}.md"
    summary = {f"T={t}/{c}": row for (t, c), row in table.items()}
    json_path.write_text(json.dumps({"meta": meta, "summary": summary, "records": [asdict(r) for r in records]}))
    others = sorted({(r.method, r.adapter) for r in records if r.adapter})
    notes = "".join(f"\n{m} ran on the model + the LoRA adapter in {a} (its heads' own)\n" for m, a in others)
    md_path.write_text(f"`{meta['command']}`\n\n{meta['machine']}\n{notes}" + markdown(table))
    png_path = chart(table, out_dir / f"bench-{stamp}.png", meta["machine"])
    return json_path, md_path, png_path

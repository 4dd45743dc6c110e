"""`headstart report RUN_DIR...`: per-head curves of several training runs in one PNG, for people without W&B.

Reads each run's `metrics.jsonl` (the same names as in W&B) and draws train loss, simulated
acceptance length, and per head top-1 and conditional acceptance, one line per run, against optimizer steps or
training CPU-seconds (`cpu_s`; the acceptance of the first held-out rows scored on the way, `quick/`, dashed).
"""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{run_dir} holds no metrics.jsonl: not a training run directory")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_label(run_dir: Path) -> str:
    config = run_dir / "config.json"
    if config.is_file():
        cfg = json.loads(config.read_text())
        return f"{run_dir.name} ({cfg['heads']['kind']}, {Path(cfg['target']['model']).name})"
    return run_dir.name


def draw_report(run_dirs: list[str | Path], out: str | Path, x: str = "step") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {run_label(Path(d)): read_metrics(d) for d in run_dirs}
    heads = sorted(
        {int(k.split("/")[0].split("_")[1]) for rows in runs.values() for r in rows for k in r if k.startswith("head_")}
    )
    panels = ["train/loss", "acceptance_length"] + [f"head_{k}/{m}" for m in ("top1", "acceptance") for k in heads]
    cols = 1 + max(len(heads), 1)
    fig, axes = plt.subplots(2, cols, figsize=(4 * cols, 7), squeeze=False)
    layout = {"train/loss": (0, 0), "acceptance_length": (1, 0)}
    for i, k in enumerate(heads):
        layout[f"head_{k}/top1"] = (0, 1 + i)
        layout[f"head_{k}/acceptance"] = (1, 1 + i)
    for ax in axes.flat:
        ax.set_visible(False)
    for name in panels:
        ax = axes[layout[name]]
        ax.set_visible(True)
        for label, rows in runs.items():
            points = [(r[x], r[name]) for r in rows if name in r and x in r]
            if points:
                line = ax.plot(*zip(*points, strict=True), marker="." if len(points) < 30 else None, label=label)
            quick = [(r[x], r[f"quick/{name}"]) for r in rows if f"quick/{name}" in r and x in r]
            if quick:
                color = line[0].get_color() if points else None
                ax.plot(*zip(*quick, strict=True), "--", marker=".", color=color, label=f"{label}, first rows")
        ax.set_title(name)
        ax.set_xlabel("training CPU-seconds" if x == "cpu_s" else "step")
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out

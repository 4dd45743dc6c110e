"""Two training recipes from the same start on the same rows, each for the same training CPU-seconds, alone on the
machine: held-out acceptance against CPU-seconds, in one figure.

    python -m headstart.train.ab --config configs/smollm2-135m-eagle3-continue.yaml --cpu-s 3600 \\
        --b "data.features=$R/features/smollm2-135m-eagle3" --out $R/ab data.heldout=$R/distill/heldout

Each recipe is the config with the shared overrides (the positional ones), then its own (`--a`, `--b`: dotted
overrides separated by spaces), and `max_cpu_s`, `eval_every_cpu_s` (the first `eval_quick_rows` held-out rows
scored every `--every` CPU-seconds, all of them at the end) and `output_dir` (OUT/a, OUT/b) set. The runs go one
after the other, registered background jobs paused (`runtime/background.py`), each launched as train/heads.py says
(`--launch`; default `accelerate launch --num_cpu_threads_per_process 2`, the `accelerate` beside this Python); a
run stopped part way resumes from its last checkpoint when the command is run again. `cpu_s` counts the training
process's CPU-seconds (every thread, evaluation excluded: train/trainer.py `CpuClock`), so the recipes are compared
by what they cost, not by their steps. Prints each recipe's steps and held-out acceptance at the end, and draws
OUT/ab.png (`headstart report OUT/a OUT/b --x cpu_s`).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

from headstart.runtime.background import paused
from headstart.train import heads as entry
from headstart.train.report import draw_report, read_metrics

RECIPES = ("a", "b")


def default_launch() -> str:
    """Accelerate's launcher beside this Python (a virtual environment need not be activated), else on the PATH."""
    beside = Path(sys.executable).parent / "accelerate"
    return f"{shlex.quote(str(beside)) if beside.is_file() else 'accelerate'} launch --num_cpu_threads_per_process 2"


def launch_command(launch: str, config: str, overrides: list[str]) -> list[str]:
    """The command line that trains `config` with `overrides` (train/heads.py under `launch`)."""
    return [*shlex.split(launch), str(Path(entry.__file__)), "--config", config, *overrides]


def recipe_overrides(shared: list[str], own: str, cpu_s: float, every: float, out: Path) -> list[str]:
    """A recipe's overrides: the shared ones, its own, then the budget, the marks and its output folder."""
    return [*shared, *shlex.split(own), f"max_cpu_s={cpu_s}", f"eval_every_cpu_s={every}", f"output_dir={out}"]


def summary(run: Path) -> dict[str, float]:
    """A finished run's last step, its CPU-seconds and its held-out acceptance on all rows (0 if never scored)."""
    records = read_metrics(run)
    scored = [r for r in records if "acceptance_length" in r]
    last = records[-1] if records else {}
    return {
        "step": last.get("step", 0),
        "cpu_s": last.get("cpu_s", 0.0),
        "acceptance_length": scored[-1]["acceptance_length"] if scored else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="the YAML both recipes start from")
    p.add_argument("--cpu-s", type=float, required=True, help="each recipe's training CPU-seconds")
    p.add_argument("--a", default="", help="recipe a's own dotted overrides (default: none, the config as it is)")
    p.add_argument("--b", default="", help="recipe b's own dotted overrides")
    p.add_argument("--every", type=float, default=300.0, help="CPU-seconds between scores of the first held-out rows")
    p.add_argument("--out", required=True, help="a folder: OUT/a, OUT/b and OUT/ab.png")
    p.add_argument("--launch", default=None, help="the launcher (default: accelerate launch, 2 threads a process)")
    p.add_argument("overrides", nargs="*", help="dotted overrides both recipes take")
    args = p.parse_intermixed_args(argv)
    if args.cpu_s <= 0 or args.every <= 0:
        print("headstart: error: --cpu-s and --every must be positive", file=sys.stderr)
        return 2
    out = Path(args.out)
    own = {"a": args.a, "b": args.b}
    with paused():
        for name in RECIPES:
            overrides = recipe_overrides(args.overrides, own[name], args.cpu_s, args.every, out / name)
            command = launch_command(args.launch or default_launch(), args.config, overrides)
            print(f"headstart: recipe {name}: {shlex.join(command)}", file=sys.stderr, flush=True)
            try:
                failed = subprocess.run(command).returncode != 0
            except FileNotFoundError:
                print(f"headstart: error: no launcher '{command[0]}' (pass --launch)", file=sys.stderr)
                return 2
            if failed:
                print(f"headstart: error: recipe {name}'s training failed (its output above)", file=sys.stderr)
                return 1
    results = {name: {"overrides": own[name], **summary(out / name)} for name in RECIPES}
    print(json.dumps(results, indent=2))
    print(draw_report([out / name for name in RECIPES], out / "ab.png", x="cpu_s"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where a training step's time goes: the target's features, the heads' loss forward, the backward, the optimizer.

    python -m headstart.train.step_time --config configs/smollm2-135m-eagle3-continue.yaml [--steps 12] \\
        data.heldout=$R/distill/heldout [data.features=DIR | "data.features=''"] [overrides ...]

Builds the config's Trainer (no checkpoint, no W&B, nothing written beside the features a cache keeps) and times
`--steps` micro-batches of its stream in order, registered background jobs paused; the first two are warm-up. The
loss is the one at the last step's settings (the whole training-time test). Prints each step and the medians.
With `data.features` set, a batch whose rows the cache holds reads them, any other runs the target and keeps them:
run it twice to time the same batches read back.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

PARTS = ("features", "loss", "backward", "optimizer")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--steps", type=int, default=12, help="micro-batches timed, the first two as warm-up")
    p.add_argument("overrides", nargs="*", help="dotted overrides, as train/heads.py takes them")
    args = p.parse_intermixed_args(argv)
    if args.steps < 3:
        print("headstart: error: --steps must be at least 3 (two warm up)", file=sys.stderr)
        return 2
    from headstart.runtime.background import paused
    from headstart.train.config import load_config
    from headstart.train.data import load_rows
    from headstart.train.recipe import load_target, make_accelerator
    from headstart.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as out, paused():
        cfg = load_config(args.config, [*args.overrides, f"output_dir={out}", "report_to=none"])
        acc = make_accelerator(cfg, None, Path(out))
        model, tokenizer = load_target(cfg)
        rows = load_rows([cfg.data.path, *cfg.data.sources], cfg.data.max_len)
        heldout = load_rows(cfg.data.heldout, cfg.data.max_len) if cfg.data.heldout else None
        trainer = Trainer(cfg, acc, model, tokenizer, rows, heldout)
        times: dict[str, list[float]] = {part: [] for part in PARTS}
        scored = tokens = 0
        for i in range(args.steps):
            batch = trainer.micro_batch(i)
            tokens += int(batch["attention_mask"].sum())
            scored += int(batch["loss_mask"].sum())
            t0 = time.perf_counter()
            with acc.autocast():
                hidden = trainer.target_features(batch)
                t1 = time.perf_counter()
                loss = trainer.kind.loss(
                    trainer.module, trainer.heads, hidden, batch, trainer.tools, cfg.optim.max_steps
                )
            t2 = time.perf_counter()
            acc.backward(loss)
            t3 = time.perf_counter()
            trainer.optimizer.step()
            trainer.optimizer.zero_grad(set_to_none=True)
            t4 = time.perf_counter()
            spent = (t1 - t0, t2 - t1, t3 - t2, t4 - t3)
            print(
                f"step {i} {tuple(batch['input_ids'].shape)}: "
                + ", ".join(f"{p} {s:.3f} s" for p, s in zip(PARTS, spent, strict=True))
            )
            if i >= 2:
                for part, s in zip(PARTS, spent, strict=True):
                    times[part].append(s)
        if trainer.features is not None:
            trainer.features.flush()
    medians = {part: statistics.median(v) for part, v in times.items()}
    print(
        "medians: "
        + ", ".join(f"{p} {s:.3f} s" for p, s in medians.items())
        + f"; a step {sum(medians.values()):.3f} s; {scored / tokens:.0%} of the tokens scored"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

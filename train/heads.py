"""Train Medusa, Medusa-2, EAGLE or EAGLE-3 heads on a target: the `accelerate launch` entry point.

    accelerate launch train/heads.py --config configs/smoke.yaml [key.sub=value ...]

One process on a CPU to many GPUs on many nodes: only Accelerate's own launch options change.
The target runs under no_grad and only the heads train, except in Medusa-2 (`heads.kind: medusa2`,
train/medusa2.py), where a LoRA on the target trains with them. Checkpoints (`accelerator.save_state`) every
`save_every` steps; started again with the same command, a run resumes from its last checkpoint and
reaches the same weights as an uninterrupted run (same seed, single process). The recipe is train/recipe.py,
the loop train/trainer.py.
"""

from __future__ import annotations

import argparse
import sys

from headstart.extras import MissingExtraError, require
from headstart.train.config import ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Train draft heads on a frozen target.")
    parser.add_argument("--config", required=True, help="YAML config (configs/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=3e-4 heads.kind=eagle")
    args = parser.parse_intermixed_args(argv)  # overrides may come before or after --config
    try:
        require("train", "training")
        from headstart.train.recipe import run  # torch and the training stack: after the extras are checked

        run(load_config(args.config, args.overrides))
    except (ConfigError, ValueError, MissingExtraError) as e:
        print(f"headstart: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

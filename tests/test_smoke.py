"""configs/smoke.yaml end to end, as its header launches it (one process, then the README's two-process DDP check):
Medusa, EAGLE and Medusa-2, offline W&B, about a minute each. The tiny target uses the embedded SmolLM2 tokenizer."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from helpers.models import ACCELERATE_LAUNCH

pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "launch",
    [["--num_processes", "1"], ["--multi_gpu", "--num_processes", "2"]],
    ids=["one-process", "ddp-two-processes"],
)
def test_smoke_config_trains_every_kind(tmp_path, launch):
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    cmd = [
        *ACCELERATE_LAUNCH,
        *launch,
        "train/heads.py",
        "--config",
        "configs/smoke.yaml",
        f"output_dir={tmp_path}",
        f"data.path={tmp_path / 'data'}",
        "optim.max_steps=10",
        "eval_every=5",
        "save_every=5",
    ]  # half the config's steps: CI time
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "W&B logs offline" in proc.stderr
    assert (tmp_path / "medusa2" / "heads" / "adapter_config.json").is_file()  # Medusa-2 keeps its LoRA there
    for kind in ("medusa", "eagle", "medusa2"):
        out = tmp_path / kind
        assert (out / "heads" / "model.safetensors").is_file()
        assert list((out / "checkpoints").glob("step-*/trainer.json"))
        assert list((out / "wandb").glob("offline-run-*"))
        lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        assert lines[-1]["step"] == 10 and "head_1/top1" in lines[-1] and "acceptance_length" in lines[-1]

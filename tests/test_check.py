"""`DEVICE=cpu make gpu-check` (here shortened to 8 new tokens, 2 identity and 3 bench prompts): the device check
runs on the CPU as it will on a GPU, every drafter greedy-identical in float32, and ends in one summary line."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_runs_on_the_cpu(tmp_path):
    env = {**os.environ, "DEVICE": "cpu"}
    args = f"CHECK_ARGS=--max-new-tokens 8 --identity-prompts 1 --bench-prompts 1 --out {tmp_path}"
    cmd = ["make", "--no-print-directory", "gpu-check", args]  # under `make test` too: no "Entering directory"
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = [line for line in proc.stdout.splitlines() if line.startswith("check ")][-1]
    assert summary.startswith("check cpu: identity OK") and "eagle+lookup 1/1" in summary, summary

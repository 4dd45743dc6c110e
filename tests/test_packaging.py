"""The built wheel, installed into a fresh virtual environment (torch from this disk first), runs every
`headstart` subcommand from outside the checkout; the parts live under `headstart.` only."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"  # the CPU build this machine keeps on disk (the Makefile's TORCH)


def run(*cmd, cwd, timeout=600, check=True) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, f"{cmd}: {proc.stderr[-2000:]}"
    return proc


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """bin/ of a fresh venv holding the wheel built from this checkout and its dependencies."""
    tmp = tmp_path_factory.mktemp("wheel")
    run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp / "dist", ROOT,
        cwd=tmp)  # fmt: skip
    (wheel,) = (tmp / "dist").glob("headstart-*.whl")
    run(sys.executable, "-m", "venv", tmp / "venv", cwd=tmp)
    pip = tmp / "venv" / "bin" / "pip"
    run(pip, "install", "-q", TORCH, cwd=tmp)
    run(pip, "install", "-q", wheel, cwd=tmp)
    return tmp / "venv" / "bin"


def test_wheel_runs_every_subcommand_from_elsewhere(venv, tiny_model_dir, tmp_path):
    elsewhere = tmp_path  # not the checkout: nothing of it is on sys.path
    assert "usage: headstart" in run(venv / "headstart", "--help", cwd=elsewhere).stdout
    for sub in ("generate", "bench", "distill", "report", "serve", "loadtest", "demo"):
        run(venv / "headstart", sub, "--help", cwd=elsewhere)
    out = run(venv / "headstart", "generate", "--model", tiny_model_dir, "--prompt", "the cat sat",
              "--drafter", "lookup", "--max-new-tokens", "6", "--json", cwd=elsewhere).stdout  # fmt: skip
    assert '"new_tokens": 6' in out
    # loadtest's client library comes with a plain install: no server here, so one line and exit 2
    prompts = ROOT / "tests" / "data" / "prompts.jsonl"
    proc = run(venv / "headstart", "loadtest", "--url", "http://127.0.0.1:9", "--prompts", prompts, cwd=elsewhere,
               check=False)  # fmt: skip
    assert proc.returncode == 2 and "no headstart server at" in proc.stderr, proc.stderr
    python = venv / "python"
    run(python, "-c", "import headstart, headstart.runtime.engine, headstart.train.heads", cwd=elsewhere)
    for bare in ("runtime", "train", "heads"):
        assert run(python, "-c", f"import {bare}", cwd=elsewhere, check=False).returncode != 0, bare
    code = "from headstart.heads.checkpoint import SHIPPED; print(sorted(p.name for p in SHIPPED.iterdir()))"
    shipped = run(python, "-c", code, cwd=elsewhere).stdout
    assert "smollm2-135m-instruct-eagle" in shipped and "smollm2-135m-instruct-medusa" in shipped

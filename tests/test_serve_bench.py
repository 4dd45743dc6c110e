"""The serving bench's snapshots: a process started as the bench starts its servers imports the snapshot's code,
not the checkout's (from the checkout's root, `python -c` imported the working tree whatever PYTHONPATH said)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "engines"))
serve_bench = pytest.importorskip("serve_bench")

WHERE = "import headstart.runtime.generate as g, headstart.cli as c; print(g.__file__); print(c.__file__)"


def test_a_snapshots_processes_import_the_snapshot(tmp_path):
    if subprocess.run(["git", "-C", str(serve_bench.ROOT), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    _, env = serve_bench.snapshot("HEAD", tmp_path)
    out = subprocess.run(
        [sys.executable, "-c", WHERE], capture_output=True, text=True, check=True, **serve_bench.child(env)
    )
    files = out.stdout.split()
    assert len(files) == 2 and all(Path(f).resolve().is_relative_to(tmp_path.resolve()) for f in files), files

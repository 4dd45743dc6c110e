"""The package's layering, checked over its import graph; `headstart --help` loads no heavy module.

heads/    imports neither runtime nor train
runtime/  never imports train
train/    may import heads and runtime
headstart/ (cli.py and its subcommands, commands/), the composition root, is the only place outside train/ that
imports train.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {"heads": ("runtime", "train"), "runtime": ("train",), "train": (), "headstart": ()}


def imported_parts(path: Path) -> set[str]:
    """The parts (heads, runtime, train) a module imports, at top level or inside functions."""
    parts = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module + "." + a.name for a in node.names]
        for name in names:
            pieces = name.split(".")
            if pieces[0] in ("runtime", "train", "heads"):
                raise AssertionError(f"{path.relative_to(ROOT)} imports '{name}': use headstart.{name}")
            if pieces[0] == "headstart" and len(pieces) > 1 and pieces[1] in ("heads", "runtime", "train"):
                parts.add(pieces[1])
    return parts


@pytest.mark.parametrize("part", list(FORBIDDEN))
def test_layers_import_only_what_they_may(part):
    for path in sorted((ROOT / part).rglob("*.py")):
        bad = imported_parts(path) & set(FORBIDDEN[part])
        assert not bad, f"{path.relative_to(ROOT)} imports {', '.join(sorted(bad))}"


def test_only_the_commands_wire_training_to_the_rest():
    """Outside train/ itself, only subcommand modules (headstart/commands/) import train."""
    modules = sorted(p for part in ("heads", "runtime", "headstart") for p in (ROOT / part).rglob("*.py"))
    wiring = [p.relative_to(ROOT).as_posix() for p in modules if "train" in imported_parts(p)]
    assert wiring and all(path.startswith("headstart/commands/") for path in wiring), wiring


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["bench", "--help"], ["serve", "--help"],
                                  ["distill", "--help"], ["demo", "--help"]])  # fmt: skip
def test_help_is_fast_and_loads_no_torch(argv):
    """Help under a second: the parser's imports stay light (torch and transformers load with a subcommand)."""
    code = "import sys; from headstart.cli import main; main(sys.argv[1:]); assert 'torch' not in sys.modules"
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60)
    seconds = time.perf_counter() - start
    assert proc.returncode == 0 and "usage: headstart" in proc.stdout, proc.stderr
    assert seconds < 1.0, f"headstart {' '.join(argv)} took {seconds:.2f} s"


def test_no_import_sets_environment_variables():
    """Importing every module leaves os.environ as it was (no HF_HUB_OFFLINE behind a user's back)."""
    files = [p.relative_to(ROOT) for part in ("heads", "runtime", "train") for p in (ROOT / part).rglob("*.py")]
    modules = [p.with_suffix("").as_posix().replace("/", ".") for p in files if p.name != "__init__.py"]
    names = ["headstart." + m for m in modules] + ["headstart.cli"]
    code = ("import importlib, os, sys; before = dict(os.environ)\n"
            "for m in sys.argv[1:]: importlib.import_module(m)\n"
            "changed = {k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k)}\n"
            "assert not changed, changed")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]

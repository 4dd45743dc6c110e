"""The package's layering, checked over its import graph; `headstart --help` loads no heavy module.

heads/    imports neither runtime nor train
runtime/  never imports train
train/    may import heads and runtime
headstart/ (cli.py and its subcommands, commands/), the composition root, is the only place outside train/ that
imports train.
runtime/apps/ (the server, the bench, the demo, the device check) runs on the runtime's core; the core never
imports an app. runtime/sizing/ sits above the drafters: no drafter imports it.
No two files import each other, directly or around a loop (imports inside functions included).
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


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["generate", "--help"],
        ["bench", "--help"],
        ["serve", "--help"],
        ["distill", "--help"],
        ["demo", "--help"],
    ],
)
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
    code = (
        "import importlib, os, sys; before = dict(os.environ)\n"
        "for m in sys.argv[1:]: importlib.import_module(m)\n"
        "changed = {k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k)}\n"
        "assert not changed, changed"
    )
    proc = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def module_name(path: Path) -> str:
    """`heads/eagle3.py` -> headstart.heads.eagle3 (the installed namespace); a package's __init__ is the package."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    name = ".".join(parts if parts[0] == "headstart" else ("headstart", *parts))
    return name.removesuffix(".__init__")


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (at top level or inside functions; `from pkg import mod` is mod)."""
    files = {module_name(p): p for part in FORBIDDEN for p in (ROOT / part).rglob("*.py")}
    graph = {}
    for name, path in files.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            for imported in names:
                while imported and imported not in files:  # `from mod import name`: the module
                    imported = imported.rpartition(".")[0]
                if imported and imported not in (name, "headstart"):
                    found.add(imported)
        graph[name] = found
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import loops of `graph`: its strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_runtime_core_imports_no_app():
    """No module of runtime/ outside runtime/apps/ imports one inside it (at top level or inside functions)."""
    graph = import_graph()
    apps = "headstart.runtime.apps"
    core = [m for m in graph if m.startswith("headstart.runtime") and not (m == apps or m.startswith(apps + "."))]
    assert len(core) > 20 and any(m.startswith(apps + ".") for m in graph)
    reaching = {m: sorted(i for i in graph[m] if i == apps or i.startswith(apps + ".")) for m in core}
    assert not {m: apps_ for m, apps_ in reaching.items() if apps_}


def test_the_drafters_never_import_sizing():
    """runtime/sizing/ decides how large each tree is; the drafters (runtime/drafters/) draft what they are given and
    say what a size is worth (`Drafter` and `Offer`), never reaching up into it."""
    graph = import_graph()
    drafters, sizing = "headstart.runtime.drafters", "headstart.runtime.sizing"
    inside = [m for m in graph if m.startswith(drafters + ".")]
    assert len(inside) > 5 and any(i.startswith(sizing + ".") for m in graph for i in graph[m])
    reaching = {m: sorted(i for i in graph[m] if i == sizing or i.startswith(sizing + ".")) for m in inside}
    assert not {m: found for m, found in reaching.items() if found}


def test_no_import_loops():
    assert cycles(import_graph()) == []


def test_the_loop_finder_finds_a_loop_hidden_in_a_function():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_sizing_tells_no_drafter_apart_by_its_class():
    """runtime/sizing/ sizes every drafter through the interface they all have (`Drafter.curve`, `catch_up_ms`,
    `graft`, `drafting` at a size): no isinstance on a class it imports from runtime/drafters/."""
    found = []
    for path in sorted((ROOT / "runtime" / "sizing").glob("*.py")):
        tree = ast.parse(path.read_text())
        drafter_names = {
            alias.asname or alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("headstart.runtime.drafters")
            for alias in node.names
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
                kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
                found += [f"{path.name}:{node.lineno}" for k in kinds if getattr(k, "id", None) in drafter_names]
    assert found == []

"""The built wheel, installed into a fresh virtual environment (torch from this disk first), runs every
`headstart` subcommand from outside the checkout; the parts live under `headstart.` only."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from headstart.extras import EXTRAS

ROOT = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"  # the CPU build this machine keeps on disk (the Makefile's TORCH)


def run(*cmd, cwd, timeout=600, check=True) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, f"{cmd}: {proc.stderr[-2000:]}"
    return proc


def _module(distribution: str) -> str:
    """The import name of a distribution pyproject.toml lists."""
    name = re.split(r"[<>=\[ ]", distribution)[0].lower()
    return {"pyyaml": "yaml"}.get(name, name.replace("-", "_"))


def test_extras_agree_with_pyproject_and_with_every_modules_imports():
    """headstart/extras.py names each extra's modules, pyproject.toml its distributions: the same lists. Every
    module's top-level imports come from the core or from the extra of its part (runtime/server: serve, train:
    train); imports of other extras are made inside functions, behind `extras.require`."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    for extra, modules in EXTRAS.items():
        assert sorted(map(_module, extras[extra])) == sorted(modules), extra
    assert extras["all"] == [f"headstart[{','.join(sorted(EXTRAS, key=list(EXTRAS).index))}]"]
    core = {_module(d) for d in project["dependencies"]}
    serve = core | set(EXTRAS["serve"]) | {"starlette", "pydantic"}  # the last two come with fastapi
    allowed_by_part = {"runtime/apps/server/": serve, "train/": core | set(EXTRAS["train"])}
    third_party = set().union(*EXTRAS.values()) | serve | {"tokenizers", "numpy"}
    for path in sorted(
        [
            *ROOT.glob("headstart/*.py"),
            *ROOT.glob("heads/*.py"),
            *ROOT.glob("runtime/**/*.py"),
            *ROOT.glob("train/*.py"),
        ]
    ):
        rel = str(path.relative_to(ROOT))
        allowed = next((a for part, a in allowed_by_part.items() if rel.startswith(part)), core)
        for node in ast.parse(path.read_text()).body:  # top-level statements only
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                names = [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            for name in names:
                top = name.split(".")[0]
                assert top not in third_party or top in allowed, f"{rel} imports {top} at the top"


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """bin/ of a fresh venv holding the wheel built from this checkout, its core dependencies only."""
    tmp = tmp_path_factory.mktemp("wheel")
    run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        tmp / "dist",
        ROOT,
        cwd=tmp,
    )
    (wheel,) = (tmp / "dist").glob("headstart-*.whl")
    run(sys.executable, "-m", "venv", tmp / "venv", cwd=tmp)
    pip = tmp / "venv" / "bin" / "pip"
    run(pip, "install", "-q", TORCH, cwd=tmp)
    run(pip, "install", "-q", wheel, cwd=tmp)
    return tmp / "venv" / "bin"


def test_wheel_runs_every_subcommand_from_elsewhere(venv, tiny_model_dir, tmp_path):
    elsewhere = tmp_path  # not the checkout: nothing of it is on sys.path
    # the core install: generate runs; serve, bench and training say which extra they need, in one line
    out = run(
        venv / "headstart",
        "generate",
        "--model",
        tiny_model_dir,
        "--prompt",
        "the cat sat",
        "--drafter",
        "lookup",
        "--max-new-tokens",
        "6",
        "--json",
        cwd=elsewhere,
    ).stdout
    assert '"new_tokens": 6' in out
    for argv, extra in ((["serve"], "serve"), (["bench"], "bench"), (["distill", "--out", "x"], "train")):
        proc = run(venv / "headstart", *argv, cwd=elsewhere, check=False)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert f"pip install 'headstart[{extra}]'" in proc.stderr, proc.stderr
    proc = run(venv / "python", "-m", "headstart.train.heads", "--config", "x.yaml", cwd=elsewhere, check=False)
    assert proc.returncode == 2 and "pip install 'headstart[train]'" in proc.stderr, proc.stderr
    wheel = next(p for p in (venv.parent.parent / "dist").glob("headstart-*.whl"))
    run(venv / "pip", "install", "-q", f"{wheel}[all]", cwd=elsewhere)
    assert "usage: headstart" in run(venv / "headstart", "--help", cwd=elsewhere).stdout
    for sub in ("generate", "bench", "distill", "report", "serve", "loadtest", "demo"):
        run(venv / "headstart", sub, "--help", cwd=elsewhere)
    out = run(
        venv / "headstart",
        "generate",
        "--model",
        tiny_model_dir,
        "--prompt",
        "the cat sat",
        "--drafter",
        "lookup",
        "--max-new-tokens",
        "6",
        "--json",
        cwd=elsewhere,
    ).stdout
    assert '"new_tokens": 6' in out
    # loadtest's client library comes with a plain install: no server here, so one line and exit 2
    prompts = ROOT / "tests" / "data" / "prompts.jsonl"
    proc = run(
        venv / "headstart", "loadtest", "--url", "http://127.0.0.1:9", "--prompts", prompts, cwd=elsewhere, check=False
    )
    assert proc.returncode == 2 and "no OpenAI-compatible server at" in proc.stderr, proc.stderr
    python = venv / "python"
    run(python, "-c", "import headstart, headstart.runtime.engine, headstart.train.heads", cwd=elsewhere)
    for bare in ("runtime", "train", "heads"):
        assert run(python, "-c", f"import {bare}", cwd=elsewhere, check=False).returncode != 0, bare
    code = "from headstart.heads.checkpoint import SHIPPED; print(sorted(p.name for p in SHIPPED.iterdir()))"
    shipped = run(python, "-c", code, cwd=elsewhere).stdout
    assert "smollm2-135m-instruct-eagle" in shipped and "smollm2-135m-instruct-medusa" in shipped

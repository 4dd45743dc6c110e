"""The serving bench: a process started as the bench starts its servers imports the snapshot's code, not the
checkout's (from the checkout's root, `python -c` imported the working tree whatever PYTHONPATH said); repeated
levels take prompts of their own (with --unseen, no prompt sent twice) and report their median, and each repeat's
ratio to plain's in the same repeat; a bench short of memory stops rather than time the swap."""

from __future__ import annotations

import json
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


def test_repeats_take_prompts_of_their_own_and_report_their_median(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(f'{{"id": "{i}"}}\n' for i in range(6)))
    again = Path(serve_bench.rotated(str(prompts), 4, tmp_path)).read_text().splitlines()
    assert [json.loads(line)["id"] for line in again] == ["4", "5", "0", "1", "2", "3"]
    unseen = Path(serve_bench.sliced(str(prompts), 2, 3, tmp_path)).read_text().splitlines()
    assert [json.loads(line)["id"] for line in unseen] == ["2", "3", "4"]
    with pytest.raises(SystemExit, match="needs 7 prompts"):
        serve_bench.sliced(str(prompts), 4, 3, tmp_path)
    runs = [
        {"server": "a", "clients": 2, "tokens_per_s": 50.0, "wall_s": 2.0, "p50_ttft_s": 0.4},
        {"server": "a", "clients": 2, "tokens_per_s": 100.0, "wall_s": 1.0, "p50_ttft_s": 0.2},
        {"server": "a", "clients": 2, "tokens_per_s": 60.0, "wall_s": 1.5, "p50_ttft_s": 0.3},
    ]
    row = serve_bench.pooled(runs)
    assert row["tokens_per_s"] == 60.0 and row["p50_ttft_s"] == pytest.approx(0.3)
    assert (row["server"], row["clients"], row["repeat_tokens_per_s"]) == ("a", 2, [50.0, 100.0, 60.0])
    assert "60.0 (50.0 / 100.0 / 60.0)" in serve_bench.table(
        [{**row, "steady_tokens_per_s": 0.0, "p50_request_tokens_per_s": 0.0, "p95_ttft_s": 0.0}]
    )


def test_each_repeat_is_compared_with_plains_in_the_same_repeat():
    """Against plain a server's repeats are paired with plain's of the same repeat (run one after the other): a
    drift between repeats moves both; the ratio of medians is given beside the median of the paired ratios."""
    plain = {"server": "headstart plain (x)", "clients": 4, "tokens_per_s": 100.0}
    plain["repeat_tokens_per_s"] = [50, 100, 200]
    other = {"server": "headstart default drafter (x)", "clients": 4, "tokens_per_s": 90.0}
    other["repeat_tokens_per_s"] = [55, 90, 210]  # each repeat: 1.10, 0.90, 1.05 its plain's
    table = serve_bench.paired([plain, other])
    assert "| headstart default drafter (x) | 4 | 0.90x | 1.10 / 0.90 / 1.05 | 1.05x |" in table
    assert serve_bench.paired([plain]) == "" and serve_bench.paired([{**other, "repeat_tokens_per_s": [90]}]) == ""


def test_a_bench_short_of_memory_stops_before_it_measures():
    serve_bench.check_memory(None)  # not Linux: nothing to read
    serve_bench.check_memory(serve_bench.LEAST_FREE)
    with pytest.raises(SystemExit, match=r"0\.5 GiB of memory left beside the servers"):
        serve_bench.check_memory(serve_bench.LEAST_FREE // 2)


def test_unseen_prompts_are_rows_no_head_trained_on_nor_any_tuning_or_spec_bench_set_holds(tmp_path):
    shared = serve_bench.ROOT.parent / "shared" / "data"
    if not (shared / "train" / "prompts.jsonl").exists():
        pytest.skip("no shared prompts")
    first, later = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    serve_bench.write_unseen(first, 40)
    serve_bench.write_unseen(later, 20, skip=30)
    a = [json.loads(line) for line in first.open()]
    b = [json.loads(line) for line in later.open()]
    assert len(a) == 40 and a[30:] == b[:10] and len({x["id"] for x in a}) == 40  # one fixed order, skipped into
    rows = {f"{r['source']}/{r['id']}": r for r in map(json.loads, (shared / "train" / "prompts.jsonl").open())}
    assert all(rows[x["id"]]["permissive"] is False and rows[x["id"]]["turns"][0] == x["turns"][0] for x in a)
    tune = (serve_bench.ROOT / "configs" / "tune-prompts.jsonl").read_text()
    bench = (shared / "eval" / "spec_bench.jsonl").read_text()
    assert not any(json.dumps(x["turns"][0]) in tune + bench for x in a)

"""Prompt files: Spec-Bench's eight MT-bench categories grouped into one, limits taken in turn."""

from __future__ import annotations

import json

from headstart.runtime.apps.bench import SPEC_BENCH_GROUPS
from headstart.runtime.prompts import load_prompts


def test_grouped_categories_are_limited_in_turn(tmp_path):
    rows = [("writing", i) for i in range(3)] + [("roleplay", i) for i in range(3)] + [("math", 0)]
    rows += [("qa", i) for i in range(4)]
    path = tmp_path / "p.jsonl"
    lines = [json.dumps({"id": f"{c}{i}", "category": c, "turns": [f"{c} {i}"]}) + "\n" for c, i in rows]
    path.write_text("".join(lines))
    prompts = load_prompts(path, limit_per_category=4, groups=SPEC_BENCH_GROUPS)
    # mt_bench: one of each original category in turn (writing0, roleplay0, math0, writing1); qa: the first 4
    assert [(p.category, p.id) for p in prompts] == [
        ("mt_bench", "writing0"),
        ("mt_bench", "writing1"),
        ("mt_bench", "roleplay0"),
        ("mt_bench", "math0"),
        ("qa", "qa0"),
        ("qa", "qa1"),
        ("qa", "qa2"),
        ("qa", "qa3"),
    ]
    only = load_prompts(path, categories={"mt_bench"}, groups=SPEC_BENCH_GROUPS)
    assert len(only) == 7 and {p.category for p in only} == {"mt_bench"}

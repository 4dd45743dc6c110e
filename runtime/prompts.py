"""Read JSONL prompt files: rows `{"id", "category", "turns": [user turns ...]}` (Spec-Bench and training format)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str  # the first user turn
    origin: str = ""  # "source/id" as the file gives them (ids repeat across sources; `id` may be renamed)


def load_prompts(
    path: str | Path,
    categories: set[str] | None = None,
    limit_per_category: int | None = None,
    *,
    permissive_only: bool = False,
    limit: int | None = None,
    skip_malformed: bool = False,
    groups: dict[str, str] | None = None,
) -> list[Prompt]:
    """The first turn of each row, optionally filtered: some categories only, at most `limit_per_category`
    each, rows marked `permissive: true` only, the first `limit` in all.

    `groups` renames categories before filtering (Spec-Bench's eight MT-bench categories are one:
    `mt_bench`); a grouped category's `limit_per_category` prompts are then taken in turn from each
    of its original categories, so that a few prompts still cover them all.

    A malformed line is an error naming it, or with `skip_malformed` skipped with one warning that
    counts them. Ids are made unique (`id#n`) when the file repeats one.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"prompts file not found: {path}")
    prompts: list[Prompt] = []
    per_category: dict[str, int] = {}
    members: dict[str, dict[str, list[Prompt]]] = {}  # grouped category -> original category -> prompts
    bad = 0
    with path.open() as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                text = row["turns"][0] if "turns" in row else row["prompt"]
                if not isinstance(text, str) or not text.strip():
                    raise ValueError("empty prompt")
            except (json.JSONDecodeError, KeyError, IndexError, TypeError, ValueError) as e:
                if not skip_malformed:
                    raise ValueError(
                        f"{path}:{line_no}: not a prompt row with a non-empty 'turns' or 'prompt' ({e})"
                    ) from e
                bad += 1
                continue
            original = str(row.get("category", ""))
            category = (groups or {}).get(original, original)
            if (categories and category not in categories) or (permissive_only and row.get("permissive") is not True):
                continue
            grouped = category != original
            if not grouped and limit_per_category is not None and per_category.get(category, 0) >= limit_per_category:
                continue
            per_category[category] = per_category.get(category, 0) + 1
            raw_id = str(row.get("id", line_no))
            prompts.append(Prompt(raw_id, category, text, f"{row.get('source', '')}/{raw_id}"))
            if grouped:
                members.setdefault(category, {}).setdefault(original, []).append(prompts[-1])
            if limit is not None and len(prompts) >= limit:
                break
    if limit_per_category is not None and members:
        keep = {id(p) for by_original in members.values() for p in _in_turn(by_original, limit_per_category)}
        prompts = [p for p in prompts if p.category not in members or id(p) in keep]
    if bad:
        print(f"headstart: warning: skipped {bad} malformed line(s) in {path}", file=sys.stderr)
    if not prompts:
        raise ValueError(f"{path}: no prompts" + (f" in categories {sorted(categories)}" if categories else ""))
    if len({p.id for p in prompts}) != len(prompts):
        prompts = [Prompt(f"{p.id}#{i}", p.category, p.text, p.origin) for i, p in enumerate(prompts)]
    return prompts


def _in_turn(by_original: dict[str, list[Prompt]], n: int) -> list[Prompt]:
    """The first `n` prompts taking one from each original category in turn."""
    queues = [list(v) for v in by_original.values()]
    out: list[Prompt] = []
    while len(out) < n and any(queues):
        for q in queues:
            if q and len(out) < n:
                out.append(q.pop(0))
    return out

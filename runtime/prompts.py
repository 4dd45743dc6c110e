"""Read JSONL prompt files: rows `{"id", "category", "turns": [user turns ...]}` (Spec-Bench format)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str  # the first user turn


def load_prompts(path: str | Path, categories: set[str] | None = None, limit: int | None = None) -> list[Prompt]:
    """First turn of every row (optionally of some categories only, at most `limit` per category)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"prompts file not found: {path}")
    prompts: list[Prompt] = []
    per_category: dict[str, int] = {}
    with path.open() as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                text = row["turns"][0] if "turns" in row else row["prompt"]
            except (json.JSONDecodeError, KeyError, IndexError, TypeError) as e:
                raise ValueError(f"{path}:{line_no}: not a prompt row with 'turns' or 'prompt' ({e})") from e
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f"{path}:{line_no}: empty prompt")
            category = str(row.get("category", ""))
            if categories and category not in categories:
                continue
            if limit is not None and per_category.get(category, 0) >= limit:
                continue
            per_category[category] = per_category.get(category, 0) + 1
            prompts.append(Prompt(str(row.get("id", line_no)), category, text))
    if not prompts:
        raise ValueError(f"{path}: no prompts" + (f" in categories {sorted(categories)}" if categories else ""))
    return prompts

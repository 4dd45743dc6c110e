"""The shard format of distilled rows: JSONL files `shard-00000.jsonl`, ... of
`{"id", "category", "prompt_ids", "response_ids"}`, appended as rows finish, read back by training
(`train/data.py`), sources (`train/sources.py`) and both distillers (`train/distill.py`, `train/distill_remote.py`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from headstart.train.config import ensure_writable_dir


def shard_rows(folder: str | Path) -> Iterator[dict]:
    """Every row of a distillation folder's shards, in shard order; a last line cut by a kill is skipped."""
    for shard in sorted(Path(folder).glob("shard-*.jsonl")):
        for line in shard.read_text().splitlines():
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


class Shards:
    """The JSONL shards of a distillation folder: the ids already answered, and appending new rows.

    Opening repairs a last line cut by a kill; every append is flushed to disk before it returns, so a
    run killed at any point and started again neither repeats nor loses a row.
    """

    def __init__(self, out: str | Path, rows_per_shard: int = 1000) -> None:
        self.out, self.rows_per_shard = ensure_writable_dir(out), rows_per_shard
        for shard in sorted(self.out.glob("shard-*.jsonl")):
            data = shard.read_bytes()
            if data and not data.endswith(b"\n"):
                shard.write_bytes(data[: data.rfind(b"\n") + 1])
        self.done: set[str] = {row["id"] for row in shard_rows(self.out)}

    def append(self, rows: list[dict]) -> None:
        """Rows `{"id", "category", "prompt_ids", "response_ids"}`, written and synced to disk."""
        shard = self.out / f"shard-{len(self.done) // self.rows_per_shard:05d}.jsonl"
        with shard.open("a") as f:
            f.write("".join(json.dumps(row) + "\n" for row in rows))
            f.flush()
            os.fsync(f.fileno())
        self.done.update(row["id"] for row in rows)

    def figures(self, new_rows: int, new_tokens: int, seconds: float) -> dict:
        """What a run into this folder did: rows in it, rows and tokens it added, seconds, tokens/s."""
        rate = new_tokens / seconds if seconds else 0.0
        return {
            "rows": len(self.done),
            "new_rows": new_rows,
            "new_tokens": new_tokens,
            "seconds": seconds,
            "tokens_per_s": rate,
        }


def row_seed(seed: int, row_id: str) -> int:
    """A row's sampling seed (local and engine distillation): its answer at T > 0 depends on the run's seed and
    its id, not on its batch or on the order rows are answered in."""
    return seed + int(hashlib.sha256(row_id.encode()).hexdigest()[:12], 16)

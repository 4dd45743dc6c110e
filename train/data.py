"""Distilled rows -> length-bucketed micro-batches with loss masks over the assistant's tokens only."""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class Row:
    input_ids: list[int]  # prompt (chat template included) + response
    n_prompt: int  # tokens before the response: no loss there
    index: int = -1  # position in load_rows' list
    id: str = ""  # the distilled row's id (the feature cache's key)


def load_rows(paths: str | Path | list[str | Path], max_len: int) -> list[Row]:
    """Every distilled row under `paths` (folders of JSONL shards, read as one via `datasets`), cut to `max_len`
    tokens; a row id already read from an earlier folder is skipped."""
    from datasets import load_dataset

    rows, seen = [], set()
    for path in [paths] if isinstance(paths, str | Path) else paths:
        shards = sorted(str(p) for p in Path(path).glob("shard-*.jsonl"))
        if not shards:
            raise ValueError(f"no distilled shards (shard-*.jsonl) in {path}: run `headstart distill` first")
        data = load_dataset("json", data_files=shards, split="train")
        for row_id, prompt, response in zip(data["id"], data["prompt_ids"], data["response_ids"], strict=True):
            if response and len(prompt) < max_len and row_id not in seen:
                seen.add(row_id)
                rows.append(Row((prompt + response)[:max_len], len(prompt), len(rows), str(row_id)))
    return rows


def split_rows(rows: list[Row], eval_rows: int) -> tuple[list[Row], list[Row]]:
    """(train, held-out): the held-out rows are chosen by a hash of their tokens, so any order gives the same split."""

    def key(row: Row) -> str:
        return hashlib.sha256(str(row.input_ids).encode()).hexdigest()

    ranked = sorted(rows, key=key)
    return ranked[eval_rows:], ranked[:eval_rows]


def make_batches(rows: list[Row], batch_tokens: int, seed: int) -> list[list[int]]:
    """Row indices grouped by similar length, each group's padded size <= batch_tokens; groups shuffled by seed."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i].input_ids))
    batches, current, longest = [], [], 0
    for i in order:
        n = len(rows[i].input_ids)
        if current and max(longest, n) * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        batches.append(current)
    random.Random(seed).shuffle(batches)
    return batches


def collate(rows: list[Row], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input_ids (B, T), attention_mask (B, T), loss_mask (B, T): 1 on response tokens; row_index (B,)."""
    width = max(len(r.input_ids) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros(len(rows), width, dtype=torch.long)
    loss_mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, row in enumerate(rows):
        n = len(row.input_ids)
        ids[b, :n] = torch.tensor(row.input_ids)
        attention[b, :n] = 1
        loss_mask[b, row.n_prompt : n] = True
    row_index = torch.tensor([row.index for row in rows])
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask, "row_index": row_index}

"""The frozen target's features for every distilled row, computed once and read from disk as batches need them.

The heads learn from the target's final features (after its final norm; EAGLE-3: three inner
layers' hidden states beside them), which never change while the heads train. Running the target
for them is most of a training step (docs/training.md), so `data.features: DIR` computes them once
and every further epoch costs only the heads.

A training run fills it as it goes (`holds`, `keep`): a batch whose rows are all cached reads them, any other runs
the target, as without a cache, and keeps what it computed, so the first pass over the rows costs what training
without a cache costs and every later pass skips the target (an EAGLE-3 step here: 1.46 -> 0.67 s). `build`
computes every missing row first, for a launch whose processes must run the target together (a sharded target).

The cache is keyed by row id, so adding rows or sources computes only the new rows. New rows are saved in
files of CHUNK rows (safetensors, written atomically: an interrupted pass keeps every finished file), each
naming its rows' ids and the target (fingerprint, dtype, layers) in its metadata and storing their token ids;
an entry whose target or token ids no longer match its row is ignored and computed again. Nothing is held in
memory: a batch reads its rows' features from the memory-mapped files (EAGLE-3's are ~1 MB a row, and 25k
rows would not fit in this machine's RAM).
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from headstart.runtime.target import features
from headstart.train.data import Row, collate, make_batches
from headstart.train.fsdp import forwards_to_match

CHUNK = 256  # rows per file


def target_features(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: tuple[int, ...] = (-1,)
) -> torch.Tensor:
    """Frozen target: the hidden states `layers` names, concatenated (B, T, len(layers) * H), in the
    target's dtype; (-1,) = the final features after the final norm (`runtime.target.features`)."""
    with torch.no_grad():
        return features(hidden_states(model, input_ids, attention_mask), layers)


def hidden_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Every hidden state of the target's forward (`output_hidden_states`), its lm_head never run: the decoder
    alone. The causal LM would read out one position's logits, from a (B, 1, H) slice that the stock CPU linear
    in bfloat16 takes a slow path for (SmolLM2's lm_head: 1.5 s at B = 15 against 5 ms for a contiguous input,
    most of a training step)."""
    out = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
    return out.hidden_states


class FeatureCache:
    """Features of `rows` (indexed by Row.index, keyed on disk by Row.id) under `directory`, for the target
    described by `key`: the target's hidden states `layers`, concatenated."""

    def __init__(self, directory: str | Path, rows: list[Row], key: dict, layers: tuple[int, ...] = (-1,)) -> None:
        if any(row.index != i for i, row in enumerate(rows)):
            raise ValueError("FeatureCache needs the rows as load_rows returns them (row.index = position)")
        if len({row.id for row in rows}) != len(rows):
            raise ValueError("FeatureCache needs a distinct id per row (load_rows gives them)")
        self.dir = Path(directory)
        self.rows = rows
        self.layers = tuple(layers)
        self.key = json.dumps(
            {**key, **({} if self.layers == (-1,) else {"layers": list(self.layers)})}, sort_keys=True
        )
        self.where: dict[int, tuple[Path, int]] = {}  # row index -> (file, entry)
        self._files: dict[Path, object] = {}  # open memory-mapped files
        self.pending: dict[int, torch.Tensor] = {}  # row index -> features kept by `keep`, not yet in a file
        self.scan()

    def scan(self) -> None:
        """Index the valid entries: files made for this target whose stored token ids equal a row's."""
        by_id = {row.id: row for row in self.rows}
        self.where, self._files = {}, {}
        for path in sorted(self.dir.glob("features-*.safetensors")):
            try:
                with safe_open(str(path), "pt") as f:
                    meta = f.metadata() or {}
                    if meta.get("key") != self.key:
                        continue
                    for j, row_id in enumerate(json.loads(meta["ids"])):
                        row = by_id.get(row_id)
                        fresh = row is not None and row.index not in self.where
                        if fresh and f.get_tensor(f"ids.{j}").tolist() == row.input_ids:
                            self.where[row.index] = (path, j)
            except (OSError, SafetensorError, KeyError, ValueError):  # truncated, not safetensors, no ids
                continue

    def missing(self, rank: int = 0, world: int = 1) -> list[int]:
        """Rows this process must compute: every world-th row without a valid entry, from `rank`."""
        return [i for i in range(len(self.rows)) if i not in self.where][rank::world]

    def build(
        self,
        model,
        pad_id: int,
        batch_tokens: int,
        rank: int = 0,
        world: int = 1,
        progress: bool = True,
        lockstep: bool = False,
    ) -> int:
        """Compute and save this process's missing rows, CHUNK per file; returns how many rows were computed.
        Other processes' files are not re-read here: `scan()` after every process has built. `lockstep`: the
        target is sharded over the processes (`train/fsdp.py`), so each runs as many forwards as the busiest."""
        from tqdm import tqdm

        todo = self.missing(rank, world)
        chunks = [[self.rows[i] for i in todo[start : start + CHUNK]] for start in range(0, len(todo), CHUNK)]
        plan = [(rows, make_batches(rows, batch_tokens, seed=0)) for rows in chunks]
        device = next(model.parameters()).device
        spare = forwards_to_match(sum(len(groups) for _, groups in plan), device) if lockstep else 0
        bar = tqdm(
            total=len(todo), desc="target features", unit="row", disable=not progress or not todo, dynamic_ncols=True
        )
        for rows, groups in plan:
            feats: list[torch.Tensor | None] = [None] * len(rows)
            for group in groups:
                batch = collate([rows[i] for i in group], pad_id)
                ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
                out = target_features(model, ids, mask, self.layers)
                for b, i in enumerate(group):
                    feats[i] = out[b, : len(rows[i].input_ids)].cpu().contiguous()
                bar.update(len(group))
            self._save(rows, feats)
        bar.close()
        for _ in range(spare):  # forwards whose features nobody keeps: the other processes' layers gather with them
            batch = collate(self.rows[:1], pad_id)
            target_features(model, batch["input_ids"].to(device), batch["attention_mask"].to(device), self.layers)
        return len(todo)

    def _save(self, rows: list[Row], feats: list[torch.Tensor]) -> Path:
        """One file of these rows' features (each (n, F), n its tokens), written atomically."""
        tensors = {f"features.{j}": f for j, f in enumerate(feats)}
        tensors.update({f"ids.{j}": torch.tensor(r.input_ids, dtype=torch.int32) for j, r in enumerate(rows)})
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"features-{uuid.uuid4().hex[:16]}.safetensors"  # unique across processes and runs
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp), metadata={"key": self.key, "ids": json.dumps([r.id for r in rows])})
        os.replace(tmp, path)  # a file is either whole or absent
        return path

    def holds(self, row_index: list[int]) -> bool:
        """Whether every one of these rows has its features here (in a file or kept since the last one)."""
        return all(i in self.where or i in self.pending for i in row_index)

    def keep(self, row_index: list[int], feats: torch.Tensor) -> None:
        """Keep the features (B, T, F) a batch of these rows computed for those rows the cache lacks; every CHUNK
        rows kept make a file."""
        for b, i in enumerate(row_index):
            if i not in self.where and i not in self.pending:
                self.pending[i] = feats[b, : len(self.rows[i].input_ids)].detach().cpu().contiguous()
        if len(self.pending) >= CHUNK:
            self.flush()

    def flush(self) -> None:
        """Write the rows kept since the last file into one (a run stopped before loses only these)."""
        if not self.pending:
            return
        order = sorted(self.pending)
        path = self._save([self.rows[i] for i in order], [self.pending[i] for i in order])
        self.where.update({i: (path, j) for j, i in enumerate(order)})
        self.pending = {}

    def batch(self, row_index: list[int], width: int) -> torch.Tensor:
        """Right-padded features (B, width, H) of these rows, read from disk; zeros on padding (masked out of every
        loss). Every row must have an entry (`holds`)."""
        out = None
        for b, i in enumerate(row_index):
            if i in self.pending:
                feats = self.pending[i]
            elif i in self.where:
                path, j = self.where[i]
                if path not in self._files:
                    self._files[path] = safe_open(str(path), "pt")  # memory-mapped; kept open for later batches
                feats = self._files[path].get_tensor(f"features.{j}")
            else:
                raise ValueError(f"feature cache {self.dir} has no entry for row {self.rows[i].id!r}: build it first")
            if out is None:
                out = torch.zeros(len(row_index), width, feats.shape[-1], dtype=feats.dtype)
            n = min(width, feats.shape[0])
            out[b, :n] = feats[:n]
        return out

"""The frozen target's features for every distilled row, computed once and kept on disk.

The heads learn from the target's final features (after its final norm; EAGLE-3: three inner
layers' hidden states beside them), which never change while the heads train. Running the target
for them is most of a training step (docs/training.md), so `data.features: DIR` computes them once
and every further epoch costs only the heads.

Rows are cached in chunks of CHUNK rows, one safetensors file each, written atomically: an
interrupted pass resumes at its first missing chunk. Each chunk also stores its rows' token ids and
the target's fingerprint; a chunk that no longer matches (other data, other target) is computed again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from headstart.runtime.target import features
from headstart.train.data import Row, collate, make_batches

CHUNK = 256  # rows per file


def target_features(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: tuple[int, ...] = (-1,)
) -> torch.Tensor:
    """Frozen target: the hidden states `layers` names, concatenated (B, T, len(layers) * H), in the
    target's dtype; (-1,) = the final features after the final norm (`runtime.target.features`)."""
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, logits_to_keep=1)
    return features(out.hidden_states, layers)


class FeatureCache:
    """Features of `rows` (indexed by Row.index) under `directory`, for the target described by `key`:
    the target's hidden states `layers`, concatenated."""

    def __init__(self, directory: str | Path, rows: list[Row], key: dict, layers: tuple[int, ...] = (-1,)) -> None:
        if any(row.index != i for i, row in enumerate(rows)):
            raise ValueError("FeatureCache needs the rows as load_rows returns them (row.index = position)")
        self.dir = Path(directory)
        self.rows = rows
        self.layers = tuple(layers)
        self.key = json.dumps(
            {**key, **({} if self.layers == (-1,) else {"layers": list(self.layers)})}, sort_keys=True
        )
        self.features: list[torch.Tensor] = []  # per row (T_i, H), filled by load()

    @property
    def n_chunks(self) -> int:
        return -(-len(self.rows) // CHUNK)

    def chunk_path(self, c: int) -> Path:
        return self.dir / f"features-{c:05d}.safetensors"

    def chunk_rows(self, c: int) -> list[Row]:
        return self.rows[c * CHUNK : (c + 1) * CHUNK]

    def chunk_is_valid(self, c: int) -> bool:
        """The file exists, was made for this target, and holds exactly these rows' token ids."""
        path, rows = self.chunk_path(c), self.chunk_rows(c)
        if not path.is_file():
            return False
        try:
            with safe_open(str(path), "pt") as f:
                if (f.metadata() or {}).get("key") != self.key or len(f.keys()) != 2 * len(rows):
                    return False
                return all(f.get_tensor(f"ids.{i}").tolist() == row.input_ids for i, row in enumerate(rows))
        except (OSError, SafetensorError):  # truncated or not a safetensors file: compute again
            return False

    def missing(self, rank: int = 0, world: int = 1) -> list[int]:
        """Chunks this process must compute: the invalid ones among every world-th, from `rank`."""
        return [c for c in range(rank, self.n_chunks, world) if not self.chunk_is_valid(c)]

    def build(self, model, pad_id: int, batch_tokens: int, rank: int = 0, world: int = 1, progress: bool = True) -> int:
        """Compute and save this process's missing chunks; returns how many were computed."""
        from tqdm import tqdm

        todo = self.missing(rank, world)
        if not todo:
            return 0
        self.dir.mkdir(parents=True, exist_ok=True)
        device = next(model.parameters()).device
        n_rows = sum(len(self.chunk_rows(c)) for c in todo)
        bar = tqdm(total=n_rows, desc="target features", unit="row", disable=not progress, dynamic_ncols=True)
        for c in todo:
            rows = self.chunk_rows(c)
            tensors: dict[str, torch.Tensor] = {}
            for group in make_batches(rows, batch_tokens, seed=0):
                batch = collate([rows[i] for i in group], pad_id)
                ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
                feats = target_features(model, ids, mask, self.layers)
                for b, i in enumerate(group):
                    n = len(rows[i].input_ids)
                    tensors[f"features.{i}"] = feats[b, :n].cpu().contiguous()
                    tensors[f"ids.{i}"] = torch.tensor(rows[i].input_ids, dtype=torch.int32)
                bar.update(len(group))
            tmp = self.chunk_path(c).with_suffix(".tmp")
            save_file(tensors, str(tmp), metadata={"key": self.key})
            os.replace(tmp, self.chunk_path(c))  # a chunk is either whole or absent
        bar.close()
        return len(todo)

    def load(self) -> None:
        """Read every chunk into memory (all chunks must be valid: build() first, on every process)."""
        features: list[torch.Tensor] = []
        for c in range(self.n_chunks):
            if not self.chunk_is_valid(c):
                raise ValueError(f"feature cache {self.chunk_path(c)} is missing or stale; build it first")
            with safe_open(str(self.chunk_path(c)), "pt") as f:
                features += [f.get_tensor(f"features.{i}") for i in range(len(self.chunk_rows(c)))]
        self.features = features

    def batch(self, row_index: list[int], width: int) -> torch.Tensor:
        """Right-padded features (B, width, H) of these rows; zeros on padding (masked out of every loss)."""
        first = self.features[row_index[0]]
        out = torch.zeros(len(row_index), width, first.shape[-1], dtype=first.dtype)
        for b, i in enumerate(row_index):
            n = min(width, self.features[i].shape[0])
            out[b, :n] = self.features[i][:n]
        return out

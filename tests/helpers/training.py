"""Training set-ups on the tiny model: synthetic distilled rows and a config over them."""

from __future__ import annotations

import json
import random

import torch

from headstart.train.config import load_config
from helpers.models import WORDS


def write_shards(path, n_rows=40, seed=0):
    """Synthetic distilled rows: a prompt then a response drawn from a small repeating pattern."""
    rng = random.Random(seed)
    vocab = len(WORDS)
    path.mkdir(parents=True, exist_ok=True)
    with (path / "shard-00000.jsonl").open("w") as f:
        for i in range(n_rows):
            prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(3, 8))]
            start = rng.randrange(3, vocab - 6)
            response = [start + (j % 5) for j in range(rng.randrange(8, 20))]
            f.write(json.dumps({"id": str(i), "category": "x", "prompt_ids": prompt, "response_ids": response}) + "\n")


def write_rows(path, rows: list[tuple[list[int], list[int]]]) -> None:
    """(prompt ids, response ids) pairs as one distilled shard."""
    path.mkdir(parents=True, exist_ok=True)
    with (path / "shard-00000.jsonl").open("w") as f:
        for i, (prompt, response) in enumerate(rows):
            f.write(json.dumps({"id": str(i), "category": "x", "prompt_ids": prompt, "response_ids": response}) + "\n")


def greedy_rows(model, prompts: list[list[int]], new_tokens: int) -> list[tuple[list[int], list[int]]]:
    """The model's own greedy continuations of `prompts`: what distillation would write for it."""
    rows = []
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new_tokens, pad_token_id=0)
        rows.append((prompt, out[0, len(prompt) :].tolist()))
    return rows


def make_cfg(tmp_path, model_dir, kind="medusa", **extra):
    data = extra.pop("data.path", tmp_path / "data")
    if not data.exists():
        write_shards(data)
    overrides = [
        f"target.model={model_dir}",
        f"heads.kind={kind}",
        f"data.path={data}",
        "data.eval_rows=8",
        "data.batch_tokens=128",
        "optim.max_steps=6",
        "optim.warmup_steps=2",
        "optim.lr=0.01",
        "log_every=1",
        "eval_every=3",
        "save_every=3",
        f"output_dir={tmp_path / 'out'}",
        "heads.num_heads=3",
    ]
    return load_config(None, overrides + [f"{k}={v}" for k, v in extra.items()])

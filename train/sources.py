"""Distilled data as sources: what made a folder (its manifest), several folders read as one, held-out prompts.

A distillation folder (`headstart distill --out DIR`) holds JSONL shards and `manifest.json`:

    {"made_by": {"target": <fingerprint>, "chat_template_sha": ..., "dtype": ..., "max_new_tokens": ...,
                 "temperature": ...},
     "runs": [{"prompts": FILE, "prompts_sha": ..., "filter": {...}, "new_rows": N, "finished": DATE}, ...]}

`made_by` is what every row shares: a run that would add rows made otherwise (another target, tokenizer,
chat template, dtype, answer length or temperature) is refused before it answers anything; `runs` lists
what each run answered. Training reads `data.path` and `data.sources` as one set of rows (an id seen twice is
read once) and checks each folder's manifest against its target: another target or chat template is an
error naming the folder; a folder without a manifest (shards from before manifests) is read with a warning.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path

from headstart.heads.checkpoint import target_fingerprint
from headstart.runtime.prompts import Prompt, load_prompts
from headstart.train.shards import shard_rows

MANIFEST = "manifest.json"
TARGET_KEYS = ("architecture", "vocab_size", "hidden_size", "num_layers", "lm_head_sha", "tokenizer_sha", "adapter")


class SourceError(ValueError):
    """A data source that cannot be used as asked: one line naming it."""


def made_by(model, tokenizer, max_new_tokens: int, temperature: float) -> dict:
    """What every row of a distillation folder shares: target, chat template, dtype, answer length, temperature."""
    fp = target_fingerprint(model, tokenizer)
    template = tokenizer.chat_template or ""
    return {
        "target": {k: fp[k] for k in ("name", *TARGET_KEYS) if k in fp},
        "chat_template_sha": hashlib.sha256(template.encode()).hexdigest()[:16],
        "dtype": str(model.dtype).removeprefix("torch."),
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
    }


def read_manifest(folder: str | Path) -> dict | None:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise SourceError(f"{path}: not a manifest ({e})") from None


def _differences(ours: dict, theirs: dict) -> list[str]:
    out = [k for k in TARGET_KEYS if ours["target"].get(k) != theirs.get("target", {}).get(k)]
    settings = ("chat_template_sha", "dtype", "max_new_tokens", "temperature")
    return out + [k for k in settings if ours[k] != theirs.get(k)]


def open_manifest(folder: str | Path, made: dict) -> None:
    """Before adding rows to `folder`: refuse when its manifest says its rows were made otherwise; write the
    manifest when there is none yet (so a run killed before its end still leaves one)."""
    manifest = read_manifest(folder)
    if manifest is None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        _write(folder, {"made_by": made, "runs": []})
        return
    differ = _differences(made, manifest["made_by"])
    if differ:
        raise SourceError(
            f"{folder} holds rows made with another {', '.join(differ)} ({manifest['made_by']['target'].get('name')}, "
            f"{manifest['made_by']['dtype']}, {manifest['made_by']['max_new_tokens']} new tokens): distil into "
            "another folder and read both as sources"
        )


def record_run(folder: str | Path, run: dict) -> None:
    """Append `run` to the folder's manifest (`open_manifest` first)."""
    manifest = read_manifest(folder)
    manifest["runs"].append({**run, "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    _write(folder, manifest)


def _write(folder: str | Path, manifest: dict) -> None:
    """The manifest, written whole and atomically."""
    path = Path(folder) / MANIFEST
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, path)


def file_sha(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def check_sources(folders: list[str], model, tokenizer) -> None:
    """Every training source exists, holds shards, and (when it has a manifest) was made by this target with this
    chat template; a folder without a manifest gets a one-line warning."""
    made = made_by(model, tokenizer, 0, 0.0)
    for folder in folders:
        if not Path(folder).is_dir() or not any(Path(folder).glob("shard-*.jsonl")):
            raise SourceError(f"data source {folder}: no distilled shards (shard-*.jsonl) there")
        manifest = read_manifest(folder)
        if manifest is None:
            print(
                f"headstart: warning: data source {folder} has no {MANIFEST}: what made its rows is not checked",
                file=sys.stderr,
            )
            continue
        differ = [k for k in _differences(made, manifest["made_by"]) if k in (*TARGET_KEYS, "chat_template_sha")]
        if differ:
            theirs = manifest["made_by"]["target"].get("name", "?")
            raise SourceError(
                f"data source {folder} was distilled by another target or chat template ({theirs}: "
                f"{', '.join(differ)} differ)"
            )


def answered_ids(folders: list[str]) -> frozenset[str]:
    """Ids of the rows in these folders' shards (a last line cut by a kill is ignored)."""
    return frozenset(row["id"] for folder in folders for row in shard_rows(folder))


def read_ids(path: str | Path) -> list[str]:
    """Prompt ids from a text file, one a line (a line starting with `#` is a comment; ids may hold `#`)."""
    lines = (line.strip() for line in Path(path).read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def _normal(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def held_out(prompts: list[Prompt], files: list[str | Path]) -> tuple[list[Prompt], int]:
    """`prompts` without those of `files` (tuning and evaluation prompts): the same source and id as the file
    gives them (ids repeat across sources), the same id (derived prompts), or the same text up to case and
    whitespace. A `.txt` file lists prompt ids (the committed held-out list). Returns (kept, how many were
    dropped)."""
    ids, origins, texts = set(), set(), set()
    for f in files:
        if str(f).endswith(".txt"):
            ids.update(read_ids(f))
            continue
        for p in load_prompts(f, skip_malformed=True):
            ids.add(p.id)
            origins.add(p.origin)
            texts.add(_normal(p.text))
    kept = [p for p in prompts if p.id not in ids and p.origin not in origins and _normal(p.text) not in texts]
    return kept, len(prompts) - len(kept)

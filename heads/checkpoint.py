"""Head checkpoints: a directory with `config.json` and `model.safetensors`, bound to one target.

config.json (`CheckpointConfig`) holds the head kind and sizes, the training config and metrics, and
the target's fingerprint: architecture, vocab size, hidden size, layer count, the LoRA adapter
applied on top (a hash, `runtime/adapters.py`), and hashes of the tokenizer vocabulary and of the
lm_head (taken at bfloat16 precision, so a float32 and a bfloat16 load of one model agree).
Loading onto another target fails with a message naming both. Medusa-2 heads (`medusa2`) also hold
the LoRA adapter they were trained with (peft's adapter_config.json + adapter_model.safetensors): their
target is base + that adapter, and loading them through a drafter loads it (`runtime/drafters/registry.py`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from headstart.heads.kinds import KINDS, get_kind

SHIPPED = Path(str(resources.files("headstart.heads") / "trained"))  # heads this project trained and ships


def shipped_heads(model_name: str, kind: str) -> Path | None:
    """The heads of `kind` shipped for the embedded model `model_name` (trained/<model>-<kind>), if any."""
    path = SHIPPED / f"{model_name}-{kind}"
    return path if (path / "config.json").is_file() else None


class HeadsMismatchError(ValueError):
    """Heads loaded onto a target they were not trained for."""


def target_fingerprint(model: nn.Module, tokenizer=None, name: str | None = None) -> dict:
    config = model.config
    lm_head = model.get_output_embeddings().weight.detach()
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a live peft adapter: its model
    fp = {
        "name": name or getattr(config, "name_or_path", "") or "unnamed",
        "architecture": type(base).__name__,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_layers": config.num_hidden_layers,
        "lm_head_sha": hashlib.sha256(lm_head.to(torch.bfloat16).float().cpu().numpy().tobytes()).hexdigest()[:16],
    }
    adapter = getattr(config, "headstart_adapter", None)  # the LoRA adapter applied on top, if any
    if adapter:  # written only when there is one: fingerprints of plain targets stay as they were
        fp["adapter"] = adapter
    if tokenizer is not None:
        vocab = json.dumps(sorted(tokenizer.get_vocab().items()))
        fp["tokenizer_sha"] = hashlib.sha256(vocab.encode()).hexdigest()[:16]
    return fp


def _describe(fp: dict) -> str:
    adapter = f"adapter {fp['adapter']}" if fp.get("adapter") else "no adapter"
    return (
        f"{fp['name']} ({fp['architecture']}, vocab {fp['vocab_size']}, hidden {fp['hidden_size']}, "
        f"{fp['num_layers']} layers, lm_head {fp['lm_head_sha']}, {adapter})"
    )


def check_fingerprint(trained_for: dict, target: dict, where: str, allow_adapter_mismatch: bool = False) -> None:
    """Refuse heads trained for another target. Another LoRA adapter (or none where the heads had one) is
    refused too unless `allow_adapter_mismatch`: verification keeps the output exact, but acceptance may drop."""
    keys = [k for k in trained_for if k not in ("name", "adapter") and k in target]
    mismatch = f"heads in {where} were trained for {_describe(trained_for)}, not for the target {_describe(target)}"
    if any(trained_for[k] != target[k] for k in keys):
        raise HeadsMismatchError(mismatch)
    if trained_for.get("adapter") != target.get("adapter"):  # heads from before adapters: trained on the base
        if not allow_adapter_mismatch:
            raise HeadsMismatchError(
                f"{mismatch} (`allow_adapter_mismatch` runs them anyway: the output stays exact, acceptance may drop)"
            )
        warnings.warn(f"{mismatch}: running them anyway; the output stays exact, acceptance may drop", stacklevel=2)


def cast_floats(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Floating-point tensors to `dtype`; integer ones (the draft vocabulary's ids) stay as they are."""
    return t.to(dtype) if t.is_floating_point() else t


def build_heads(kind: str, model: nn.Module, **options) -> nn.Module:
    """A fresh head module of `kind` (heads/kinds.py) for the target `model`."""
    return get_kind(kind).build(model, **options)


@dataclass(frozen=True)
class CheckpointConfig:
    """A heads directory's config.json, typed: read (`read`) and written (`save_heads`) here only."""

    kind: str  # a registered kind (heads/kinds.py)
    target: dict  # the fingerprint of the target the heads were trained for (`target_fingerprint`)
    options: dict = field(default_factory=dict)  # `build_heads` keyword arguments (num_heads, layers, draft_vocab)
    dtype: str = "bfloat16"  # of the saved weights
    rank_accuracy: list[list[float]] | None = None  # per depth, per rank: what trees are shaped from
    draft_layer: dict | None = None  # EAGLE-3: the draft layer's Llama config, for the engines (heads.export)
    training: dict | None = None  # the training run's resolved config (its `data` section)
    vocab_order: str = "frequency"  # of the draft vocabulary's rows; "token_id" (published heads): read out all
    extra: dict = field(default_factory=dict)  # the rest as written: metrics, steps, data_rows, init_from, ...

    FIELDS = ("kind", "target", "options", "dtype", "rank_accuracy", "draft_layer", "training", "vocab_order")

    @property
    def measured_accuracy(self) -> list[list[float]] | None:
        """`rank_accuracy` when it can shape a tree; None when absent (published heads) or 0 at every rank (heads
        never right on their held-out rows): trees then come from their drafter's prior or grow dynamically."""
        measured = self.rank_accuracy or []
        return self.rank_accuracy if any(acc > 0 for depth in measured for acc in depth) else None

    @classmethod
    def from_json(cls, config: dict) -> CheckpointConfig:
        return cls(
            **{k: config[k] for k in cls.FIELDS if k in config},
            extra={k: v for k, v in config.items() if k not in cls.FIELDS},
        )

    def to_json(self) -> dict:
        fields = {k: getattr(self, k) for k in self.FIELDS}
        return {**{k: v for k, v in fields.items() if v is not None}, **self.extra}

    @classmethod
    def read(cls, directory: str | Path) -> CheckpointConfig:
        """config.json of a heads directory, or a ValueError in one line saying what is wrong."""
        path = Path(directory) / "config.json"
        if not path.is_file():
            raise ValueError(f"{directory} is not a heads checkpoint (needs config.json and model.safetensors)")
        try:
            config = json.loads(path.read_text())
        except ValueError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
        if (
            not isinstance(config, dict)
            or config.get("kind") not in KINDS
            or not isinstance(config.get("target"), dict)
        ):
            raise ValueError(
                f"{directory} is not a heads checkpoint (its config.json names no head kind and target; "
                "a model directory goes to --model)"
            )
        return cls.from_json(config)

    @classmethod
    def find(cls, directory: str | Path | None) -> CheckpointConfig | None:
        """`read`, or None where there is no headstart config.json (no directory, a bare LoRA adapter, heads in a
        published layout: `load_heads` reads those and says what is wrong with them)."""
        if directory is None or not (Path(directory) / "config.json").is_file():
            return None
        try:
            return cls.read(directory)
        except ValueError:
            return None


def save_heads(
    directory: str | Path,
    heads: nn.Module,
    kind: str,
    options: dict,
    fingerprint: dict,
    extra: dict | None = None,
    state: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write config.json + model.safetensors (bfloat16 unless `extra['dtype']` says otherwise). `state`: the heads'
    full weights when `heads.state_dict()` would give a process's shards (FSDP, ZeRO-3: gathered by the trainer)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    extra = dict(extra or {})
    dtype = getattr(torch, extra.setdefault("dtype", "bfloat16"))
    state = heads.state_dict() if state is None else state
    state = {k: cast_floats(v.detach(), dtype).contiguous().cpu() for k, v in state.items()}
    save_file(state, directory / "model.safetensors")
    if hasattr(heads, "layer_config"):  # EAGLE-3: the draft layer's Llama config, for the engines (heads.export)
        extra["draft_layer"] = heads.layer_config()
    save_config(
        directory, CheckpointConfig.from_json({"kind": kind, "options": options, "target": fingerprint, **extra})
    )
    return directory


def save_config(directory: str | Path, config: CheckpointConfig) -> None:
    """Write a heads directory's config.json (atomically: a crash leaves the old one)."""
    path = Path(directory) / "config.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(config.to_json(), indent=2))
    tmp.replace(path)


def cut_draft_vocab(directory: str | Path, out: str | Path, n: int) -> Path:
    """Write the heads in `directory` to `out` keeping only their `n` most frequent draft tokens: what drafting
    with `--draft-vocab n` reads out, in a smaller file (an EAGLE-3 head's lm_head keeps its first n rows). The
    stored per-rank accuracies stay those measured with the full vocabulary."""
    config, weights = read_checkpoint(directory)
    vocab = weights.get("draft_vocab")
    if config.vocab_order != "frequency" or vocab is None or not 0 < n < len(vocab):
        raise ValueError(
            f"{directory}: cannot keep {n} draft tokens (it holds "
            f"{'none' if vocab is None else len(vocab)}, ordered by {config.vocab_order})"
        )
    weights = {k: v[:n] if k in ("draft_vocab", "lm_head.weight") else v for k, v in weights.items()}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, out / "model.safetensors")
    layer = {**config.draft_layer, "draft_vocab_size": n} if config.draft_layer else None
    save_config(out, dataclasses.replace(config, options={**config.options, "draft_vocab": n}, draft_layer=layer))
    return out


def read_checkpoint(directory: str | Path) -> tuple[CheckpointConfig, dict[str, torch.Tensor]]:
    """(config, weights) of a heads directory, or a ValueError in one line saying what is wrong."""
    directory = Path(directory)
    if not (directory / "model.safetensors").is_file():
        raise ValueError(f"{directory} is not a heads checkpoint (needs config.json and model.safetensors)")
    config = CheckpointConfig.read(directory)
    try:
        weights = load_file(directory / "model.safetensors")
    except Exception as e:  # a truncated or foreign file: one line naming it
        raise ValueError(f"cannot read the heads in {directory}: {type(e).__name__}: {str(e)[:200]}") from e
    return config, weights


def write_new_dir(out_dir: Path, write: Callable[[Path], object]) -> Path:
    """`write(tmp)` into a temporary folder beside `out_dir` (which must not exist, or be empty), then moved into
    place: a failed write leaves nothing."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ValueError(f"{out_dir} exists and is not empty: choose a new folder")
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    except OSError as e:
        raise ValueError(f"cannot write into {out_dir.parent}: {e.strerror}") from e
    try:
        write(tmp)
        if out_dir.exists():
            out_dir.rmdir()  # empty, checked above
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir

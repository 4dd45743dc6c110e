"""LoRA-adapted targets: a base model plus a peft LoRA adapter directory (`--adapter DIR`).

The adapter is loaded with peft onto the base model and by default merged into its weights (no
extra matmuls per token); `merge=False` keeps it live (the same logits to 1e-4 in float32, tested).
The loaded model's config records which adapter it carries (`config.headstart_adapter`: a hash of
the adapter's config and weights), and the heads' target fingerprint covers it: heads trained for
base + A are refused on the base alone or on base + B (`heads/checkpoint.py`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CONFIG = "adapter_config.json"
WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


class AdapterError(ValueError):
    """An adapter directory that cannot be applied to the target: the message says why, in one line."""


@contextlib.contextmanager
def quiet_peft() -> Iterator[None]:
    """peft building a model: transformers 5 warns of a deprecated name peft still reads, noise for users."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        yield


def is_adapter_dir(directory: str | Path) -> bool:
    """Whether `directory` holds a peft adapter (its config file); `read_adapter` says whether it is usable."""
    return (Path(directory) / CONFIG).is_file()


def read_adapter(directory: str | Path) -> tuple[dict, Path]:
    """(adapter_config.json, weights file) of a peft LoRA adapter directory, or an AdapterError."""
    directory = Path(directory)
    weights = next((directory / w for w in WEIGHTS if (directory / w).is_file()), None)
    if not (directory / CONFIG).is_file() or weights is None:
        raise AdapterError(f"{directory} is not a peft adapter directory (needs {CONFIG} and {WEIGHTS[0]})")
    try:
        config = json.loads((directory / CONFIG).read_text())
    except ValueError as e:
        raise AdapterError(f"{directory / CONFIG} is not valid JSON: {e}") from None
    kind = config.get("peft_type") if isinstance(config, dict) else None
    if kind != "LORA":
        raise AdapterError(f"{directory} holds a {kind or 'unknown'} adapter; headstart applies LoRA adapters only")
    return config, weights


def adapter_sha(directory: str | Path) -> str:
    """A short hash of the adapter's config and weights: what the heads' fingerprint records."""
    config, weights = read_adapter(directory)
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    digest.update(weights.read_bytes())
    return digest.hexdigest()[:16]


def apply_adapter(model: Any, directory: str | Path, merge: bool = True) -> Any:
    """`model` with the LoRA adapter in `directory`: merged into its weights, or live (a peft model)."""
    from peft import PeftModel

    sha = adapter_sha(directory)  # validates the directory first
    try:
        with quiet_peft():
            adapted = PeftModel.from_pretrained(model, str(directory), is_trainable=False)
    except Exception as e:  # weights of other shapes, modules the model lacks: one line naming both
        name = getattr(model.config, "name_or_path", "") or type(model).__name__
        raise AdapterError(
            f"cannot apply the adapter in {directory} to {name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        ) from e
    model = adapted.merge_and_unload() if merge else adapted
    model.config.headstart_adapter = sha
    return model.eval().requires_grad_(False)

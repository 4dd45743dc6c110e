"""Heads onto a target, whatever layout they come in: headstart's own checkpoints (`heads/checkpoint.py`) or a
published layout (`heads/published.py`), checked against the target either way."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from headstart.heads.checkpoint import (
    CheckpointConfig,
    build_heads,
    cast_floats,
    check_fingerprint,
    read_checkpoint,
    target_fingerprint,
)
from headstart.heads.published import adopt, detect_layout, read_published


def load_heads(
    directory: str | Path, model: nn.Module, tokenizer=None, allow_adapter_mismatch: bool = False
) -> tuple[nn.Module, CheckpointConfig]:
    """Load heads from `directory` onto the target `model`; returns (module, config). A directory in a published
    layout (`heads/published.py`) is read as such and checked against `model`."""
    if detect_layout(directory) != "headstart":
        config, state = adopt(read_published(directory), model, tokenizer, str(directory))
    else:
        config, state = read_checkpoint(directory)
        check_fingerprint(config.target, target_fingerprint(model, tokenizer), str(directory), allow_adapter_mismatch)
    heads = build_heads(config.kind, model, **config.options)
    try:
        heads.load_state_dict({k: cast_floats(v, model.dtype) for k, v in state.items()})
    except RuntimeError as e:  # weights of other shapes: one line naming the file
        raise ValueError(f"cannot load {Path(directory) / 'model.safetensors'}: {str(e)[:200]}") from e
    return heads.to(device=model.device, dtype=model.dtype).eval().requires_grad_(False), config

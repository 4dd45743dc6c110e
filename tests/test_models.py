"""The converted-model cache: one entry per GGUF content, wherever the file is installed."""

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

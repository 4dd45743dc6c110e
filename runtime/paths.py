"""Where headstart keeps what it makes on a machine (converted models, measured costs, the native library, runs)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$HEADSTART_CACHE, else $XDG_CACHE_HOME/headstart, else ~/.cache/headstart."""
    if os.environ.get("HEADSTART_CACHE"):
        return Path(os.environ["HEADSTART_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "headstart"

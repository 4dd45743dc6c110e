"""headstart: exact self-speculative decoding for Hugging Face causal LMs with trained draft heads.

    from headstart import Engine, SamplingParams
    engine = Engine.load("smollm2-135m-instruct", drafter="eagle+lookup")
    print(engine.generate("Summarize: ...", sampling=SamplingParams(0.0)).text)

The parts install as `headstart.heads` (head modules and checkpoints), `headstart.runtime` (target,
drafters, decode loop, server, benchmarks) and `headstart.train` (distillation and head training);
`headstart.cli` wires them into the `headstart` command. The public names below load on first use,
so `import headstart` (and `headstart --help`) stays fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.2.0"

_PUBLIC = {
    "Engine": "headstart.runtime.engine",
    "Result": "headstart.runtime.engine",
    "SamplingParams": "headstart.runtime.sampling",
    "GenerationStats": "headstart.runtime.generate",
    "DraftTree": "headstart.runtime.tree",
    "Drafter": "headstart.runtime.drafters.base",
    "make_drafter": "headstart.runtime.drafters.registry",
    "load_model": "headstart.runtime.models",
}
__all__ = [
    "DraftTree",
    "Drafter",
    "Engine",
    "GenerationStats",
    "Result",
    "SamplingParams",
    "__version__",
    "load_model",
    "make_drafter",
]

if TYPE_CHECKING:
    from headstart.runtime.drafters.base import Drafter
    from headstart.runtime.drafters.registry import make_drafter
    from headstart.runtime.engine import Engine, Result
    from headstart.runtime.generate import GenerationStats
    from headstart.runtime.models import load_model
    from headstart.runtime.sampling import SamplingParams
    from headstart.runtime.tree import DraftTree


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'headstart' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)

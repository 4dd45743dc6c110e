"""Install extras: what each part of headstart needs beyond the core, and one line naming the extra when it is
missing.

    pip install headstart            # generate, demo, convert, export, calibrate (LoRA targets included)
    pip install 'headstart[serve]'   # serve, loadtest
    pip install 'headstart[bench]'   # bench, check (charts, W&B)
    pip install 'headstart[train]'   # distill, drift, report, the training entry (accelerate launch)
    pip install 'headstart[all]'

The distributions are listed in pyproject.toml; the modules they provide here (`tests/test_packaging.py` checks
that both lists and every module's imports agree).
"""

from __future__ import annotations

import importlib.util

# the modules each extra provides (the import names of pyproject.toml's optional dependencies)
EXTRAS: dict[str, tuple[str, ...]] = {
    "serve": ("fastapi", "uvicorn", "prometheus_client", "httpx"),
    "bench": ("matplotlib", "wandb"),
    "train": ("accelerate", "datasets", "wandb", "yaml", "matplotlib", "httpx"),
}
COMMANDS = {  # headstart subcommands that need an extra
    "serve": "serve",
    "loadtest": "serve",
    "bench": "bench",
    "check": "bench",
    "distill": "train",
    "drift": "train",
    "report": "train",
    "score": "train",
}


class MissingExtraError(ImportError):
    """A part of headstart whose extra is not installed: one line naming it."""


def missing_modules(modules: tuple[str, ...]) -> list[str]:
    """The modules of `modules` that cannot be imported here."""
    missing = []
    for name in modules:
        try:
            if importlib.util.find_spec(name) is None:
                missing.append(name)
        except (ImportError, ValueError):
            missing.append(name)
    return missing


def require(extra: str, what: str) -> None:
    """Raise MissingExtraError (one line) when `extra`'s modules are not all installed; `what` needs them."""
    missing = missing_modules(EXTRAS[extra])
    if missing:
        raise MissingExtraError(
            f"{what} needs the '{extra}' extra ({', '.join(missing)} not installed): pip install 'headstart[{extra}]'"
        )

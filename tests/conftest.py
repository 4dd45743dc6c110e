"""Shared fixtures; the helpers they use live in tests/helpers (imported as `helpers`)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from headstart.runtime.target import Target
from helpers.drafters import drafter_setup
from helpers.models import WORDS, tiny_llama, tiny_tokenizer


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--no-prepack",
        action="store_true",
        help="every Target on the stock kernels (make test runs exactness tests both ways)",
    )


def pytest_configure(config: pytest.Config) -> None:
    # the training and distillation runs tests start register as background jobs: in a folder of the suite's own,
    # never where a benchmark on this machine would pause them (or they it)
    os.environ["HEADSTART_BACKGROUND"] = tempfile.mkdtemp(prefix="headstart-background-")
    if config.getoption("--no-prepack"):
        Target.prepack_default = False
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:  # `pytest -n N` (make test): the cores shared out, here and in the subprocesses tests launch
        threads = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """A tiny Llama + tokenizer saved as a Hugging Face model directory (what `--model DIR` loads)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    model = tiny_llama(vocab_size=len(WORDS), init_std=0.3)
    model.generation_config.eos_token_id = 1
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_drafters(tmp_path_factory: pytest.TempPathFactory):
    """Every registered drafter's inputs for one tiny 8-token target (`helpers.drafters.drafter_setup`)."""
    return drafter_setup(tmp_path_factory.mktemp("drafters"))

"""The embedded SmolLM2-135M-Instruct (fp32): greedy identity with its own `generate` on Spec-Bench prompts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.drafters import make_drafter
from runtime.engine import Engine
from runtime.prompts import load_prompts

pytestmark = pytest.mark.model

SPEC_BENCH = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "eval" / "spec_bench.jsonl"
CATEGORIES = ["summarization", "rag", "qa", "translation", "math_reasoning"]


@pytest.fixture(scope="module")
def engine():
    pytest.importorskip("gguf")
    return Engine.load("smollm2-135m-instruct", dtype="float32")


@pytest.fixture(scope="module")
def prompts():
    if not SPEC_BENCH.is_file():
        pytest.skip(f"{SPEC_BENCH} not found (it lies in shared/ beside the checkout)")
    by_category = {p.category: p for p in reversed(load_prompts(SPEC_BENCH, set(CATEGORIES)))}
    return [by_category[c] for c in CATEGORIES]


def test_greedy_identity_on_spec_bench(engine, prompts):
    model = engine.target.model
    accepted = 0
    for prompt in prompts:
        ids = engine.encode(prompt.text)
        hf = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=64)[0, len(ids) :].tolist()
        for name in ["none", "lookup"]:
            engine.drafter = make_drafter(name)
            result = engine.generate(ids, max_new_tokens=64)
            assert result.token_ids == hf, f"{name} differs from generate on {prompt.category}/{prompt.id}"
            accepted += sum(result.stats.accepted_per_depth) if name == "lookup" else 0
    assert accepted > 0

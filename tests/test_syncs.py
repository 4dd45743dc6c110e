"""Host syncs per round, counted on a CPU stand-in: every `.item()`, `.tolist()`, `bool/int/float(tensor)` call
made while the decode loop runs (on a GPU each is a device-to-host sync; host-side tensors such as prompt
lookup's are counted too, so the figures are an upper bound). The count per round must not grow with the
sequence, and plain decoding syncs once a round (the greedy argmax)."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from headstart.runtime.drafters.registry import names
from headstart.runtime.generate import stream
from headstart.runtime.sampling import SamplingParams
from headstart.runtime.target import Target
from helpers.drafters import PROMPTS, build

SYNCS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")
MAX_PER_ROUND = 40  # the largest tree here has 16 + 8 nodes; EAGLE syncs once per depth to choose its frontier


@contextmanager
def counting_syncs():
    count = [0]
    saved = {name: getattr(torch.Tensor, name) for name in SYNCS}

    def counted(method):
        def wrapper(*args, **kwargs):
            count[0] += 1
            return method(*args, **kwargs)

        return wrapper

    for name, method in saved.items():
        setattr(torch.Tensor, name, counted(method))
    try:
        yield count
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def syncs_per_round(tiny_drafters, name: str, temperature: float, tokens: int = 96) -> list[int]:
    drafter, target = build(name, tiny_drafters), Target(tiny_drafters[0])
    per_round = []
    with counting_syncs() as count:
        for _ in stream(target, PROMPTS[0], drafter, SamplingParams(temperature), max_new_tokens=tokens, seed=0):
            per_round.append(count[0])
            count[0] = 0
    return per_round


def test_plain_decoding_syncs_once_a_round(tiny_drafters):
    assert set(syncs_per_round(tiny_drafters, "none", 0.0)) == {1}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("name", names())
def test_syncs_per_round_are_bounded(tiny_drafters, name, temperature):
    counts = syncs_per_round(tiny_drafters, name, temperature)
    third = len(counts) // 3
    early, late = sum(counts[:third]) / third, sum(counts[-third:]) / third
    assert max(counts) <= MAX_PER_ROUND, counts
    assert late <= 1.5 * early + 2, f"syncs grow with the sequence: {early:.1f} -> {late:.1f} per round"

"""Continuous batching (runtime/batched.py): the tokens of the model's own `generate`, whatever the batch."""

from __future__ import annotations

import pytest
import torch

from headstart.runtime.attention import AttentionLayout
from headstart.runtime.batched import _common_prefix, decode_batched, slot_masks
from helpers.models import tiny_llama

EOS = 5
PREFIX = [7, 8, 9, 10]  # what a chat template puts before every prompt


def _requests(n: int = 14, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 30, (n,), generator=g).tolist()
    rows = [PREFIX + torch.randint(11, 300, (k,), generator=g).tolist() for k in lengths]
    return [*rows, [*PREFIX[:1], 11], [*PREFIX, 12]]  # prompts no longer than the shared prefix and its last token


def _generate(model, ids: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=EOS, pad_token_id=0
    )[0, len(ids) :].tolist()
    return out[: out.index(EOS) + 1] if EOS in out else out


@pytest.mark.parametrize("slots", [1, 4, 64])
@pytest.mark.parametrize("share_prefix", [True, False])
def test_greedy_rows_equal_generate(slots, share_prefix):
    # 4 slots for 16 prompts: slots are refilled, finished ones compacted, prefills grouped by length
    model = tiny_llama(vocab_size=300, init_std=0.3)
    requests = _requests()
    got = dict(decode_batched(model, requests, 24, frozenset({EOS}), slots, share_prefix=share_prefix))
    assert sorted(got) == list(range(len(requests)))
    for i, ids in enumerate(requests):
        assert got[i] == _generate(model, ids, 24), f"request {i}"
    assert any(got[i][-1] == EOS for i in got) and any(len(got[i]) == 24 for i in got)  # both endings happen


def test_sampled_rows_depend_on_their_seed_not_on_the_batch():
    model = tiny_llama(vocab_size=300, init_std=0.3)
    requests = _requests(8)
    seeds = list(range(100, 100 + len(requests)))
    one = dict(decode_batched(model, requests, 16, frozenset(), 3, temperature=1.0, seeds=seeds))
    many = dict(decode_batched(model, requests, 16, frozenset(), 16, temperature=1.0, seeds=seeds))
    assert one == many
    other = dict(decode_batched(model, requests, 16, frozenset(), 3, temperature=1.0, seeds=[s + 1 for s in seeds]))
    assert other != one
    with pytest.raises(ValueError, match="seed per request"):
        next(decode_batched(model, requests, 4, frozenset(), 3, temperature=1.0))


def test_slot_masks_drawn_out():
    # slot 0's token is at position 2, slot 1's at 0 (its first): each sees its own positions <= its own
    class Config:
        sliding_window = None

    mask = slot_masks(AttentionLayout(Config()), torch.tensor([[2], [0]]), 4, torch.float32, "cpu")
    allowed = mask[:, 0, 0] == 0
    assert allowed.tolist() == [
        [True, True, True, False],
        [True, False, False, False],
    ]
    Config.sliding_window = 2  # every layer windowed (Mistral): position 3 sees 2 and 3
    windowed = slot_masks(AttentionLayout(Config()), torch.tensor([[3, 4]]), 5, torch.float32, "cpu") == 0
    assert windowed[0, 0].tolist() == [
        [False, False, True, True, False],
        [False, False, False, True, True],
    ]


def test_common_prefix_leaves_every_prompt_its_last_token():
    assert _common_prefix([[1, 2, 3, 4], [1, 2, 3, 5, 6]]) == 3
    assert _common_prefix([[1, 2, 3], [1, 2, 3, 4]]) == 2  # the shorter one's last token is fed by decoding
    assert _common_prefix([[1], [1, 2]]) == 0
    assert _common_prefix([[4, 2], [1, 2]]) == 0

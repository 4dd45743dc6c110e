"""Offline decoding (`runtime.generate.decode_all`, what distillation runs): the tokens of the model's own
`generate`, whatever the batch; at T > 0 a row depends on its seed, not on its neighbours."""

from __future__ import annotations

import pytest
import torch

from headstart.runtime.generate import Request, SharedPrefix, decode_all
from headstart.runtime.sampling import SamplingParams
from headstart.runtime.target import Target
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


def _decode(model, prompts, slots, new, prefix=True, temperature=0.0, seeds=None) -> dict[int, list[int]]:
    target = Target(model, fast=False, slots=slots)
    seeds = seeds or [None] * len(prompts)
    sampling = SamplingParams(temperature=temperature)
    requests = [
        Request(ids, sampling=sampling, max_new_tokens=new, eos_ids={EOS}, seed=seed, owner=i)
        for i, (ids, seed) in enumerate(zip(prompts, seeds, strict=True))
    ]
    shared = SharedPrefix.common(prompts) if prefix else None
    return {r.owner: r.context[len(r.prompt_ids) :] for r in decode_all(target, requests, shared)}


@pytest.mark.parametrize("slots", [1, 4, 64])
@pytest.mark.parametrize("prefix", [True, False])
def test_greedy_rows_equal_generate(slots, prefix):
    # 4 slots for 16 prompts: slots are refilled as rows finish, the first prompts prefilled in one forward
    model = tiny_llama(vocab_size=300, init_std=0.3)
    requests = _requests()
    got = _decode(model, requests, slots, 24, prefix)
    assert sorted(got) == list(range(len(requests)))
    for i, ids in enumerate(requests):
        assert got[i] == _generate(model, ids, 24), f"request {i}"
    assert any(got[i][-1] == EOS for i in got) and any(len(got[i]) == 24 for i in got)  # both endings happen


def test_sampled_rows_depend_on_their_seed_not_on_the_batch():
    model = tiny_llama(vocab_size=300, init_std=0.3)
    requests = _requests(8)
    seeds = list(range(100, 100 + len(requests)))
    one = _decode(model, requests, 3, 16, temperature=1.0, seeds=seeds)
    many = _decode(model, requests, 16, 16, temperature=1.0, seeds=seeds)
    assert one == many
    assert _decode(model, requests, 3, 16, temperature=1.0, seeds=[s + 1 for s in seeds]) != one


def test_common_prefix_leaves_every_prompt_its_last_token():
    assert SharedPrefix.common([[1, 2, 3, 4], [1, 2, 3, 5, 6]]).ids == [1, 2, 3]
    assert SharedPrefix.common([[1, 2, 3], [1, 2, 3, 4]]).ids == [1, 2]  # the shorter one's last token: decoding's
    assert SharedPrefix.common([[1], [1, 2]]) is None
    assert SharedPrefix.common([[4, 2], [1, 2]]) is None

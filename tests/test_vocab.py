"""The reduced draft vocabulary: which ids are kept, and the map between draft indices and target ids."""

from __future__ import annotations

import pytest
import torch

from headstart.heads.checkpoint import build_heads, save_heads, target_fingerprint
from headstart.heads.load import load_heads
from headstart.heads.vocab import DraftReadout, frequent_tokens
from helpers.models import tiny_llama


def test_frequent_tokens_by_hand():
    # counts: 7 -> 3, 5 -> 2, 9 -> 2, 2 -> 1; ties go to the lower id; then the lowest unused ids fill up
    seqs = [[7, 5, 7], [9, 7, 2], [5, 9]]
    assert frequent_tokens(seqs, 3, vocab_size=10).tolist() == [7, 5, 9]
    assert frequent_tokens(seqs, 6, vocab_size=10).tolist() == [7, 5, 9, 2, 0, 1]
    with pytest.raises(ValueError, match=r"1\.\.10"):
        frequent_tokens(seqs, 11, vocab_size=10)


def test_readout_scores_the_kept_rows_and_maps_back():
    lm_head = torch.nn.Linear(4, 10, bias=False)
    ids = torch.tensor([7, 5, 9])
    readout = DraftReadout(lm_head, ids)
    x = torch.randn(2, 4)
    torch.testing.assert_close(readout(x), lm_head(x)[:, ids])
    assert readout.to_target(torch.tensor([[2, 0]])).tolist() == [[9, 7]]
    assert readout.to_draft(torch.tensor([9, 7, 5, 0, 8, 6])).tolist() == [2, 0, 1, -1, -1, -1]
    full = DraftReadout(lm_head, None)
    torch.testing.assert_close(full(x), lm_head(x))
    assert full.size == 10 and readout.size == 3


def test_readout_limit_keeps_the_most_frequent_prefix():
    lm_head = torch.nn.Linear(4, 10, bias=False)
    ids = torch.tensor([7, 5, 9])  # most frequent first
    x = torch.randn(2, 4)
    two = DraftReadout(lm_head, ids, limit=2)
    assert two.size == 2
    torch.testing.assert_close(two(x), lm_head(x)[:, [7, 5]])
    assert two.to_target(torch.tensor([1, 0])).tolist() == [5, 7]
    assert two.to_draft(torch.tensor([7, 5, 9])).tolist() == [0, 1, -1]  # 9 is past the limit
    assert DraftReadout(lm_head, ids, limit=8).size == 3  # a limit past the vocabulary keeps all of it
    assert DraftReadout(lm_head, None, limit=2).size == 10  # a full vocabulary is not frequency-ordered: kept whole
    with pytest.raises(ValueError, match="at least 1"):
        DraftReadout(lm_head, ids, limit=0)


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_draft_vocabulary_survives_a_bfloat16_checkpoint(kind, tmp_path):
    model = tiny_llama(vocab_size=64)
    heads = build_heads(kind, model, draft_vocab=5)
    heads.draft_vocab.copy_(torch.tensor([60, 3, 41, 7, 12]))
    save_heads(tmp_path, heads, kind, {"draft_vocab": 5}, target_fingerprint(model))
    loaded, _ = load_heads(tmp_path, model)
    assert loaded.draft_vocab.dtype == torch.long and loaded.draft_vocab.tolist() == [60, 3, 41, 7, 12]

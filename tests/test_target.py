"""Target: tree verification equals sequential scoring; committing a path leaves a correct KV cache (fp32), with
the fast path (prepacked kernels, trees padded to their row buckets) and without it."""

import copy

import pytest
import torch

from headstart.runtime.target import Target
from headstart.runtime.tree import DraftTree
from helpers.models import tiny_llama

PROMPT = [5, 9, 3, 17, 22, 8, 41, 3, 17]
# root r; r -> 7 -> 12 -> 30 ; r -> 7 -> 19 ; r -> 44 -> 2
TREE = DraftTree(tokens=[7, 44, 12, 19, 30, 2], parents=[-1, -1, 0, 0, 2, 1])


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab_size=64, init_std=0.2)


@pytest.fixture(params=[False, True], ids=["stock", "fast"])
def fast(request):
    return request.param


def full_logits(model, ids):
    """(len, V) logits of a fresh forward over `ids`, no cache."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


def test_verify_scores_every_node_like_its_own_path(model, fast):
    target = Target(copy.deepcopy(model), fast=fast)
    target.prefill(PROMPT[:-1])
    verified = target.verify(PROMPT[-1], TREE)
    assert verified.logits.shape == (len(TREE) + 1, 64)
    assert verified.hidden.shape == (len(TREE) + 1, 64)
    assert target.past_len == len(PROMPT) + len(TREE) + (target.packed.kind == "mkl")  # 7 rows, 8 with padding
    torch.testing.assert_close(verified.logits[0], full_logits(model, PROMPT)[-1], atol=1e-4, rtol=0)
    for node in range(len(TREE)):
        path = [TREE.tokens[i] for i in TREE.path_to(node)]
        torch.testing.assert_close(verified.logits[node + 1], full_logits(model, PROMPT + path)[-1], atol=1e-4, rtol=0)
    # the hidden state is the final (post-norm) feature the lm_head reads
    torch.testing.assert_close(model.lm_head(verified.hidden), verified.logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "path",
    [[], [0], [0, 2, 4], [0, 3], [1, 5]],
    ids=["none", "first-child", "contiguous-chain", "second-grandchild", "second-branch"],
)
def test_commit_matches_fresh_forward(model, path, fast):
    target = Target(copy.deepcopy(model), fast=fast)
    target.prefill(PROMPT[:-1])
    target.verify(PROMPT[-1], TREE)
    target.commit(path)
    committed = PROMPT + [TREE.tokens[i] for i in path]
    assert target.past_len == len(committed)
    next_root = 11
    after = target.verify(next_root, DraftTree())
    torch.testing.assert_close(after.logits[0], full_logits(model, [*committed, next_root])[-1], atol=1e-4, rtol=0)
    # keep that root, then a second tree round on top of the compacted cache is still right
    target.commit([])
    second = target.verify(12, DraftTree([13, 14], [-1, 0]))
    expect = full_logits(model, [*committed, next_root, 12, 13, 14])[-3:]
    torch.testing.assert_close(second.logits, expect, atol=1e-4, rtol=0)


def test_prefill_of_nothing_starts_empty(model, fast):
    target = Target(copy.deepcopy(model), fast=fast)
    assert target.prefill([]) is None and target.past_len == 0
    out = target.verify(4, DraftTree([9], [-1]))
    torch.testing.assert_close(out.logits, full_logits(model, [4, 9]), atol=1e-4, rtol=0)

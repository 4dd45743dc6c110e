"""Target: tree verification equals sequential scoring; committing a path leaves a correct KV cache (fp32), with
the fast path (prepacked kernels) and without it."""

import copy

import pytest
import torch

from headstart.runtime.target import Prefill, Target
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
    assert target.past_len == len(PROMPT) + len(TREE)  # the prompt but its last token, then the root and 6 nodes
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


@pytest.mark.parametrize("trees", ["plain", "trees"])
def test_prefill_chunks_ride_in_a_round_like_their_own_forwards(trees):
    """Two sequences' round (plain steps, or uneven trees) with two joiners' prompt chunks in the same forward
    (`verify_batch(prefills=...)`): every sequence's logits and features, the first chunk's features, and the
    second chunk's last row (its prompt's root) are those of fresh forwards (float64); the slots' lengths grow by
    the rows fed, and the joiners then decode from the cache the chunks left."""
    model = tiny_llama(vocab_size=64, init_std=0.2).double()
    target = Target(copy.deepcopy(model), fast=True, slots=4)
    assert target.mixes_prefill
    decoding = [PROMPT, [3, 1, 4, 1, 5, 9, 2, 6]]
    for slot, prompt in enumerate(decoding):
        target.prefill(prompt[:-1], slot=slot)
    joiners = [[8, 8, 2, 6, 60, 7, 33, 10, 4, 4, 9], [21, 22, 23, 24, 25]]
    target.prefill(joiners[0][:3], slot=2)  # its first chunk came a round before
    small = DraftTree([13], [-1])
    shape = [TREE, small] if trees == "trees" else [DraftTree(), DraftTree()]
    prefills = [Prefill(2, joiners[0][3:7], last=False), Prefill(3, joiners[1], last=True)]
    out = target.verify_batch([p[-1] for p in decoding], shape, (-1,), prefills)
    assert [len(v.logits) for v in out] == [len(shape[0]) + 1, len(shape[1]) + 1, 0, 1]
    assert [len(v.hidden) for v in out] == [len(shape[0]) + 1, len(shape[1]) + 1, 4, 5]
    with torch.no_grad():
        for v, prompt, tree in zip(out, decoding, shape, strict=False):
            for row in range(len(tree) + 1):
                path = [] if row == 0 else [tree.tokens[i] for i in tree.path_to(row - 1)]
                fresh = model(torch.tensor([prompt + path]), output_hidden_states=True)
                torch.testing.assert_close(v.logits[row], fresh.logits[0, -1])
                torch.testing.assert_close(v.hidden[row], fresh.hidden_states[-1][0, -1])
        first = model(torch.tensor([joiners[0][:7]]), output_hidden_states=True).hidden_states[-1][0, 3:]
        torch.testing.assert_close(out[2].hidden, first)
        second = model(torch.tensor([joiners[1]]), output_hidden_states=True)
        torch.testing.assert_close(out[3].hidden, second.hidden_states[-1][0])
        torch.testing.assert_close(out[3].logits[0], second.logits[0, -1])
    assert target.lengths == [len(PROMPT) + len(shape[0]), 8 + len(shape[1]), 7, 5]
    for slot in range(2):
        target.commit([], slot)
    # the joiners decode on: the second from its root's token, the first after its last chunk
    target.verify_batch(
        [p[-1] for p in decoding], [DraftTree(), DraftTree()], (-1,), [Prefill(2, joiners[0][7:], True)]
    )
    after = target.verify_batch([1, 2, 40, 41], [DraftTree()] * 4, (-1,))
    with torch.no_grad():
        for v, ids in zip(after[2:], [joiners[0] + [40], joiners[1] + [41]], strict=True):
            torch.testing.assert_close(v.logits[0], model(torch.tensor([ids])).logits[0, -1])


def test_prefills_need_the_fast_attention_and_the_slots_after():
    target = Target(tiny_llama(vocab_size=64), fast=False, slots=3)
    with pytest.raises(ValueError, match="fast path"):
        target.verify_batch([1, 2], [DraftTree()] * 2, (-1,), [Prefill(2, [4, 5], True)])
    fast = Target(tiny_llama(vocab_size=64), fast=True, slots=3)
    with pytest.raises(ValueError, match="slots after"):
        fast.verify_batch([1], [DraftTree()], (-1,), [Prefill(2, [4, 5], True)])

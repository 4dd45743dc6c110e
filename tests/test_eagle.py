"""EAGLE drafting: the dynamic tree's rerank by hand, the head's cache, exactness of decoding with an EAGLE head."""

from __future__ import annotations

import pytest
import torch

from headstart.runtime.drafters.eagle import EagleDrafter
from headstart.runtime.drafters.native_head import NativeHead
from headstart.runtime.drafters.options import EagleOptions
from headstart.runtime.sampling import SamplingParams
from headstart.runtime.target import Target
from headstart.runtime.tree import rerank
from helpers.exactness import (
    assert_first_three_follow_target,
    assert_identity_with_trained_heads,
    random_heads,
    sampling_model,
)
from helpers.models import tiny_llama


def test_rerank_keeps_the_best_paths_by_hand():
    # Drafted nodes with their cumulative log-probabilities (index: token, score):
    #
    #   root
    #    ├─ 0: a  -0.1
    #    │   ├─ 2: c  -0.1 + -0.2 = -0.3
    #    │   └─ 3: d  -0.1 + -1.1 = -1.2
    #    └─ 1: b  -0.9
    #        └─ 4: e  -0.9 + -0.1 = -1.0
    #
    # Budget 3 keeps a (-0.1), c (-0.3), b (-0.9); budget 4 adds e (-1.0) before d (-1.2).
    tokens, parents, scores = [10, 11, 12, 13, 14], [-1, -1, 0, 0, 1], [-0.1, -0.9, -0.3, -1.2, -1.0]
    tree = rerank(tokens, parents, scores, budget=3)
    assert tree.tokens == [10, 11, 12] and tree.parents == [-1, -1, 0]  # by depth, siblings best first
    tree = rerank(tokens, parents, scores, budget=4)
    assert tree.tokens == [10, 11, 12, 14] and tree.parents == [-1, -1, 0, 1]


def test_drafted_features_equal_a_fresh_head_forward():
    """Tree attention inside the head: a drafted node's feature equals the head run on its path alone."""
    model = tiny_llama(vocab_size=64, init_std=0.2)
    head = random_heads("eagle", model, 0.1)
    options = EagleOptions(depth=3, top_k=2, budget=50, head_dtype="target")  # compared with the float32 head below
    drafter = EagleDrafter(head, model.model.embed_tokens, model.lm_head, options)
    prompt = [5, 9, 3, 17, 22, 8]
    target = Target(model)
    hidden = target.prefill(prompt[:-1])
    drafter.start(prompt, hidden)
    tree = drafter.propose(prompt)
    assert len(tree) == 2 + 4 + 4 and max(tree.depths) == 3  # top_k 2: 2 children, 2x2, then 2 expanded x 2
    assert drafter.cache.get_seq_length() == len(prompt) - 1  # committed pairs only: drafted entries left
    # the depth-2 node's readout must come from the head run over committed pairs + its parent's pair
    node = tree.depths.index(2)
    parent = tree.parents[node]
    with torch.no_grad():
        feats = hidden  # f_0 .. f_{L-2}
        toks = torch.tensor([prompt[1:]])
        f_root = head(feats[None], model.model.embed_tokens(toks), torch.arange(len(prompt) - 1)[None])[0, -1]
        f_parent = head(
            torch.cat([feats, f_root[None]])[None],
            model.model.embed_tokens(torch.tensor([[*prompt[1:], tree.tokens[parent]]])),
            torch.arange(len(prompt))[None],
        )[0, -1]
    top = model.lm_head(f_parent).topk(2).indices.tolist()
    assert tree.tokens[node] in top


def test_greedy_identity_with_trained_heads(tmp_path, tiny_model_dir):
    assert_identity_with_trained_heads(
        tmp_path,
        tiny_model_dir,
        "eagle",
        [{}, {"depth": 2, "top_k": 1, "budget": 2}, {"depth": 6, "budget": 40}],
    )


def test_greedy_identity_with_a_reduced_draft_vocabulary(tmp_path, tiny_model_dir):
    trees = [{}, {"draft_vocab": 12}]  # all 24 draft tokens, then only the 12 most frequent
    assert_identity_with_trained_heads(tmp_path, tiny_model_dir, "eagle", trees, **{"heads.draft_vocab": 24})


def test_greedy_identity_with_lookup_branches_grafted_on(tmp_path, tiny_model_dir):
    assert_identity_with_trained_heads(tmp_path, tiny_model_dir, "eagle", [{}], drafter="eagle+lookup")


def test_sampling_first_three_tokens_match_plain_sampling():
    """First 3 tokens with an EAGLE drafter (random head, depth 3, top-k 3, budget 10) at T=0.8,
    top-p 0.9, against their exact distribution. Fails when the chi-square p-value is below 1e-3:
    a correct implementation fails with probability 0.1 % (fixed seeds make it reproducible)."""
    model = sampling_model()
    drafter = EagleDrafter(
        random_heads("eagle", model, 0.1),
        model.model.embed_tokens,
        model.lm_head,
        EagleOptions(depth=3, top_k=3, budget=10),
    )
    assert_first_three_follow_target(model, [1, 2, 3, 4, 5], drafter)


def sampled_tree_drafter(model) -> EagleDrafter:
    """A random head that samples a 6-node static tree, shaped by made-up per-rank accuracies."""
    heads = random_heads("eagle", model, 0.1)
    acc = [[0.5, 0.3], [0.4, 0.3], [0.5]]
    return EagleDrafter(heads, model.model.embed_tokens, model.lm_head, EagleOptions(sampled_budget=6), acc)


def test_sampled_tree_is_pruned_below_min_prob():
    """min_prob 0.3 on the sampled tree: the children of unlikely paths are never drawn, so most rounds propose
    fewer nodes than the shape's 6 (exactness: the drafter contract runs eagle3 with min_prob 0.3)."""
    model = sampling_model()
    heads, acc = random_heads("eagle", model, 0.1), [[0.5, 0.3], [0.4, 0.3], [0.5]]
    options = EagleOptions(sampled_budget=6, min_prob=0.3)
    drafter = EagleDrafter(heads, model.model.embed_tokens, model.lm_head, options, acc)
    target, prompt = Target(model), [1, 2, 3, 4, 5]
    sizes = []
    for seed in range(20):
        drafter.start(prompt, target.prefill(prompt[:-1]), SamplingParams(temperature=0.8, top_p=0.9), seed)
        sizes.append(len(drafter.propose(prompt)))
    assert min(sizes) >= 1 and sum(size < 6 for size in sizes) >= 10, sizes


def test_sampled_tree_records_the_q_of_its_draft_temperature():
    """draft_temperature 0.5 at the decode's T = 0.8: the root's children are drawn from, and record, q at T = 0.4
    (top-p as the decode's); the first child's row is that q itself (exactness: tests/test_drafter_contract.py)."""
    from headstart.runtime.sampling import target_probs

    model = sampling_model()
    heads, acc = random_heads("eagle", model, 0.1), [[0.5, 0.3], [0.4, 0.3], [0.5]]
    target, prompt, sampling = Target(model), [1, 2, 3, 4, 5], SamplingParams(temperature=0.8, top_p=0.9)
    for factor in (0.5, 1.0):
        options = EagleOptions(sampled_budget=6, draft_temperature=factor)
        drafter = EagleDrafter(heads, model.model.embed_tokens, model.lm_head, options, acc)
        drafter.start(prompt, target.prefill(prompt[:-1]), sampling, seed=0)
        tree = drafter.propose(prompt)
        q = target_probs(drafter.readout(drafter._root_feature[None])[0], SamplingParams(0.8 * factor, top_p=0.9))
        torch.testing.assert_close(tree.draft_probs[0], q)


def test_a_draft_temperature_never_turns_a_sampled_decode_greedy():
    """At T = 1.5e-5 (a sampling decode) a factor of 0.5 would fall below the greedy threshold: the draft then
    divided by 0 and proposed nothing. It is held at MIN_TEMPERATURE, and the tree is drawn."""
    from headstart.runtime.sampling import MIN_TEMPERATURE

    model = sampling_model()
    heads, acc = random_heads("eagle", model, 0.1), [[0.5, 0.3], [0.4, 0.3], [0.5]]
    options = EagleOptions(sampled_budget=6, draft_temperature=0.5)
    drafter = EagleDrafter(heads, model.model.embed_tokens, model.lm_head, options, acc)
    target, prompt = Target(model), [1, 2, 3, 4, 5]
    drafter.start(prompt, target.prefill(prompt[:-1]), SamplingParams(temperature=1.5e-5), seed=0)
    tree = drafter.propose(prompt)
    assert drafter.draft_sampling.temperature == MIN_TEMPERATURE
    assert len(tree) and tree.draft_probs is not None and torch.isfinite(tree.draft_probs).all()


def test_sampled_tree_shape_comes_from_the_rank_accuracies():
    """The tree sampled at T > 0 (exactness: tests/test_drafter_contract.py) has the shape the accuracies give."""
    assert sampled_tree_drafter(sampling_model()).shape == [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


def test_trained_heads_sample_their_tree_above_temperature_zero(tmp_path, tiny_model_dir):
    from headstart.runtime.drafters.registry import make_drafter
    from headstart.runtime.models import load_model
    from helpers.exactness import train_tiny_heads

    heads_dir = train_tiny_heads(tmp_path, tiny_model_dir, "eagle")
    model, tokenizer = load_model(str(tiny_model_dir))
    drafter = make_drafter("eagle", model, tokenizer, heads=str(heads_dir), budget=5)
    assert len(drafter.shape) == 5  # from the rank accuracies saved with the heads
    target = Target(model)
    prompt = [3, 4, 5, 6, 3, 4]
    for sampling, sampled in ((SamplingParams(), False), (SamplingParams(temperature=1.0), True)):
        drafter.start(prompt, target.prefill(prompt[:-1]), sampling, seed=0)
        tree = drafter.propose(prompt)
        assert (tree.draft_probs is not None) == sampled and len(tree) == 5


def test_head_dtype_auto_drafts_greedy_decodes_in_bfloat16_under_a_float32_target(monkeypatch):
    """Where the CPU has bf16 kernels; sampled decodes draft in the target's dtype (their draws would round
    differently alone and in a batch), and so does every decode elsewhere."""
    import headstart.runtime.kernels as kernels

    model = tiny_llama(vocab_size=64, init_std=0.2)
    head = random_heads("eagle", model, 0.1)
    prompt = [5, 9, 3, 17, 22, 8]
    bf16, fp32 = torch.bfloat16, torch.float32
    for supported, greedy in ((True, bf16), (False, fp32)):
        monkeypatch.setattr(kernels, "onednn_bf16_supported", lambda supported=supported: supported)
        drafter = EagleDrafter(head, model.model.embed_tokens, model.lm_head, EagleOptions())
        hidden = Target(model).prefill(prompt[:-1])
        for sampling, dtype in ((SamplingParams(0.0), greedy), (SamplingParams(0.8), fp32)):
            fork = drafter.fork()
            fork.start(prompt, hidden, sampling, seed=0)
            module = fork.head.head if isinstance(fork.head, NativeHead) else fork.head  # the native layers' module
            assert fork.dtype == dtype and next(module.parameters()).dtype == dtype
            assert fork.readout.weight.dtype == dtype
            assert len(fork.propose(prompt)) > 0  # features and embeddings enter in the head's dtype
    assert next(head.parameters()).dtype == fp32  # the caller's module is left as it was
    weight = model.lm_head.weight
    assert kernels.head_dtypes("auto", weight.double()) == (torch.float64, torch.float64)  # a float32 target's only
    assert kernels.head_dtypes("target", weight) == (fp32, fp32)
    assert kernels.head_dtypes("bfloat16", weight) == (bf16, bf16)
    with pytest.raises(ValueError, match="head_dtype must be one of auto, target, float32, bfloat16"):
        EagleOptions(head_dtype="float16")


def test_a_bfloat16_head_drafts_the_float32_heads_tree_away_from_ties():
    """A random head far from ties: the same tree in either dtype."""
    model = tiny_llama(vocab_size=64, init_std=0.2)
    head = random_heads("eagle", model, 0.1)
    prompt = [5, 9, 3, 17, 22, 8]
    trees = []
    for dtype in ("target", "bfloat16"):
        drafter = EagleDrafter(
            head, model.model.embed_tokens, model.lm_head, EagleOptions(depth=3, top_k=2, budget=6, head_dtype=dtype)
        )
        drafter.start(prompt, Target(model).prefill(prompt[:-1]))
        tree = drafter.propose(prompt)
        trees.append((tree.tokens, tree.parents))
    assert trees[0] == trees[1]

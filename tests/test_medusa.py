"""Medusa drafting: the tree shape chosen from accuracies, exactness of decoding with Medusa heads."""

from __future__ import annotations

import itertools

import pytest
import torch

from headstart.heads.checkpoint import build_heads
from headstart.runtime.drafters.medusa import MedusaDrafter
from headstart.runtime.tree import choose_tree_shape, expected_acceptance_length
from helpers.exactness import (
    assert_identity_with_trained_heads,
    random_heads,
    sampling_model,
)
from helpers.models import tiny_llama

# rank_accuracy[d][i]: P(head d+1's i-th ranked guess is right)
ACC = [[0.6, 0.2], [0.5, 0.1]]


def test_tree_shape_matches_hand_computed_optimum():
    # Every node and its acceptance probability (product along its path):
    #   (0) .6   (1) .2   (0,0) .6*.5=.30   (0,1) .6*.1=.06   (1,0) .2*.5=.10   (1,1) .2*.1=.02
    # Best 3 nodes: (0), (0,0), (1) -> expected acceptance length 1 + .6 + .3 + .2 = 2.1
    shape = choose_tree_shape(ACC, budget=3)
    assert shape == [(0,), (0, 0), (1,)]
    assert expected_acceptance_length(ACC, shape) == pytest.approx(2.1)
    # Budget 5 adds (1,0) .10 then (0,1) .06
    assert choose_tree_shape(ACC, budget=5) == [(0,), (0, 0), (1,), (1, 0), (0, 1)]


def test_tree_shape_is_optimal_against_brute_force():
    acc = [[0.5, 0.25, 0.1], [0.6, 0.2, 0.05], [0.7, 0.1, 0.05]]
    nodes = [p for d in range(1, 4) for p in itertools.product(range(3), repeat=d)]
    for budget in (1, 2, 4, 6):
        best = max(
            expected_acceptance_length(acc, list(subset))
            for subset in itertools.combinations(nodes, budget)
            if all(len(p) == 1 or p[:-1] in subset for p in subset)  # a tree: parents included
        )
        shape = choose_tree_shape(acc, budget)
        assert len(shape) == budget
        assert expected_acceptance_length(acc, shape) == pytest.approx(best)


def test_bad_shapes_are_refused():
    heads = build_heads("medusa", tiny_llama(vocab_size=64), num_heads=2)
    with pytest.raises(ValueError, match="parent"):
        MedusaDrafter(heads, torch.nn.Identity(), [(0, 0), (0,)])
    with pytest.raises(ValueError, match="only 2 heads"):
        MedusaDrafter(heads, torch.nn.Identity(), [(0,), (0, 0), (0, 0, 0)])


def test_greedy_identity_with_trained_heads(tmp_path, tiny_model_dir):
    assert_identity_with_trained_heads(tmp_path, tiny_model_dir, "medusa", [{}, {"budget": 4}, {"budget": 24}])


def test_greedy_identity_with_a_reduced_draft_vocabulary(tmp_path, tiny_model_dir):
    trees = [{}, {"draft_vocab": 12}]  # all 24 draft tokens, then only the 12 most frequent
    assert_identity_with_trained_heads(tmp_path, tiny_model_dir, "medusa", trees, **{"heads.draft_vocab": 24})


def test_greedy_identity_with_lookup_branches_grafted_on(tmp_path, tiny_model_dir):
    assert_identity_with_trained_heads(tmp_path, tiny_model_dir, "medusa", [{}], drafter="medusa+lookup")


def test_tree_is_sampled_above_temperature_zero_only():
    """Same shape at every temperature; point masses at T=0, drawn siblings with their q at T=1."""
    from headstart.runtime.sampling import SamplingParams

    model = sampling_model(vocab=32)
    acc = [[0.5, 0.2, 0.1], [0.4, 0.2], [0.3]]
    drafter = MedusaDrafter.from_accuracies(random_heads("medusa", model, 0.3, num_heads=3), model.lm_head, acc, 8)
    hidden = torch.randn(4, model.config.hidden_size)
    for sampling, sampled in ((SamplingParams(), False), (SamplingParams(temperature=1.0), True)):
        drafter.start([1, 2, 3, 4, 5], hidden, sampling, seed=0)
        tree = drafter.propose([1, 2, 3, 4, 5])
        assert sorted(tree.depths) == sorted(map(len, drafter.shape)) and (tree.draft_probs is not None) == sampled
        if sampled:  # each child's token has q > 0 in its row; siblings distinct
            assert all(tree.draft_probs[i, t] > 0 for i, t in enumerate(tree.tokens))
            for parent in set(tree.parents):
                kids = [t for t, p in zip(tree.tokens, tree.parents, strict=True) if p == parent]
                assert len(kids) == len(set(kids))


def test_heads_never_right_on_held_out_rows_draft_from_the_prior(tmp_path):
    """Accuracies measured as 0 at every rank would choose an empty tree: the prior's tree, with a warning."""
    from headstart.heads.checkpoint import CheckpointConfig, save_heads, target_fingerprint
    from headstart.runtime.drafters.registry import make_drafter
    from headstart.runtime.tree import prior_rank_accuracy

    model = tiny_llama(vocab_size=64)
    heads = random_heads("medusa", model, 0.3, num_heads=2)
    extra = {"rank_accuracy": [[0.0, 0.0], [0.0, 0.0]], "dtype": "float32"}
    save_heads(tmp_path, heads, "medusa", {"num_heads": 2}, target_fingerprint(model), extra)
    with pytest.warns(UserWarning, match="measured 0 for every rank: their tree comes from a prior"):
        drafter = make_drafter("medusa", model, None, heads=str(tmp_path), budget=5)
    assert drafter.shape == choose_tree_shape(prior_rank_accuracy(2), 5) and len(drafter.shape) == 5
    assert CheckpointConfig.read(tmp_path).measured_accuracy is None  # what every reader of the accuracies goes by

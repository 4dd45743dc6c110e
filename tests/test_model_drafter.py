"""Draft-model and layer-skip drafters on tiny random Llamas: exactness, cache sync, tokenizer checks."""

from __future__ import annotations

import pytest
import torch

from headstart.runtime.drafters.base import Drafter
from headstart.runtime.drafters.model import ModelDrafter, TokenizerMismatchError, check_same_tokenizer, layerskip_model
from headstart.runtime.drafters.options import TreeOptions
from headstart.runtime.drafters.registry import make_drafter
from headstart.runtime.sampling import SamplingParams
from headstart.runtime.target import Target
from headstart.runtime.tree import DraftTree, rerank
from helpers.exactness import assert_first_three_follow_target, assert_greedy_identity, generate_ids, sampling_model
from helpers.models import tiny_llama, tiny_tokenizer

PROMPTS = [[3, 4, 5, 6, 3, 4], [10, 11, 12, 13, 14, 15, 16], [20, 21]]


def first_layer_copy(model):
    """A real second model: a 1-layer Llama holding a copy of the target's embeddings, layer 0, norm and lm_head."""
    draft = tiny_llama(vocab_size=model.config.vocab_size, layers=1, seed=99)
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("model.layers.") or ".layers.0." in k}
    draft.load_state_dict(state)
    return draft


def test_layerskip_view_shares_weights_and_runs_only_its_layers():
    model = tiny_llama(layers=3, init_std=0.3)
    view = layerskip_model(model, [0, 2])
    assert view.model.layers[1] is model.model.layers[2] and view.lm_head is model.lm_head
    assert len(model.model.layers) == 3 and model.config.num_hidden_layers == 3  # the target is untouched
    ids = torch.tensor([[3, 4, 5, 6]])
    x = model.model.embed_tokens(ids)
    pos = torch.arange(4)[None]
    cos_sin = model.model.rotary_emb(x, pos)
    mask = torch.full((4, 4), float("-inf")).triu(1)[None, None]
    for i in (0, 2):
        x = model.model.layers[i](x, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
    torch.testing.assert_close(view(input_ids=ids, use_cache=False).logits, model.lm_head(model.model.norm(x)))
    with pytest.raises(ValueError, match="start at layer 0"):
        layerskip_model(model, [1, 2])
    with pytest.raises(ValueError, match="has 3 layers"):
        layerskip_model(model, [0, 3])


@pytest.mark.parametrize("layers", [[0], [0, 2]], ids=["first-1", "subset-0-2"])
def test_drafted_chain_equals_the_draft_models_own_greedy_continuation(layers):
    """Across rounds (accepted prefixes cropped from its cache), every proposed chain is exactly the draft
    model's greedy continuation of the context, computed afresh without a cache."""
    model = tiny_llama(layers=3, init_std=0.3)
    drafter = ModelDrafter.layerskip(model, layers, TreeOptions(depth=3))
    seen = []

    def fresh_greedy(context: list[int], n: int) -> list[int]:
        out = list(context)
        for _ in range(n):
            out.append(int(drafter.model(input_ids=torch.tensor([out]), use_cache=False).logits[0, -1].argmax()))
        return out[len(context) :]

    class Spy(Drafter):
        def start(self, *args):
            drafter.start(*args)

        def propose(self, context):
            tree = drafter.propose(context)
            seen.append((tree.tokens, fresh_greedy(context, 3)))
            return tree

    generate_ids(Target(model), [3, 4, 5, 6], Spy(), max_new_tokens=20)
    assert len(seen) >= 3 and all(tokens == fresh for tokens, fresh in seen)


def test_sampled_drafts_carry_their_q():
    model = sampling_model()
    drafter = ModelDrafter.layerskip(model, [0], TreeOptions(depth=3))
    drafter.start([1, 2, 3], None, SamplingParams(0.8, top_p=0.9), seed=0)
    tree = drafter.propose([1, 2, 3])
    assert tree.parents == [-1, 0, 1] and tree.draft_probs.shape == (3, model.config.vocab_size)
    torch.testing.assert_close(tree.draft_probs.sum(-1), torch.ones(3))
    assert all(tree.draft_probs[i, tok] > 0 for i, tok in enumerate(tree.tokens))
    drafter.start([1, 2, 3], None, SamplingParams(), seed=0)
    assert drafter.propose([1, 2, 3]).draft_probs is None  # greedy: point masses


def reference_tree(model, context: list[int], depth: int, top_k: int, budget: int) -> DraftTree:
    """The dynamic tree drafted naively: a fresh forward without cache or mask for every expanded path."""
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []

    def add_children(parent: int, base: float) -> list[int]:
        path, node = [], parent
        while node >= 0:
            path.insert(0, tokens[node])
            node = parents[node]
        logits = model(input_ids=torch.tensor([context + path]), use_cache=False).logits[0, -1]
        top = logits.float().log_softmax(-1).topk(top_k)
        new = list(range(len(tokens), len(tokens) + top_k))
        tokens.extend(top.indices.tolist())
        parents.extend([parent] * top_k)
        scores.extend(base + lp for lp in top.values.tolist())
        return new

    frontier = add_children(-1, 0.0)
    for _ in range(depth - 1):
        expand = sorted(frontier, key=lambda i: -scores[i])[:top_k]
        frontier = [child for node in expand for child in add_children(node, scores[node])]
    return rerank(tokens, parents, scores, budget)


@pytest.mark.parametrize("layers", [[0], [0, 2]], ids=["first-1", "subset-0-2"])
def test_drafted_tree_equals_the_naive_dynamic_tree(layers):
    """Tree mode, across rounds of a real generation: every proposed tree equals the one built with a fresh
    uncached forward per expanded path (so the tree mask, positions and cache crops are right)."""
    model = tiny_llama(layers=3, init_std=0.3)
    drafter = ModelDrafter.layerskip(model, layers, TreeOptions(depth=3, top_k=3, budget=8))
    seen = []

    class Spy(Drafter):
        def start(self, *args):
            drafter.start(*args)

        def propose(self, context):
            tree = drafter.propose(context)
            seen.append((tree, reference_tree(drafter.model, context, 3, 3, 8)))
            return tree

    generate_ids(Target(model), [3, 4, 5, 6], Spy(), max_new_tokens=20)
    assert len(seen) >= 3 and any(max(tree.depths) == 3 for tree, _ in seen)
    for tree, expected in seen:
        assert len(tree) == 8
        assert (tree.tokens, tree.parents) == (expected.tokens, expected.parents)


def test_greedy_identity_draft_trees():
    model = tiny_llama(layers=2, init_std=0.3)
    for drafter in (
        ModelDrafter.layerskip(model, [0], TreeOptions(depth=4, top_k=3, budget=10)),
        ModelDrafter(first_layer_copy(model), TreeOptions(depth=3, top_k=2, budget=6)),
    ):
        assert assert_greedy_identity(model, drafter, PROMPTS).accepted > 0


def test_sampling_with_draft_trees_follows_plain_sampling():
    """Tree mode at T=0.8 / top-p 0.9: point-mass nodes, the first 3 tokens keep the target's distribution
    (3,000 runs; fails when the chi-square p-value is below 1e-3, probability 0.1 % for a correct one)."""
    model = sampling_model()
    drafter = ModelDrafter.layerskip(model, [0], TreeOptions(depth=3, top_k=2, budget=6))
    assert_first_three_follow_target(model, [1, 2, 3, 4, 5], drafter, runs=3000)


def test_tokenizer_mismatch_is_refused_naming_both(tiny_model_dir, tmp_path):
    tok = tiny_tokenizer()
    other = tiny_tokenizer()
    other.add_tokens(["zebra"])
    with pytest.raises(
        TokenizerMismatchError,
        match=r"draft model small-b does not share the tokenizer of the target "
        r"big-a \(\d+ vs \d+ tokens\)",
    ):
        check_same_tokenizer(tok, other, "big-a", "small-b")
    # same size, one token string differs
    from headstart.runtime.models import load_model

    model, tokenizer = load_model(str(tiny_model_dir))
    draft_dir = tmp_path / "draft"
    first_layer_copy(model).save_pretrained(draft_dir)
    vocab = tokenizer.get_vocab()
    swapped = {**vocab, "cat": vocab["dog"], "dog": vocab["cat"]}
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel(swapped, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>").save_pretrained(draft_dir)
    with pytest.raises(TokenizerMismatchError, match="token 'cat' is id"):
        make_drafter("model", model, tokenizer, draft_model=str(draft_dir), model_name="tiny")


def test_model_drafter_from_a_saved_directory(tiny_model_dir, tmp_path):
    from headstart.runtime.models import load_model

    model, tokenizer = load_model(str(tiny_model_dir))
    draft_dir = tmp_path / "draft"
    layerskip_model(model, [0]).save_pretrained(draft_dir)
    tokenizer.save_pretrained(draft_dir)
    drafter = make_drafter("model", model, tokenizer, draft_model=str(draft_dir), depth=3)
    assert isinstance(drafter, ModelDrafter) and drafter.depth == 3
    model.generation_config.eos_token_id = None
    assert assert_greedy_identity(model, drafter, PROMPTS).accepted > 0
    for bad, message in [({"draft_layers": None}, "`draft_layers`"), ({"draft_layers": "0,x"}, "comma list")]:
        with pytest.raises(ValueError, match=message):
            make_drafter("layerskip", model, tokenizer, **bad)
    with pytest.raises(ValueError, match="`draft_model`"):
        make_drafter("model", model, tokenizer)
    tree = make_drafter("layerskip", model, tokenizer, draft_layers=1, top_k=3, budget=8)
    assert (tree.top_k, tree.budget, tree.depth) == (3, 8, 4)  # depth: the chain's default
    with pytest.raises(ValueError, match="must be >= 1: top_k=0"):
        make_drafter("layerskip", model, tokenizer, draft_layers=1, top_k=0)

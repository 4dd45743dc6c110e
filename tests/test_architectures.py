"""Any causal LM: tiny random models of eight families (the SmolLM2 vocabulary size, 3 layers, float32).

For each family every drafter gives the tokens of the model's own greedy `generate` over a sequence
longer than twice the sliding window (Mistral: every layer windowed; Gemma 3: windowed and full layers
mixed), and batched distillation decodes as `generate`. Each head kind is trained by the trainer on the
family's own greedy continuations (as real heads are trained on distilled rows), so its drafts are
accepted: a head drafter alone reaches 1.5 tokens a pass or more, lookup grafted on still accepts the
heads' nodes, and rounds keep branches other than the first (the cache moves rows, in windowed layouts
too). docs/architecture.md's support table is what this test proves.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers as tf
from transformers import AutoTokenizer

from headstart.heads.checkpoint import build_heads
from headstart.runtime.drafters.base import Drafter
from headstart.runtime.drafters.model import layerskip_model
from headstart.runtime.drafters.registry import make_drafter
from headstart.runtime.generate import Request, decode_all
from headstart.runtime.models import load_model
from headstart.runtime.target import Target
from helpers.exactness import TREES, SecondGuess, assert_greedy_identity, assert_trained_heads_speculate, fit_heads
from helpers.models import tiny_tokenizer
from helpers.training import greedy_rows

WINDOW = 16
COMMON = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=512,
    initializer_range=0.3,
)
SLIDING_MIXED = ["sliding_attention", "sliding_attention", "full_attention"]
FAMILIES = {
    "llama": lambda: tf.LlamaConfig(num_key_value_heads=2, **COMMON),
    "qwen2": lambda: tf.Qwen2Config(num_key_value_heads=2, **COMMON),
    "qwen3": lambda: tf.Qwen3Config(num_key_value_heads=2, head_dim=16, **COMMON),
    "mistral": lambda: tf.MistralConfig(num_key_value_heads=2, sliding_window=WINDOW, **COMMON),
    "gemma3": lambda: tf.Gemma3TextConfig(
        num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, layer_types=SLIDING_MIXED, **COMMON
    ),
    "phi3": lambda: tf.Phi3Config(num_key_value_heads=2, pad_token_id=0, **COMMON),
    "olmo2": lambda: tf.Olmo2Config(num_key_value_heads=2, eos_token_id=None, **COMMON),
    "gpt_neox": lambda: tf.GPTNeoXConfig(**COMMON),  # another module layout: gpt_neox.layers, final_layer_norm
}
KINDS = ["medusa", "medusa2", "eagle", "eagle3"]
DRAFTERS = ["none", "lookup", "layerskip", "model", *KINDS, *(f"{kind}+lookup" for kind in KINDS)]
REFUSED = {
    ("gpt_neox", "eagle"): "EAGLE heads cannot be built for GPTNeoXForCausalLM: it lacks a decoder layer that "
    "takes `cache=`"
}
PROMPTS = [[5, 9, 3, 17, 22, 8, 41, 3, 17, 22, 8], [60, 12, 60, 12, 60, 7]]
NEW_TOKENS = 3 * WINDOW  # prompt + answer pass twice the window


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, model, tokenizer, {drafter base: options}): heads of each kind trained on the model's own greedy
    continuations, a draft model saved to disk; medusa2's options carry its adapted target (`target`)."""
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(FAMILIES[request.param](), attn_implementation="sdpa")
    model.eval().requires_grad_(False)
    model.generation_config.eos_token_id = None  # run every decode to its length
    root = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(root / "target")
    tiny_tokenizer().save_pretrained(root / "target")
    # the draft model: every layer of the target, saved as a model of its own (its drafts are accepted, so
    # rounds commit long paths); layerskip: the first layer drafting a tree (accepted branches need not be first)
    layerskip_model(model, [0, 1, 2]).save_pretrained(root / "draft")
    tiny_tokenizer().save_pretrained(root / "draft")
    tokenizer = AutoTokenizer.from_pretrained(root / "draft")  # as the model drafter will load it
    options = {"layerskip": {"draft_layers": 1, "top_k": 2, "budget": 6}, "model": {"draft_model": str(root / "draft")}}
    rng = random.Random(0)  # the test prompts' continuations and two more, as distillation would write them
    rows = greedy_rows(model, [*PROMPTS, *([rng.randrange(3, 3000) for _ in range(8)] for _ in range(2))], NEW_TOKENS)
    for kind in KINDS:
        if (request.param, kind) not in REFUSED:
            heads = fit_heads(root / kind, root / "target", kind, rows)
            options[kind] = {"heads": str(heads), **TREES[kind]}
    # medusa2 trained a LoRA with its heads: its target is the model plus that adapter
    options["medusa2"]["target"] = load_model(str(root / "target"), adapter=options["medusa2"]["heads"])[0]
    options["medusa2"]["target"].generation_config.eos_token_id = None
    return request.param, model, tokenizer, options


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_greedy_identity_past_the_window(family, drafter):
    name, model, tokenizer, options = family
    base = drafter.removesuffix("+lookup")
    if (name, base) in REFUSED:  # refused up front, in one line naming the model class and what it lacks
        with pytest.raises(ValueError, match=REFUSED[name, base]):
            make_drafter(drafter, model, tokenizer, heads="unused")
        with pytest.raises(ValueError, match=REFUSED[name, base]):
            build_heads(base, model)  # and by the trainer
        return
    given = dict(options.get(base, {}))
    model = given.pop("target", model)
    built = make_drafter(drafter, model, tokenizer, **given)
    seen = assert_greedy_identity(model, built, PROMPTS, max_new_tokens=NEW_TOKENS)
    if drafter == "model":  # the target's own layers drafting: speculation really happened
        assert seen.accepted > NEW_TOKENS, f"{name}: {seen.accepted} draft tokens accepted"
    if base in KINDS:
        print(f"{name} {drafter}: {seen.acceptance_length:.2f} tokens a pass, {seen}")  # the matrix: pytest -rA
        assert_trained_heads_speculate(seen, drafter, name)


def test_rounds_commit_second_ranked_branches_past_the_window(family):
    """Every round's accepted path runs through nodes that are not their parent's first child (`SecondGuess`): the
    cache keeps rows other than those right after the root, in every layout, windowed ones past the window."""
    name, model, _, _ = family
    continuations = {
        tuple(p): model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS + 8, do_sample=False)[
            0, len(p) :
        ].tolist()
        for p in PROMPTS
    }
    seen = assert_greedy_identity(model, SecondGuess(continuations, model.config.vocab_size), PROMPTS, NEW_TOKENS)
    assert seen.accepted >= 2 * seen.rounds, f"{name}: {seen}"  # most rounds accept the whole chain of 3
    assert seen.siblings == seen.rounds, f"{name}: {seen.siblings} of {seen.rounds} rounds committed a sibling"


RESIDUAL_WRITERS = ("o_proj", "down_proj", "dense", "dense_4h_to_h")  # what adds to the residual stream, per family


@pytest.mark.parametrize("drafter", ["lookup", "layerskip"])
def test_lookup_and_layerskip_drafts_are_accepted(family, drafter):
    """The family's model with every layer's writes to the residual stream zeroed: the next token is a function
    f of the current one, so a prompt that holds the chain x, f(x), f(f(x)) ... and then x again continues as the
    chain did. Lookup copies it from the prompt and layerskip's one layer predicts it: both are accepted (the
    random models' own continuations never repeat, so the identity runs above accept nothing from lookup)."""
    import copy

    name, model, tokenizer, options = family
    chained = copy.deepcopy(model)
    for module_name, module in chained.named_modules():
        if module_name.rsplit(".", 1)[-1] in RESIDUAL_WRITERS and isinstance(module, torch.nn.Linear):
            module.weight.data.zero_()
            if module.bias is not None:
                module.bias.data.zero_()
    chain = chained.generate(torch.tensor([[5]]), max_new_tokens=12, do_sample=False)[0].tolist()
    prompt = chain + chain[:3]
    built = make_drafter(drafter, chained, tokenizer, **options.get(drafter, {}))
    seen = assert_greedy_identity(chained, built, [prompt], max_new_tokens=NEW_TOKENS)
    assert seen.accepted > 0, f"{name} {drafter}: no draft token accepted ({seen})"


def test_batched_decoding_gives_generate_tokens(family):
    # several sequences at once, each at its own positions, past the sliding window, plain rows beside trees of
    # 6 and 2 nodes (packed end to end by the fast path) that commit rank > 0 siblings: the tokens of `generate`
    name, model, _, _ = family
    prompts = [*PROMPTS, [*PROMPTS[0][:3], 30, 31]]
    want = [
        model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids) :]
        for ids in prompts
    ]
    answers = {tuple(ids): w.tolist() for ids, w in zip(prompts, want, strict=True)}
    drafters = [
        Drafter(),
        SecondGuess(answers, COMMON["vocab_size"], depth=3),
        SecondGuess(answers, COMMON["vocab_size"], depth=1),
    ]
    requests = [Request(ids, max_new_tokens=NEW_TOKENS, owner=i, drafter=drafters[i]) for i, ids in enumerate(prompts)]
    got = {r.owner: r.context[len(r.prompt_ids) :] for r in decode_all(Target(model, slots=3), requests)}
    for i in range(len(prompts)):
        assert got[i] == want[i].tolist(), f"{name}: prompt {i}"
    assert sum(requests[1].stats.accepted_per_depth) >= NEW_TOKENS // 2, (
        f"{name}: the trees beside plain rows committed little"
    )

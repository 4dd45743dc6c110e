"""Any causal LM: tiny random models of eight families (the SmolLM2 vocabulary size, 3 layers, float32).

For each family every drafter gives the tokens of the model's own greedy `generate` over a sequence
longer than twice the sliding window (Mistral: every layer windowed; Gemma 3: windowed and full layers
mixed), batched distillation decodes as `generate`, and each head kind builds and takes one training
step. docs/architecture.md's support table is what this test proves.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf
from transformers import AutoTokenizer

from headstart.heads.checkpoint import build_heads, save_heads, target_fingerprint
from headstart.heads.losses import eagle3_loss, eagle_loss, medusa_loss
from headstart.heads.vocab import DraftReadout
from headstart.runtime.batched import decode_batched
from headstart.runtime.drafters.model import layerskip_model
from headstart.runtime.drafters.registry import make_drafter
from headstart.train.config import LoraConfig
from headstart.train.medusa2 import AdaptedTarget, attach_lora, medusa2_loss
from helpers.exactness import assert_greedy_identity, random_heads
from helpers.models import tiny_tokenizer

WINDOW = 16
COMMON = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              max_position_embeddings=512, initializer_range=0.3)  # fmt: skip
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
DRAFTERS = ["none", "lookup", "layerskip", "model", "medusa", "eagle", "eagle+lookup", "eagle3", "eagle3+lookup"]
REFUSED = {("gpt_neox", "eagle"): "EAGLE heads cannot be built for GPTNeoXForCausalLM: it lacks a decoder layer that "
           "takes `cache=`"}  # fmt: skip
PROMPTS = [[5, 9, 3, 17, 22, 8, 41, 3, 17, 22, 8], [60, 12, 60, 12, 60, 7]]
NEW_TOKENS = 3 * WINDOW  # prompt + answer pass twice the window


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, model, tokenizer, {drafter base: options}) with random heads and a draft model saved to disk."""
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(FAMILIES[request.param](), attn_implementation="sdpa")
    model.eval().requires_grad_(False)
    model.generation_config.eos_token_id = None  # run every decode to its length
    root = tmp_path_factory.mktemp(request.param)
    # the draft model: every layer of the target, saved as a model of its own (its drafts are accepted, so
    # rounds commit long paths); layerskip: the first layer drafting a tree (accepted branches need not be first)
    layerskip_model(model, [0, 1, 2]).save_pretrained(root / "draft")
    tiny_tokenizer().save_pretrained(root / "draft")
    tokenizer = AutoTokenizer.from_pretrained(root / "draft")  # as the model drafter will load it
    options = {"layerskip": {"draft_layers": 1, "top_k": 2, "budget": 6}, "model": {"draft_model": str(root / "draft")}}
    for kind in ("medusa", "eagle", "eagle3"):
        if (request.param, kind) in REFUSED:
            continue
        heads = random_heads(kind, model, 0.05, **({"num_heads": 2} if kind == "medusa" else {}))
        extra = {"rank_accuracy": [[0.6, 0.2], [0.4]], "dtype": "float32"}
        save_heads(root / kind, heads, kind, {"num_heads": 2} if kind == "medusa" else {},
                   target_fingerprint(model), extra)  # fmt: skip
        options[kind] = {"heads": str(root / kind)}
    return request.param, model, tokenizer, options


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_greedy_identity_past_the_window(family, drafter):
    name, model, tokenizer, options = family
    base = drafter.removesuffix("+lookup")
    if (name, base) in REFUSED:  # refused up front, in one line naming the model class and what it lacks
        with pytest.raises(ValueError, match=REFUSED[name, base]):
            make_drafter(drafter, model, tokenizer, heads="unused")
        return
    built = make_drafter(drafter, model, tokenizer, **options.get(base, {}))
    accepted = assert_greedy_identity(model, built, PROMPTS, max_new_tokens=NEW_TOKENS)
    if drafter == "model":  # the target's own layers drafting: speculation really happened
        assert accepted > NEW_TOKENS, f"{name}: {accepted} draft tokens accepted"


def test_batched_distillation_decodes_as_generate(family):
    # several sequences at once, each at its own positions, past the sliding window: the tokens of `generate`
    name, model, _, _ = family
    prompts = [*PROMPTS, [*PROMPTS[0][:3], 30, 31]]
    got = dict(decode_batched(model, prompts, NEW_TOKENS, frozenset(), slots=2))
    for i, ids in enumerate(prompts):
        want = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids) :]
        assert got[i] == want.tolist(), f"{name}: prompt {i}"


@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle3", "medusa2"])
def test_each_head_kind_takes_a_training_step(family, kind):
    name, model, _, _ = family
    torch.manual_seed(0)
    if (name, kind) in REFUSED:
        with pytest.raises(ValueError, match=REFUSED[name, kind]):
            build_heads(kind, model)
        return
    heads = build_heads(kind, model, **({"num_heads": 2} if kind.startswith("medusa") else {}))
    ids = torch.randint(3, 1000, (2, 24))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[:, :4] = False
    states = model(input_ids=ids, output_hidden_states=True).hidden_states
    hidden = states[-1]
    trained = list(heads.parameters())
    if kind == "medusa2":  # a LoRA on every linear layer (a copy: the fixture's model is shared)
        joint = AdaptedTarget(attach_lora(copy.deepcopy(model), LoraConfig(r=2)), heads)
        trained += [p for p in joint.target.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in trained]
    optimizer = torch.optim.AdamW(trained, lr=1e-3)
    if kind == "medusa2":
        lm_head = model.get_output_embeddings()
        loss = medusa2_loss(joint, heads, lm_head, lm_head.weight, ids, torch.ones_like(ids), mask, 2, 1.0)
    elif kind == "medusa":
        loss = medusa_loss(heads, hidden, model.get_output_embeddings(), ids, mask, 2)
    elif kind == "eagle3":  # a Llama draft layer on any target: the fused layers and the final feature
        hidden = torch.cat([states[k] for k in (*heads.feature_layers, -1)], dim=-1)
        lm_head = DraftReadout(model.get_output_embeddings(), None)
        loss = eagle3_loss(heads, hidden, model.get_input_embeddings(), heads.logits, lm_head, ids, mask, unroll=2)
    else:
        loss, _ = eagle_loss(heads, hidden, model.get_input_embeddings(), model.get_output_embeddings(), ids, mask)
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss), f"{name}/{kind}: loss {loss}"
    moved = [not torch.equal(a, b) for a, b in zip(before, trained, strict=True)]
    n = len(list(heads.parameters()))
    assert any(moved[:n]) and (kind != "medusa2" or any(moved[n:]))  # medusa2: the LoRA's B (zero at first) too

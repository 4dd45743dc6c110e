"""Tiny random-weight models and a word-level tokenizer, all built offline (fp32, sdpa, frozen)."""

from __future__ import annotations

import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

# `accelerate launch` through this interpreter: works whether or not the venv's bin/ is on PATH.
ACCELERATE_LAUNCH = [sys.executable, "-m", "accelerate.commands.launch"]

WORDS = [
    "<unk>",
    "<eos>",
    "<bos>",
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "mat",
    "dog",
    "ran",
    "far",
    "away",
    "and",
    "then",
    "it",
    "was",
    "good",
    "bad",
    "big",
    "small",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "red",
    "blue",
    "green",
    "user",
    "assistant",
    ":",
    ".",
]


def tiny_llama(
    vocab_size: int = 64, seed: int = 0, init_std: float = 0.02, layers: int = 2, hidden_size: int = 64
) -> LlamaForCausalLM:
    """A 2-layer random Llama: hidden 64, 4 heads / 2 KV heads, fp32, sdpa attention, frozen."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=init_std,
        bos_token_id=2,
        eos_token_id=None,  # greedy identity tests run to max_new_tokens; tiny_model_dir sets one
        pad_token_id=0,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    return model


def tiny_tokenizer(words: list[str] = WORDS) -> PreTrainedTokenizerFast:
    """Whitespace word-level tokenizer over `words` (<unk>, <eos>, <bos> first) with a one-line chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", bos_token="<bos>", unk_token="<unk>")
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant : {% endif %}"
    )
    return tokenizer
